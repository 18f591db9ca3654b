"""scripts/plot_labs.py: the labs' verdicts drawn from `kvplay lab NAME --json` files. The files
are written by hand in LabResult.to_dict()'s shape (each lab's `data`, shortened); the figure is
read back from matplotlib's objects. A file in another shape is one line and exit 2."""
from __future__ import annotations

import json

import pytest

from support.scripts import load_script

from kvplay.options import pyplot

plot_labs = load_script("plot_labs")


def _lab(name, data):
    return {"lab": name, "verdict": "…", "tables": [], "data": data, "model": "SmolLM2-135M-Instruct",
            "config": {}, "elapsed_s": 1.0}


def _leak_row(iso, blocks, probes, auc, lo, hi, **extra):
    return {"isolation": iso, "mitigation": "none", "blocks": blocks, "tokens": 16 * blocks, "probes": probes,
            "hit_ms": [70.0, 71.0], "miss_ms": [110.0, 112.0], "accuracy": 1.0, "n_hit": 102, "n_miss": 102,
            "auc": auc, "auc_lo": lo, "auc_hi": hi, "ks_d": 1.0, "ks_p": 6e-9, "call": "leak", "per_seed": [auc],
            "median_hit_ms": 70.5, "median_miss_ms": 111.0, "mean_ms": 90.0, **extra}


LEAK = _lab("leak", {
    "params": {}, "halfwidth_target": 0.08, "expected_halfwidth": 0.08,
    "results": [_leak_row("shared", 1, "content", 1.0, 1.0, 1.0),
                _leak_row("user", 4, "content", 0.52, 0.44, 0.6),
                _leak_row("user", 4, "control", 0.49, 0.41, 0.57)],
    "mitigations": [_leak_row("shared", 8, "content", 0.59, 0.51, 0.67, mitigation="delay", delay_ms=977.0,
                              pad_ms=None, extra_ms=421.0)]})


def _kind(n, bitwise, diverged, bitwise_ci, diverged_ci):
    return {"n": n, "bitwise": bitwise, "diverged": diverged, "bitwise_ci": bitwise_ci, "diverged_ci": diverged_ci,
            "max_delta": 0.0}


DETERMINISM = _lab("determinism", {"params": {}, "runs": [], "summary": {"modes": {
    "default": {"compared": 9, "bitwise": 6, "diverged": 0, "diverged_ci": [0.0, 0.34], "max_delta": 5e-5,
                "seconds": 20.0, "min_top2_gap_cold": 0.047,
                "by_kind": {"cold again": _kind(3, 3, 0, [0.29, 1.0], [0.0, 0.71]),
                            "warm": _kind(6, 6, 0, [0.54, 1.0], [0.0, 0.46]),
                            "batch": _kind(3, 0, 0, [0.0, 0.71], [0.0, 0.71])}},
    "deterministic": {"compared": 3, "bitwise": 3, "diverged": 0, "diverged_ci": [0.0, 0.71], "max_delta": 0.0,
                      "seconds": 27.0, "min_top2_gap_cold": 0.047,
                      "by_kind": {"cold again": _kind(0, 0, 0, [0.0, 1.0], [0.0, 1.0]),
                                  "warm": _kind(0, 0, 0, [0.0, 1.0], [0.0, 1.0]),
                                  "batch": _kind(3, 3, 0, [0.29, 1.0], [0.0, 0.71])}}},
    "deterministic_time_ratio": 1.35}})

COLLIDE = _lab("collide", {"params": {"bits": 16}, "pair": None, "demos": [], "scales": [],
                           "offline": {"n": 20000, "pairs": 3018, "expected": 3052.0, "ci": [2911.0, 3128.0],
                                       "bound_in_ci": True},
                           "feed": {"n": 400, "predicted": 2, "caught": 2, "false_hits": 0, "expected": 1.22,
                                    "ci": [0.24, 7.2], "bound_in_ci": True, "caught_ci": [0.16, 1.0],
                                    "false_hit_ci": [0.0, 0.009]}})

RESPONSE_CACHE = _lab("response-cache", {"params": {}, "response_cache": [], "kv_cache": [], "cold": [],
                                         "summary": {"users": ["alice", "bob", "carol"], "temperature": 0.8,
                                                     "response_cache_texts": ["hi", "hi", "hi"],
                                                     "kv_texts": ["hi", "yo", "hey"], "cold_texts": ["hi", "yo", "hey"],
                                                     "kv_equals_cold": [True, True, True],
                                                     "response_cache_got_first_ci": [0.16, 1.0],
                                                     "kv_equals_cold_ci": [0.29, 1.0]}})

ALL = {"leak": LEAK, "determinism": DETERMINISM, "collide": COLLIDE, "response-cache": RESPONSE_CACHE}


