"""Decode-sized linear layers (engine/skinny.py): the same numbers as F.linear, to rounding."""
import pytest
import torch
import torch.nn.functional as F

import threading

from kvplay.engine.skinny import decode_step, install, max_rows, skinny_linear, skinny_mm


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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16, 26, 40, 256])
def test_skinny_mm_pads_to_sixteens_and_returns_the_rows(threads, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 48, generator=g)
    x = torch.randn(rows, 48, generator=g)
    y = skinny_mm(x, w, threads)
    assert y.shape == (rows, 200)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_installed_only_inside_decode_step_on_its_thread():
    lin = torch.nn.Linear(16, 40)
    install(lin)
    x = torch.randn(2, 16)
    calls = []
    real = torch.mm
    try:
        torch.mm = lambda *a: (calls.append(1), real(*a))[1]
        ref = F.linear(x, lin.weight, lin.bias)
        assert torch.equal(lin(x), ref) and not calls  # outside: F.linear, bit for bit
        with decode_step(2):
            torch.testing.assert_close(lin(x), ref)
            assert calls == [1]
            other = []
            th = threading.Thread(target=lambda: other.append(torch.equal(lin(x), ref)))
            th.start(), th.join()
            assert other == [True] and calls == [1]  # another thread is not in the step
        assert torch.equal(lin(x), ref) and calls == [1]
    finally:
        torch.mm = real
