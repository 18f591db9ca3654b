"""scripts/plot_serving.py: the serving table drawn from `scripts/serve_compare.py --json` files.
The files here are written by hand in serve_compare's format (its `results` dict and `measure`'s
rows); the figure is read back from matplotlib's own objects: one point per cell at the ratio of
the medians, its bar the rounds' min–max, a line at 1.0. A file in any other shape is one line on
stderr and exit 2."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from support import SCRIPTS
from support.scripts import load_script

from kvplay.options import pyplot

plot_serving = load_script("plot_serving")


def _figures(ttft, itl, tok_s):
    return {"ttft_p50_ms": ttft, "ttft_p95_ms": ttft * 1.3, "itl_p50_ms": itl, "output_tok_s": tok_s,
            "completed": 32, "num_prompts": 32}


def _row(threads, conc, limit, ratio, spread):
    v, k = _figures(110.0, 48.0, 19.0), _figures(80.0, 43.0, 21.5)
    return {"threads": threads, "concurrency": conc, "max_num_seqs": limit, "num_prompts": 32, "repeat": 3,
            "vllm": v, "kvplay": k, "ratio": ratio, "ratio_range": spread,
            "runs": {"vllm": [v, v, v], "kvplay": [k, k, k]}}


def serve_compare_file(limit=8) -> dict:
    """What `serve_compare.py --concurrency 1,8 --threads 1,2 --repeat 3 --json F` writes (the
    figures shortened; `--defaults`: limit None)."""
    rows = [
        _row(1, 1, limit, {"ttft": 1.51, "itl": 1.11, "tok_s": 1.15},
             {"ttft": [1.0, 1.53], "itl": [1.1, 1.16], "tok_s": [1.11, 1.16]}),
        _row(1, 8, limit, {"ttft": 2.1, "itl": 0.95, "tok_s": 1.25},
             {"ttft": [1.76, 2.11], "itl": [0.87, 1.36], "tok_s": [1.24, 1.31]}),
        _row(2, 1, limit, {"ttft": 1.41, "itl": 1.28, "tok_s": 1.36},
             {"ttft": [0.81, 1.5], "itl": [1.2, 1.36], "tok_s": [1.03, 1.38]}),
        _row(2, 8, limit, {"ttft": 1.82, "itl": None, "tok_s": 1.44},  # a round without a figure: no ratio
             {"ttft": [1.17, 1.84], "itl": [None, None], "tok_s": [1.09, 1.45]}),
    ]
    return {"when": "2026-12-05 08:37:12 UTC", "loadavg_start": [0.0, 0.1, 0.2],
            "args": {"concurrency": "1,8", "threads": "1,2", "repeat": 3, "json": "equal.json",
                     "max_num_seqs": limit, "defaults": limit is None},
            "limits": "at most 8 requests at once on both" if limit else "each server at its defaults",
            "runs": rows, "loadavg_end": [1.75, 1.2, 0.9]}


def write(tmp_path, name, doc) -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_load_gives_each_cells_ratio_and_its_rounds_range(tmp_path):
    t = plot_serving.load(write(tmp_path, "equal.json", serve_compare_file()))
    assert t["limit"] == 8 and t["when"] == "2026-12-05 08:37:12 UTC"
    assert set(t["rows"]) == {(1, 1), (1, 8), (2, 1), (2, 8)}
    assert t["rows"][(1, 8)]["itl"] == (0.95, 0.87, 1.36)
    assert t["rows"][(2, 8)]["itl"] == (None, None, None)
    assert plot_serving.title(t) == "equal limits (8 running)"
    d = plot_serving.load(write(tmp_path, "defaults.json", serve_compare_file(limit=None)))
    assert d["limit"] is None and plot_serving.title(d) == "each at its defaults"


def test_the_figure_draws_ratios_with_their_range_and_the_line_at_one(tmp_path):
    tables = [plot_serving.load(write(tmp_path, "e.json", serve_compare_file())),
              plot_serving.load(write(tmp_path, "d.json", serve_compare_file(limit=None)))]
    plt = pyplot()
    fig = plot_serving.figure(tables, plt)
    try:
        axes = fig.axes
        assert len(axes) == 6  # 2 files x (TTFT, ITL, tok/s)
        for ax in axes:
            assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.lines)  # the line at 1.0
        itl = axes[1]
        assert itl.get_title() == "ITL p50 · equal limits (8 running)"
        one_thread, two_threads = itl.containers  # one errorbar series per thread count
        assert list(one_thread.lines[0].get_ydata()) == [1.11, 0.95]
        (bars,) = one_thread.lines[2]
        assert [tuple(seg[:, 1]) for seg in bars.get_segments()] == [pytest.approx((1.1, 1.16)), pytest.approx((0.87, 1.36))]
        assert list(two_threads.lines[0].get_ydata()) == [1.28]  # the cell without a ratio is left out
        assert [t.get_text() for t in itl.get_xticklabels()] == ["1", "8"]
        assert axes[3].get_title() == "TTFT p50 · each at its defaults"
    finally:
        plt.close(fig)


def test_main_writes_the_png(tmp_path, capsys):
    out = tmp_path / "serving.png"
    rc = plot_serving.main([write(tmp_path, "e.json", serve_compare_file()),
                            write(tmp_path, "d.json", serve_compare_file(limit=None)), "-o", str(out)])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _broken(change):
    doc = serve_compare_file()
    change(doc)
    return doc


def _set(path, value):
    def change(doc):
        *head, last = path
        node = doc
        for k in head:
            node = node[k]
        node[last] = value
    return change


HOSTILE = {
    "not JSON": "{runs: [",
    "NaN": json.dumps(serve_compare_file()).replace("1.51", "NaN"),
    "a list": [serve_compare_file()],
    "no runs": {"when": "2026-12-05 08:37:12 UTC"},
    "no rows": _broken(_set(["runs"], [])),
    "a row not an object": _broken(_set(["runs", 0], "row")),
    "a ratio as text": _broken(_set(["runs", 0, "ratio", "ttft"], "1.5")),
    "a negative ratio": _broken(_set(["runs", 0, "ratio", "itl"], -1.1)),
    "a range of three": _broken(_set(["runs", 1, "ratio_range", "itl"], [0.8, 0.9, 1.0])),
    "a range upside down": _broken(_set(["runs", 1, "ratio_range", "itl"], [1.36, 0.87])),
    "half a range": _broken(_set(["runs", 1, "ratio_range", "itl"], [0.87, None])),
    "no ratio_range": _broken(lambda d: d["runs"][2].pop("ratio_range")),
    "threads 0": _broken(_set(["runs", 0, "threads"], 0)),
    "threads true": _broken(_set(["runs", 0, "threads"], True)),
    "concurrency as text": _broken(_set(["runs", 0, "concurrency"], "8")),
    "a cell twice": _broken(lambda d: d["runs"].append(copy.deepcopy(d["runs"][0]))),
    "limits that differ": _broken(_set(["runs", 3, "max_num_seqs"], 16)),
    "no time stamp": _broken(lambda d: d.pop("when")),
    "a time stamp with markup": _broken(_set(["when"], "$\\frac{1}{0}$ UTC")),
    "nested too deeply": "[" * 200_000 + "]" * 200_000,
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_file_in_another_shape_is_one_line_and_exit_2(tmp_path, capsys, case):
    out = tmp_path / "serving.png"
    rc = plot_serving.main([write(tmp_path, "bad.json", HOSTILE[case]), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, case
    assert err.count("\n") == 1 and err.startswith("plot_serving: ") and "Traceback" not in err, err
    assert not out.exists()


def test_bad_paths_are_one_line_and_exit_2(tmp_path, capsys):
    good = write(tmp_path, "e.json", serve_compare_file())
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe{}")
    for argv in ([str(tmp_path / "missing.json"), "-o", str(tmp_path / "s.png")],
                 [str(tmp_path / "bytes.json"), "-o", str(tmp_path / "s.png")],
                 [str(tmp_path), "-o", str(tmp_path / "s.png")],  # a directory
                 [good, "-o", str(tmp_path / "no" / "such" / "dir.png")],
                 [good, "-o", str(tmp_path / "serving.svg")]):
        assert plot_serving.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("plot_serving: "), err


def test_a_file_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path, capsys, monkeypatch):
    import kvplay.options

    monkeypatch.setattr(kvplay.options, "MAX_JSON_FILE", 1000)
    rc = plot_serving.main([write(tmp_path, "big.json", serve_compare_file()), "-o", str(tmp_path / "s.png")])
    assert rc == 2 and "larger than 1,000 bytes" in capsys.readouterr().err


def test_the_script_runs_as_a_command(tmp_path):
    """As the docs run it: its own process, exit codes as documented."""
    out = tmp_path / "serving.png"
    ok = subprocess.run([sys.executable, str(SCRIPTS / "plot_serving.py"),
                         write(tmp_path, "e.json", serve_compare_file()), "-o", str(out)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, str(SCRIPTS / "plot_serving.py"),
                          write(tmp_path, "bad.json", "[]"), "-o", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("plot_serving: ")