def write(tmp_path, name, doc) -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_each_lab_gives_its_statistics_with_their_intervals(tmp_path):
    title, _, ref, _, rows = plot_labs.load(write(tmp_path, "leak.json", LEAK))
    assert ref == 0.5
    assert [r[:4] for r in rows] == [("shared, 1 block", 1.0, 1.0, 1.0), ("user, 4 blocks", 0.52, 0.44, 0.6),
                                     ("user, 4 blocks, A/A control", 0.49, 0.41, 0.57),
                                     ("shared, 8 blocks, delay", 0.59, 0.51, 0.67)]
    *_, rows = plot_labs.load(write(tmp_path, "det.json", DETERMINISM))
    labels = [r[0] for r in rows]
    assert "default, warm: answer changed (0/6)" in labels and "default, batch: logits bitwise equal (0/3)" in labels
    assert not any(lbl.startswith("deterministic, warm") for lbl in labels)  # n = 0: nothing to draw
    _, _, ref, _, rows = plot_labs.load(write(tmp_path, "collide.json", COLLIDE))
    assert ref == 1.0 and rows[0][1:4] == pytest.approx((3018 / 3052, 2911 / 3052, 3128 / 3052))
    *_, rows = plot_labs.load(write(tmp_path, "rc.json", RESPONSE_CACHE))
    assert [r[:4] for r in rows] == [("response cache: later users given the first answer (2/2)", 1.0, 0.16, 1.0),
                                     ("KV prefix cache: answer = own seed, cold (3/3)", 1.0, 0.29, 1.0)]


def test_the_figure_has_a_panel_per_file_and_the_reference_lines(tmp_path):
    panels = [plot_labs.load(write(tmp_path, f"{n}.json", d)) for n, d in ALL.items()]
    plt = pyplot()
    fig = plot_labs.figure(panels, plt)
    try:
        leak_ax, det_ax, collide_ax, _ = fig.axes
        assert any(list(line.get_xdata()) == [0.5, 0.5] for line in leak_ax.lines)
        assert any(list(line.get_xdata()) == [1.0, 1.0] for line in collide_ax.lines)
        assert [c.lines[0].get_xdata()[0] for c in leak_ax.containers] == [1.0, 0.52, 0.49, 0.59]
        assert [t.get_text() for t in leak_ax.get_yticklabels()][1] == "user, 4 blocks"
        assert len(det_ax.containers) == 8  # 4 kinds with runs x (answer changed, bitwise equal)
    finally:
        plt.close(fig)


def test_main_writes_the_png(tmp_path):
    out = tmp_path / "labs.png"
    assert plot_labs.main([write(tmp_path, f"{n}.json", d) for n, d in ALL.items()] + ["-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def _changed(doc, change):
    doc = json.loads(json.dumps(doc))
    change(doc["data"])
    return doc


HOSTILE = {
    "not a lab": {"lab": "audit", "data": {}},
    "no data": {"lab": "leak"},
    "a list": [LEAK],
    "an AUC above 1": _changed(LEAK, lambda d: d["results"][0].update(auc=1.5)),
    "an AUC as text": _changed(LEAK, lambda d: d["results"][0].update(auc="0.5")),
    "an interval upside down": _changed(LEAK, lambda d: d["results"][1].update(auc_lo=0.7)),
    "an unknown isolation": _changed(LEAK, lambda d: d["results"][0].update(isolation="$x^2$")),
    "an unknown mitigation": _changed(LEAK, lambda d: d["mitigations"][0].update(mitigation="magic")),
    "blocks negative": _changed(LEAK, lambda d: d["results"][0].update(blocks=-1)),
    "too many rows": _changed(LEAK, lambda d: d.update(results=d["results"] * 100)),
    "an unknown mode": _changed(DETERMINISM, lambda d: d["summary"]["modes"].update(fast={})),
    "more equal runs than runs": _changed(DETERMINISM, lambda d: d["summary"]["modes"]["default"]["by_kind"]
                                          ["warm"].update(bitwise=7)),
    "a rate interval of one": _changed(DETERMINISM, lambda d: d["summary"]["modes"]["default"]["by_kind"]
                                       ["warm"].update(bitwise_ci=[0.5])),
    "no expected pairs": _changed(COLLIDE, lambda d: d["offline"].update(expected=0)),
    "a count as a float": _changed(COLLIDE, lambda d: d["feed"].update(predicted=2.5)),
    "one user": _changed(RESPONSE_CACHE, lambda d: d["summary"].update(users=["alice"])),
    "texts not one per user": _changed(RESPONSE_CACHE, lambda d: d["summary"].update(response_cache_texts=["x"])),
    "Infinity": json.dumps(COLLIDE).replace("3052.0", "Infinity"),
    "not JSON": "{lab: leak",
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_file_in_another_shape_is_one_line_and_exit_2(tmp_path, capsys, case):
    out = tmp_path / "labs.png"
    assert plot_labs.main([write(tmp_path, "bad.json", HOSTILE[case]), "-o", str(out)]) == 2, case
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plot_labs: ") and "Traceback" not in err, err
    assert not out.exists()
