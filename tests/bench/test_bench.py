"""Smoke tests of the benchmark (bench/) at a tiny size, so that it cannot rot. No speed assertions.

The end-to-end test compiles ours-compiled once, with the same tiny checkpoint and cache size as test_compile.py
(so both share Inductor's on-disk FX graph cache). The runner tests check the protocol with real worker processes:
round-robin order (from the runner and from the workers' own clocks), failures, timeouts and crashes as "n/a" rows.
"""

import ast
import csv
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ lives beside the package, not inside it

from bench import models, report, roofline, runner, workloads  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"
SYSTEMS = ["ours-compiled", "ours-eager", "hf-eager"]
POSITIVE = ["step_min_ms", "step_ms", "step_p90_ms", "pass_min_ms", "pass_ms", "pass_p90_ms", "canvas_ms", "ttfb_ms",
            "request_ms", "tok_s", "tok_per_fwd", "forwards", "tokens", "peak_mem_mb", "floor_ms", "floor_fraction"]


def _positive(row: dict, key: str) -> bool:
    x = float(row[key])
    return math.isfinite(x) and x > 0


def _round_robin(systems: list[str], repeats: int) -> list[tuple[int, str]]:
    return [(i, s) for i in range(repeats) for s in systems]


def _order_from_workers(raw: list[dict]) -> list[tuple[int, str]]:
    """(repeat index, system) of every timed repeat, sorted by the start time each worker recorded itself."""
    starts = [(t, i, r["system"]) for r in raw if r.get("status") == "ok" for i, t in enumerate(r["repeat_started"])]
    return [(i, s) for _, i, s in sorted(starts)]


def _payloads(tiny_dir, systems: list[str], **workload) -> list[dict]:
    spec = models.ModelSpec(name="tiny", checkpoint=str(tiny_dir))
    w = workloads.WorkloadSpec(prompt_len=5, output_len=8, steps=2, **workload).to_dict()
    return [dict(system=s, model=dataclasses.asdict(spec), workload=w, device="cpu", dtype=None, threads=1,
                 max_seq_len=64) for s in systems]
@pytest.mark.slow
def test_bench_end_to_end_on_a_tiny_checkpoint(tiny_dir, tmp_path):
    """One block of 8 tokens, 2 fixed steps, three systems, 2 repeats round-robin: markdown + CSV with every row,
    column, spread and ratio."""
    from bench.__main__ import main

    res = main(["--checkpoint", str(tiny_dir), "--model", "tiny", "--device", "cpu", "--prompt-len", "5",
                "--output-len", "8", "--steps", "2", "--repeats", "2", "--systems", ",".join(SYSTEMS),
                "--in-process", "--max-seq-len", "64", "--bandwidth", "1e10", "--out", str(tmp_path)])
    assert res["order"] == {"fixed": _round_robin(SYSTEMS, 2)}
    assert _order_from_workers(res["sections"][0].raw) == _round_robin(SYSTEMS, 2)
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
        assert int(r["repeats_timed"]) == 2
        assert float(r["step_min_ms"]) <= float(r["step_ms"]) <= float(r["step_p90_ms"])
        assert float(r["pass_min_ms"]) <= float(r["pass_ms"]) <= float(r["pass_p90_ms"])
        assert float(r["pass_p90_over_min"]) >= 1
    base, others = rows[0], rows[1:]
    assert _positive(base, "compile_s") and _positive(base, "unit_step_ms")  # unit time: Observer.on_unit
    assert float(base["unit_step_ms"]) <= float(base["step_ms"])  # each unit span lies inside its step span
    for r in others:
        for key, _ in report.RATIOS:
            assert _positive(r, f"speedup_{key}"), (r["system"], key)
    raw = {r["system"]: r for r in res["sections"][0].raw}
    # ours-compiled: a step is an iteration of its compiled step (the 5-token prompt's prefill chunk, then 2 denoise
    # steps; one block, so no commit), each one unit span; the others time their 2 denoise steps; x 2 repeats
    assert len(raw["ours-compiled"]["extra"]["unit_step_s"]) == len(raw["ours-compiled"]["step_s"]) == (1 + 2) * 2
    assert all(len(r["step_s"]) == 2 * 2 for s, r in raw.items() if s != "ours-compiled")
    assert all(len(r["canvas_s"]) == len(r["ttfb_s"]) == 2 for r in raw.values())  # one block end per request
    md = md_path.read_text()
    assert md == res["markdown"]
    for needle in ["| system | step ms min | step ms median | step ms p90", "Spread over the timed repeats",
                   "| pass ms min | pass ms median | pass ms p90", "schedule: interleaved", "round-robin",
                   "Speedup of ours-compiled", "pass, paired", "Roofline", "torch ", "transformers ", "threads",
                   "How each system was timed", "Observer.on_step"] + [f"| {s} |" for s in SYSTEMS]:
        assert needle in md, needle
