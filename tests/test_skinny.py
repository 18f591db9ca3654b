"""Decode-sized linear layers (engine/skinny.py): the same numbers as F.linear, to rounding."""
import pytest
import torch
import torch.nn.functional as F

from kvplay.engine.skinny import SkinnyLinear, max_rows, skinny_linear


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64])
def test_matches_f_linear(threads, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    b = torch.randn(300, generator=g)
    x = torch.randn(1, rows, 96, generator=g)
    y = skinny_linear(x, w, b, threads)
    assert y.shape == (1, rows, 300) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    if rows > max_rows(threads) or (rows == 1 and threads == 1):  # left to F.linear, bit for bit
        assert torch.equal(y, F.linear(x, w, b))


def test_mode_routes_only_linear():
    w = torch.randn(40, 16)
    x = torch.randn(2, 16)
    with SkinnyLinear(threads=2):
        y = F.linear(x, w)
        z = torch.relu(x)  # anything else passes through
    torch.testing.assert_close(y, x @ w.T)
    assert torch.equal(z, torch.relu(x))
