"""bench/parallelism.py: d3LLM's AUP against hand-computed values, the frontier, the sweep's plan, and its CSV /
markdown / plot writing (synthetic results: fast; one tiny real sweep: slow)."""

import csv
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ lives beside the package, not inside it

import dgemma_compile as dg  # noqa: E402
from bench import parallelism as P  # noqa: E402


def test_aup_matches_a_hand_computed_value():
    # (1, 80), (2, 80), (3, 77), (4, 50): y_min = 80 - 5 = 75 drops (4, 50); y_max = 80.
    # W(80) = 1, W(77) = exp(-3 (1 - 77/80)) = exp(-0.1125) = 0.893597...
    # AUP = 1*80 + 1/2*1*(80 + 80) + 1/2*1*(80 + 77*0.893597) = 80 + 80 + 74.40350 = 234.40350
    pts = [(2, 80), (1, 80), (4, 50), (3, 77)]  # any order
    assert P.aup(pts) == pytest.approx(234.40350, abs=1e-4)
    # y_max above the curve (another method's best) weighs every point: W(80) = exp(-3 * 0.2) at y_max = 100
    w80, w77 = math.exp(-0.6), math.exp(-3 * 0.23)
    assert P.aup(pts, y_max=100) == pytest.approx(80 + 0.5 * 160 * w80 + 0.5 * (80 * w80 + 77 * w77))
    assert P.aup([(1.0, 37.0)]) == 37.0  # an AR model: one point at 1 token per forward scores its accuracy
    assert P.aup([(2.0, 100), (9.0, 100)]) == pytest.approx(900.0)  # flat at y_max: the plain area, rho_m * y


@pytest.mark.parametrize("bad", [[], [(0, 50)], [(1, 101)], [(1, 50), (1, 60)]])
def test_aup_refuses_what_the_definition_does_not_cover(bad):
    with pytest.raises(ValueError):
        P.aup(bad)


def test_frontier_keeps_the_points_no_other_beats_on_both_axes():
    pts = [(1.0, 100.0), (2.0, 100.0), (2.0, 90.0), (3.0, 95.0), (1.5, 99.0), (4.0, 20.0)]
    assert P.frontier(pts) == [1, 3, 5]  # (2, 100) beats (1, 100), (1.5, 99), (2, 90); (3, 95) and (4, 20) stand
    assert P.frontier([(1.0, 50.0), (1.0, 50.0)]) == [0]


def test_plan_starts_at_the_default_and_runs_each_config_once():
    default = dg.GenerationConfig(entropy_bound=0.5, confidence_threshold=0.01, max_denoising_steps=16,
                                  stability_threshold=1)
    pts = P.plan(default)
    assert pts[0].family == "default" and pts[0].config == default
    assert len({p.config for p in pts}) == len(pts)
    assert {p.family for p in pts} == {"default", "joint", *P.SWEEP}
    assert not any(p.label == "entropy_bound=0.5" for p in pts)  # the default's own value is the default point
    for p in pts:
        if p.family in P.SWEEP:  # one knob moved, the others at the default
            assert [k for k in P.KNOBS if getattr(p.config, k) != getattr(default, k)] == [p.family]
    smoke = P.plan(default, P.SMOKE, ())
    assert [p.label for p in smoke] == ["default", "stability_threshold=0", "max_denoising_steps=2"]


def _result(label, family, config, exact, tokens, forwards, blocks=4):
    return P.Result(P.Point(label, family, config), exact, {t: exact for t in P.T.TASKS}, tokens, forwards, blocks,
                    4, 0.1)


def test_outputs_from_synthetic_results(tmp_path):
    d = dg.GenerationConfig()
    results = [_result("default", "default", d, 100.0, 40, 10),
               _result("max_denoising_steps=1", "max_denoising_steps", d.replace(max_denoising_steps=1), 75.0, 40, 4),
               _result("AR (bench/ar.py)", "ar", None, 50.0, 40, 40, blocks=0)]
    for i in P.frontier([(r.tokens_per_forward, r.exact_match) for r in results[:2]]):
        results[i].frontier = True
    sc = P.scores(results)
    assert sc["aup"] == pytest.approx(P.aup([(4, 100), (10, 75)], y_max=100)) and sc["aup_ar"] == 50.0
    rows = list(csv.DictReader(open(P.write_csv(results, tmp_path / "x.csv"))))
    assert list(rows[0]) == P.CSV_FIELDS
    assert [r["family"] for r in rows] == ["default", "max_denoising_steps", "ar"]
    assert [float(r["tokens_per_forward"]) for r in rows] == [4.0, 10.0, 1.0]
    assert [r["frontier"] for r in rows] == ["1", "1", "0"] and rows[2]["entropy_bound"] == ""
    md = P.markdown(results, sc, command="python -m bench.parallelism --n 4", n=4, offset=0, seconds=1.0, plot=None)
    assert "AUP (d3LLM, alpha 3)" in md and "| **default** |" in md and md.count("\n| ") == 4  # header + 3 rows
    pytest.importorskip("matplotlib")
    png = P.write_plot(results, tmp_path / "x.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_tiny_sweep_writes_its_csv_markdown_and_plot(tmp_path):
    res = P.main(["--n", "4", "--points", "smoke", "--out", str(tmp_path), "--prefix", "t_"])
    rows = list(csv.DictReader(open(res["paths"][0])))
    assert [r["family"] for r in rows] == ["default", "stability_threshold", "max_denoising_steps", "ar"]
    assert all(r["prompts"] == "4" for r in rows) and rows[-1]["tokens_per_forward"] == "1.0000"
    assert 0 <= float(rows[0]["exact_match"]) <= 100 and float(rows[0]["tokens_per_forward"]) > 1
    assert res["paths"][1].read_text().startswith("# Accuracy under parallelism")
    assert math.isfinite(res["scores"]["aup"])