@pytest.mark.slow
def test_worker_processes_interleave_round_robin_and_a_failure_is_a_row(tiny_dir):
    """Real workers: two live systems and one that fails to prepare; the timed repeats alternate between the live
    ones (as the workers' own clocks show), the failing one becomes "n/a (reason)" and the others carry on."""
    systems = ["ours-eager", "no-such-system", "hf-eager"]
    m = runner.measure(_payloads(tiny_dir, systems, repeats=3), 3, timeout_s=300, log=lambda *a: None)
    live = ["ours-eager", "hf-eager"]
    assert m.order == _round_robin(live, 3)
    assert _order_from_workers(m.results) == _round_robin(live, 3)
    assert [r["system"] for r in m.results] == systems
    assert m.results[1]["status"].startswith("n/a (ValueError: unknown system")
    assert m.results[0]["status"] == m.results[2]["status"] == "ok"
    rows = report.with_ratios([report.summarize(r) for r in m.results])
    assert math.isnan(rows[1]["speedup_step_ms"])
    md = report.markdown({"model": "x", "device_tag": "cpu", "date": "d"}, [report.section("w", "d", m.results, None)])
    assert "| no-such-system | n/a (ValueError" in md


@pytest.mark.slow
@pytest.mark.parametrize("interleave", [True, False])
def test_in_process_order_and_budget(tiny_dir, interleave):
    """In one process: round-robin, or one system after the other; a time budget of 0 s stops after one repeat."""
    systems = ["ours-eager", "hf-eager"]
    m = runner.measure(_payloads(tiny_dir, systems, repeats=2), 2, interleave=interleave, isolated=False,
                       log=lambda *a: None)
    expected = _round_robin(systems, 2) if interleave else [(i, s) for s in systems for i in range(2)]
    assert m.order == expected and _order_from_workers(m.results) == expected
    m = runner.measure(_payloads(tiny_dir, systems[:1], repeats=2), 2, isolated=False, budget_s=0.0,
                       log=lambda *a: None)
    assert len(m.results[0]["repeat_s"]) == 1 and "time budget: 1 of 2 timed repeats" in m.results[0]["notes"]
@pytest.mark.slow
def test_a_timeout_and_a_crash_are_rows_not_errors(tiny_dir):
    """A worker past its time limit is killed (n/a, timed out); a worker that dies answers as n/a with its status."""
    (p,) = _payloads(tiny_dir, ["ours-eager"], repeats=1)
    m = runner.measure([p], 1, timeout_s=0.2, log=lambda *a: None)
    assert m.results[0]["status"] == "n/a (timed out after 0.2 s)" and m.order == []
    # the run's deadline (`--deadline-s`, bench/gpu_run.sh's time box) cuts a wait shorter than the system's timeout
    m = runner.measure([p], 1, timeout_s=60, deadline=time.perf_counter() + 0.2, log=lambda *a: None)
    assert m.results[0]["status"].startswith("n/a (timed out at the run's deadline") and m.order == []
    w = runner.WorkerProcess("ours-eager", threads=1, timeout_s=60)
    os.kill(w.proc.pid, signal.SIGKILL)
    reply = w.call({"op": "prepare", "payload": p})
    assert not reply["ok"] and reply["result"]["status"] == f"n/a (worker exited with status {-signal.SIGKILL})"
