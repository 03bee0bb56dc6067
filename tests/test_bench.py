"""Smoke tests of the benchmark (bench/) at a tiny size, so that it cannot rot. No speed assertions.

The end-to-end test compiles ours-compiled once, with the same tiny checkpoint and cache size as test_compile.py
(so both share Inductor's on-disk FX graph cache).
"""

import csv
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ lives beside the package, not inside it

from bench import models, report, roofline, runner, workloads  # noqa: E402

SYSTEMS = ["ours-compiled", "ours-eager", "hf-eager"]
POSITIVE = ["step_ms", "step_p90_ms", "canvas_ms", "ttfb_ms", "request_ms", "tok_s", "tok_per_fwd", "forwards",
            "tokens", "peak_mem_mb", "floor_ms", "floor_fraction"]


def _positive(row: dict, key: str) -> bool:
    x = float(row[key])
    return math.isfinite(x) and x > 0


def test_bench_end_to_end_on_a_tiny_checkpoint(tiny_dir, tmp_path):
    """One block of 8 tokens, 2 fixed steps, three systems: markdown + CSV with every row, column and ratio."""
    from bench.__main__ import main

    res = main(["--checkpoint", str(tiny_dir), "--model", "tiny", "--device", "cpu", "--prompt-len", "5",
                "--output-len", "8", "--steps", "2", "--repeats", "1", "--systems", ",".join(SYSTEMS),
                "--in-process", "--max-seq-len", "64", "--bandwidth", "1e10", "--out", str(tmp_path)])
    md_path, csv_path = res["paths"]
    assert md_path.name.startswith("tiny_cpu_") and md_path.suffix == ".md" and csv_path.suffix == ".csv"
    rows = list(csv.DictReader(open(csv_path)))
    assert [r["system"] for r in rows] == SYSTEMS
    assert set(report.CSV_FIELDS) <= set(rows[0])
    for r in rows:
        assert r["status"] == "ok", r
        assert r["workload"] == "fixed" and r["torch"] and r["transformers"] and r["python"]
        for key in POSITIVE:
            assert _positive(r, key), (r["system"], key, r[key])
        assert int(r["tokens"]) == 8 and int(r["forwards"]) == 2  # one block, two steps, batch 1
    base, others = rows[0], rows[1:]
    assert _positive(base, "compile_s") and _positive(base, "unit_step_ms")
    for r in others:
        for key, _ in report.RATIOS:
            assert _positive(r, f"speedup_{key}"), (r["system"], key)
    md = md_path.read_text()
    assert md == res["markdown"]
    for needle in ["| system | step ms median", "Speedup of ours-compiled", "Roofline", "torch ", "transformers ",
                   "threads", "How each system was timed"] + [f"| {s} |" for s in SYSTEMS]:
        assert needle in md, needle


def test_a_failing_system_is_reported_not_raised():
    """The per-process runner turns a failure into an "n/a (reason)" row."""
    payload = dict(system="no-such-system", model={"name": "demo", "checkpoint": str(models.DEMO_DIR), "direct": None},
                   workload=workloads.WorkloadSpec().to_dict(), device="cpu", dtype=None, threads=1)
    out = runner.run_isolated(payload, timeout_s=120, log=lambda *a: None)
    assert out["status"].startswith("n/a (ValueError: unknown system")
    rows = report.with_ratios([report.summarize(out)])
    assert "n/a" in report.markdown({"model": "x", "device_tag": "cpu", "date": "d"},
                                    [report.section("w", "d", [out], None)])
    assert math.isnan(rows[0]["speedup_step_ms"])


def test_roofline_of_the_full_model_matches_the_reference_figures():
    """REFERENCE.md: ~27.6 GB read per FP8 forward at batch 1, every expert touched by a 256-token canvas."""
    cfg = models.full_config()
    assert roofline.total_weight_bytes(cfg, 1) == pytest.approx(25.25e9, rel=0.01)
    assert roofline.expected_experts(128, 8, 256) == pytest.approx(128, abs=1e-3)
    assert roofline.expected_experts(128, 8, 1) == pytest.approx(8)
    r = roofline.for_workload(cfg, batch=1, prompt_len=1024, output_len=1024, steps=16, dtype_bytes=1,
                              bandwidth=roofline.H200_BANDWIDTH)
    assert r.denoise.bytes == pytest.approx(27.6e9, rel=0.1)
    assert r.ar.bytes < r.denoise.bytes / 5 and r.commit.bytes < r.denoise.bytes


def test_fixed_workload_is_the_same_for_every_system():
    cfg = models.full_config(tiny=True)
    import dgemma_compile as dg

    w = workloads.build(workloads.WorkloadSpec(prompt_len=10, output_len=128, steps=4), cfg, dg.GenerationConfig())
    (req,) = w.requests
    assert [len(p) for p in req.prompts] == [10] and req.prompts[0][0] == cfg.bos_token_id
    assert not set(req.prompts[0][1:]) & set(cfg.eos_token_ids)
    assert w.config.stop_early is False and w.config.eos_token_ids == () and w.config.max_denoising_steps == 4
    assert w.hf_kwargs == dict(max_new_tokens=128, max_denoising_steps=4, stability_threshold=4, eos_token_id=[])
    with pytest.raises(ValueError, match="multiple of the canvas"):
        workloads.build(workloads.WorkloadSpec(output_len=100), cfg, dg.GenerationConfig())