def test_the_multi_gpu_check_of_gpu_check_skips_with_one_line_without_two_gpus(capsys):
    from bench import gpu_check

    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("2+ CUDA devices: the check would run")
    assert gpu_check.check_tensor_parallel() is True
    assert capsys.readouterr().out.startswith("tensor parallel (multi-GPU): skipped, ")


@pytest.mark.slow
def test_the_observer_check_of_gpu_check_runs_on_a_cpu(tiny_dir):
    """bench/gpu_check.py imports without a GPU, says so, and its observer check holds on the eager generator and on
    the compiled one (two blocks: a prefill chunk, denoise steps, a commit; compiled as the end-to-end test's
    ours-compiled is, so Inductor's FX graph cache serves it)."""
    import dgemma_compile as dg
    from bench import gpu_check
    from dgemma_compile.compile import CompileOptions

    import torch

    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 2
    model = dg.load(tiny_dir)
    cfg = model.generation_config.replace(max_new_tokens=16)
    assert gpu_check.check_observer(lambda *a, **k: dg.generate(model, *a, **k), cfg, "eager cpu", compiled=False)
    fixed = cfg.replace(max_denoising_steps=2, stop_early=False, eos_token_ids=())
    gen = dg.build(model, CompileOptions(batch_buckets=(1,), max_seq_len=64))
    assert gpu_check.check_observer(gen.generate, fixed, "compiled cpu", compiled=True)


def _private_uses(path: Path) -> list[str]:
    """Reaches into private state: `x._name` on anything but `self` (bench's own classes), except transformers'
    `_denoising_step` and `torch._grouped_mm` (torch's grouped GEMM, measured as the kernel the experts use); private names imported from dgemma_compile; getattr/setattr/delattr with a "_..." name;
    `patched(...)` of anything but transformers' `_denoising_step`."""
    bad = []
    for n in ast.walk(ast.parse(path.read_text())):
        where = f"{path.name}:{getattr(n, 'lineno', '?')}"
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            own = isinstance(n.value, ast.Name) and n.value.id == "self"
            if not own and n.attr != "_denoising_step" and ast.unparse(n) != "torch._grouped_mm":
                bad.append(f"{where} {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("dgemma_compile"):
            names = n.module.split(".") + [a.name for a in n.names]
            if any(x.startswith("_") for x in names):
                bad.append(f"{where} from {n.module} import {[a.name for a in n.names]}")
        elif isinstance(n, ast.Import):
            bad += [f"{where} import {a.name}" for a in n.names
                    if a.name.startswith("dgemma_compile") and any(x.startswith("_") for x in a.name.split("."))]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            args = [a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if n.func.id in ("getattr", "setattr", "delattr") and any(a.startswith("_") for a in args):
                bad.append(f"{where} {ast.unparse(n)}")
            if n.func.id == "patched" and args != ["_denoising_step"]:
                bad.append(f"{where} {ast.unparse(n)}")
    return bad


def test_bench_uses_public_api_only(tmp_path):
    """bench/README.md: bench and the GPU check use public hooks, never private attributes of dgemma_compile."""
    files = sorted(BENCH.glob("*.py"))
    assert len(files) >= 10
    assert [b for f in files for b in _private_uses(f)] == []
    probe = tmp_path / "probe.py"  # the checker flags what it exists for, so the empty list above means something
    probe.write_text("gen._buckets\nfrom dgemma_compile.step.requests import _seeds\npatched(CompiledSteps, 'step', f)\n"
                     "getattr(gen, '_buckets')\nself._x\nmodel._denoising_step\npatched(m, '_denoising_step', f)\n")
    assert len(_private_uses(probe)) == 4


def test_roofline_of_the_full_model_matches_the_reference_figures():
    """The released config's figures (bench/models.py): ~27.6 GB read per FP8 forward at batch 1, every expert
    touched by a 256-token canvas."""
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


@pytest.mark.slow
def test_a_quantized_system_row_has_its_scheme_bytes_and_ratio(tiny_dir, tmp_path):
    """`ours-compiled-fp8` beside ours-compiled on the tiny checkpoint (float32 on disk: a quantized system makes every
    system load in bf16), and the W4A4 scheme, which dg.quantize refuses on a CPU, as an n/a row: the quantized table
    gives each row's scheme, weight bytes (the QuantReport's) and its ratios to bf16 ours-compiled of the same run."""
    pytest.importorskip("torchao")
    from bench.__main__ import main

    chosen = ["ours-compiled", "ours-compiled-fp8", "ours-compiled-nvfp4"]
    res = main(["--checkpoint", str(tiny_dir), "--model", "tiny", "--device", "cpu", "--prompt-len", "5",
                "--output-len", "8", "--steps", "2", "--repeats", "2", "--systems", ",".join(chosen),
                "--in-process", "--max-seq-len", "64", "--bandwidth", "1e10", "--out", str(tmp_path)])
    assert res["order"] == {"fixed": _round_robin(chosen[:2], 2)}
    rows = {r["system"]: r for r in csv.DictReader(open(res["paths"][1]))}
    base, fp8, w4a4 = (rows[s] for s in chosen)
    assert base["status"] == fp8["status"] == "ok" and base["dtype"] == fp8["dtype"] == "bfloat16"
    assert base["quant_scheme"] == "none" and fp8["quant_scheme"] == "fp8"
    assert int(base["weight_bytes"]) == int(base["weight_bytes_before"]) == int(fp8["weight_bytes_before"])
    assert 0 < int(fp8["weight_bytes"]) < int(fp8["weight_bytes_before"])
    assert float(fp8["quant_weights"]) == pytest.approx(int(fp8["weight_bytes"]) / int(base["weight_bytes"]), rel=1e-4)
    assert float(fp8["quant_step"]) == pytest.approx(float(fp8["step_ms"]) / float(base["step_ms"]), rel=1e-3)
    assert float(fp8["quant_tok_s"]) == pytest.approx(float(fp8["tok_s"]) / float(base["tok_s"]), rel=1e-3)
    for key in ("quant_request", "quant_pass_paired", "speedup_step_ms"):
        assert _positive(fp8, key), key
    assert w4a4["status"].startswith("n/a (ConfigError: quant scheme 'nvfp4'")
    raw = {r["system"]: r for r in res["sections"][0].raw}
    assert raw["ours-compiled-fp8"]["extra"]["quant"]["quantized"] > 0
    assert any("dg.quantize(model, 'fp8')" in n for n in raw["ours-compiled-fp8"]["notes"])
    md = res["markdown"]
    table = md[md.index("Quantized vs bfloat16 ours-compiled"):]
    mib = lambda r: report._fmt(int(r["weight_bytes"]) / 2**20)  # noqa: E731
    for needle in ["| system | scheme | dtype | weights MiB | weights / base | step ms median | tok/s | step time",
                   f"| ours-compiled | none | bfloat16 | {mib(base)} | 1.00x |",
                   f"| ours-compiled-fp8 | fp8 | bfloat16 | {mib(fp8)} | {float(fp8['quant_weights']):.2f}x |",
                   "| ours-compiled-nvfp4 | n/a (ConfigError"]:
        assert needle in table, needle


def _raw(system: str, dtype: str, scheme: str, weights: int, pass_s: list[float], step_s: float) -> dict:
    """A raw result as `Session.result()` returns it (only what `report.summarize` reads)."""
    return dict(system=system, status="ok", dtype=dtype, timing="", step_s=[step_s] * 4, canvas_s=[4 * step_s],
                ttfb_s=[4 * step_s], request_s=pass_s, repeat_s=pass_s, repeat_started=[0.0] * len(pass_s), tokens=8,
                forwards=2, compile_s=1.0, peak_mem_mb=1.0, notes=[],
                extra=dict(quant=dict(scheme=scheme, bytes_before=1000, bytes_after=weights, seconds=0.1)))


def test_quantized_rows_ratios_against_the_baseline_of_the_same_run():
    """The quantized table's arithmetic: ratios quantized / bf16 ours-compiled (time and tok/s alike), pass, paired
    per round; a dtype mismatch is flagged; without the baseline there are no ratios."""
    from bench import systems

    import dgemma_compile.quant as q

    assert systems.QUANT_SCHEMES == q.SCHEMES
    assert [systems.quant_scheme(s) for s in ("ours-compiled", "ours-compiled-fused", "ours-compiled-nvfp4-w4a16")] == \
        [None, None, "nvfp4-w4a16"]
    from bench.__main__ import default_systems

    assert not set(default_systems(models.ModelSpec(name="x", checkpoint="/x"))) & set(systems.QUANT_SYSTEMS)
    raw = [_raw("ours-compiled", "bfloat16", "none", 1000, [1.0, 2.0], 0.010),
           _raw("ours-compiled-fp8", "bfloat16", "fp8", 600, [1.5, 2.0], 0.015),
           _raw("ours-compiled-nvfp4-w4a16", "float32", "nvfp4-w4a16", 400, [3.0, 4.0], 0.030)]
    rows = report.with_ratios([report.summarize(r) for r in raw])
    fp8, nv = report.quant_rows(rows)
    assert fp8["quant_weights"] == pytest.approx(0.6) and fp8["quant_step"] == pytest.approx(1.5)
    assert fp8["quant_tok_s"] == pytest.approx((8 / 1.75) / (8 / 1.5))  # tok/s from the median pass
    assert fp8["quant_pass_paired"] == pytest.approx(1.25)  # median of 1.5 / 1.0 and 2.0 / 2.0
    assert fp8["same_dtype"] and not nv["same_dtype"]
    md = "\n".join(report.quant_markdown(rows))
    assert "| ours-compiled-fp8 | fp8 | bfloat16 |" in md and "0.60x |" in md
    assert "WARNING: ours-compiled-nvfp4-w4a16 ran in float32 and ours-compiled in bfloat16" in md
    (alone,) = report.quant_rows(report.with_ratios([report.summarize(raw[1])]))
    assert math.isnan(alone["quant_step"]) and math.isnan(alone["quant_pass_paired"])
    assert "No ratios" in "\n".join(report.quant_markdown(report.with_ratios([report.summarize(raw[1])])))


def test_startup_dry_run_plans_every_command_with_its_caches(tmp_path, capsys):
    """bench/startup.py without running anything: every command in every scenario; empty and warm share each
    command's two cache directories, the new venv keeps DGEMMA_CACHE_DIR but gets a fresh TORCHINDUCTOR_CACHE_DIR;
    warm alone starts with untimed warm-up runs; the stats line, ratios and targets are parsed and judged."""
    from bench import startup

    this, other = startup.Venv("this", Path(sys.prefix)), startup.Venv("new", tmp_path / "venv2")
    layout = startup.Layout(tmp_path / "root")
    steps = startup.plan(list(startup.SCENARIOS), layout, this, other, repeats=2, port=8000)
    by = {(s.scenario, s.round, s.command.key): s for s in steps}
    assert [s.scenario for s in steps] == ["empty"] * 5 + ["warm"] * 10 + ["new-venv"] * 5
    assert [s.command.key for s in steps[5:15]] == list(startup.KEYS) * 2  # round-robin
    for key in startup.KEYS:
        empty, warm, new = by["empty", 0, key], by["warm", 1, key], by["new-venv", 0, key]
        assert (empty.dgemma_cache, empty.inductor_cache) == (warm.dgemma_cache, warm.inductor_cache)
        assert new.dgemma_cache == empty.dgemma_cache and new.inductor_cache != empty.inductor_cache
        assert Path(new.command.argv[0]).is_relative_to(other.root)
    assert len({s.dgemma_cache for s in steps}) == 5  # one directory per command
    assert by["empty", 0, "serve"].command.argv[1:] == ("serve",)  # default port flags
    assert by["empty", 0, "prompts-file"].command.argv[1:] == ("generate", "--prompts-file",
                                                                str(layout.prompts_file))
    env = startup.environment_for(by["new-venv", 0, "generate"])
    assert env["DGEMMA_CACHE_DIR"] == str(layout.dgemma_cache("generate")) and "PYTHONPATH" not in env
    warm_only = startup.plan(["warm"], layout, this, None, repeats=1, port=8001, serve=False)
    assert [(s.timed, s.command.key) for s in warm_only] == \
        [(False, k) for k in startup.KEYS if k != "serve"] + [(True, k) for k in startup.KEYS if k != "serve"]

    assert startup.main(["--dry-run", "--new-venv", str(tmp_path / "v2"), "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "pip install torch==2.13.0" in out and f"{startup.REPO}[serve]" in out
    assert out.count("[new-venv r0] DGEMMA_CACHE_DIR=$ROOT/caches/") == 5 and "inductor-new-venv" in out
    assert not list(tmp_path.glob("v2*"))  # nothing made

    fields = startup.parse_stats("dgemma: compiling...\ntokens=5 mean_steps_per_block=2.00 finish=stop "
                                 "compile_s=31.4 step=loaded ttfb_s=0.120 threads=1\n")
    assert fields == {"compile_s": "31.4", "step": "loaded", "ttfb_s": "0.120"}
    assert startup.parse_stats("tokens=5 mean_steps_per_block=2.00 compile_s=3.0") == {"compile_s": "3.0"}

    def run(key, r, first, exit_s, stderr=""):
        step = startup.Step("warm", startup.Command(key, key, ("x",)), Path("d"), Path("i"), round=r)
        return startup.Run(step, first_s=first, exit_s=exit_s, stdout="1 2 3 5 9\n", stderr=stderr,
                           fields=startup.parse_stats(stderr))

    runs = [run("transformers", 0, 4.0, 4.1), run("generate", 0, 2.0, 2.5, "compile_s=0.5 step=loaded"),
            run("transformers", 1, 8.0, 8.1), run("generate", 1, 10.0, 10.5), run("help", 0, 0.1, 0.2),
            run("prompts-file", 0, 5.0, 9.0)]
    rows = {r["key"]: r for r in startup.summarize(runs, "warm", baseline_file_s=8.0)}
    assert rows["generate"]["ratio"] == pytest.approx(0.875)  # median of 2/4 and 10/8, paired per round
    assert rows["generate"]["target"] == "<= 1.0x transformers: met" and rows["generate"]["step"] == "loaded"
    assert rows["help"]["target"] == "< 0.5 s: met" and rows["prompts-file"]["target"].endswith("missed")
    assert startup.target(rows["generate"], "empty", None) == "<= 1.5x transformers: met"


@pytest.mark.slow
def test_running_server_is_ready_when_health_answers_and_stops_on_exit():
    """`bench.server.running_server`, the one server start of bench.serve, bench.clients and bench.schemathesis: it
    yields once /health answers 200 (the demo model, eager), keeps the server's output, and stops the process on
    exit; a server that cannot start is a SystemExit carrying its output, not a hang."""
    import httpx

    from bench.server import running_server

    with running_server(["--eager", "--max-batch", "1", "--max-seq-len", "256"], timeout_s=240) as server:
        assert httpx.get(server.url + "/health").status_code == 200 and server.ready_s > 0
        r = httpx.post(server.url + "/v1/completions", json={"model": "dgemma-demo", "prompt": "sort 3 1 2=",
                                                             "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        proc = server.proc
    assert proc.poll() is not None
    with pytest.raises(SystemExit, match=r"dgemma serve exited \(2\):\n.*--max-batch: must be a positive integer"):
        with running_server(["--eager", "--max-batch", "0"], timeout_s=240):
            pass
