"""Start-up (issue 35): `--compile {auto,always,never}`, the eager step answering while a background process compiles,
the switch between iterations, and the step's source in the stats line and on /health. Tokens never change: every
path gives the compiled step's tokens."""

import os
import re
import subprocess
import sys
import time

import pytest

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.compile.background import BackgroundCompile, CompileSpec, options_fields
from dgemma_compile.demo import DEMO_MODEL

PROMPT = "sort 3 1 2 9 5="


@pytest.fixture(scope="module")
def cache(shared_compile_cache):
    """The suite's compile cache: the first run of the suite compiles the demo's batch-1 step into it, later runs load
    it (the cold compile and save are `test_artifacts`' subject)."""
    return shared_compile_cache


def _generate(cache_dir, *flags):
    env = {**os.environ, "DGEMMA_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    env.pop("DGEMMA_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "dgemma_compile.cli", "generate", PROMPT, *flags], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    fields = dict(re.findall(r"(\w+)=(\S+)", done.stderr.strip().splitlines()[-1]))
    return done.stdout, fields, done.stderr


@pytest.mark.slow
def test_compile_modes_give_the_same_answer_and_say_where_the_step_came_from(cache, tmp_path):
    """never: the eager step, nothing compiled; auto with an empty cache and one prompt: eager too, no background
    process (a one-batch job does not repay a compile); always: compiled now and saved (or loaded, when an earlier
    run of the suite saved it); auto again: loaded from the cache. One answer throughout."""
    never, f_never, _ = _generate(cache, "--compile", "never")
    assert (f_never["step"], f_never["compile_s"]) == ("eager", "0.0")
    auto_cold, f_cold, err = _generate(tmp_path / "empty", "--compile", "auto")
    assert f_cold["step"] == "eager" and "background" not in err
    always, f_always, _ = _generate(cache, "--compile", "always")
    assert f_always["step"] in ("compiled", "loaded")
    auto_warm, f_warm, _ = _generate(cache)
    assert f_warm["step"] == "loaded" and float(f_warm["compile_s"]) == 0.0
    assert never == auto_cold == always == auto_warm == "1 2 3 5 9\n"


@pytest.mark.slow
def test_the_eager_step_answers_until_the_background_compile_ends_then_its_step_runs(cache):
    """A generator deferred to a background compile runs the eager step (same tokens as the compiled one), then, once
    the process has exited, switches between iterations to the step it left in the cache: loaded, not compiled."""
    model = dg.load(DEMO_MODEL)
    options = CompileOptions(batch_buckets=(1,), max_seq_len=256)
    config = model.generation_config
    prompts = [[2, 10, 11, 12, 13]]
    spec = CompileSpec(model=str(DEMO_MODEL), dtype=None, quant=None, options=options_fields(options),
                       config={"stop_early": config.stop_early, "stability_threshold": config.stability_threshold,
                               "eos_token_ids": config.eos_token_ids},
                       sizes=[1], threads=1, cache_dir=str(cache))
    os.environ["DGEMMA_CACHE_DIR"] = str(cache)
    try:
        gen = build(model, options)  # its store is the module's cache
        bg = BackgroundCompile(spec)
        gen.defer(bg)
        eager = gen.generate(prompts, seed=5)
        assert gen.step_source == "eager" and sum(gen.compiles.values()) == 0
        deadline = time.monotonic() + 900
        while bg.poll() == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert bg.state == "done", bg.error
        after = gen.generate(prompts, seed=5)
    finally:
        os.environ.pop("DGEMMA_CACHE_DIR", None)
    assert gen.step_source == "loaded" and sum(gen.compiles.values()) == 0 and sum(gen.loads.values()) == 1
    assert after.sequences == eager.sequences and after.stats == eager.stats


def test_a_deferred_engine_reports_its_eager_steps_and_compiles_nothing(tmp_path, monkeypatch):
    """`build_engine(defer_compile=True)`: no compile at build, every size reported as running the eager step
    (/health's buckets[].step) and the engine's tokens those of the eager oracle's step."""
    from dgemma_runtime import build_engine

    monkeypatch.setenv("DGEMMA_CACHE_DIR", str(tmp_path))
    model = dg.load(DEMO_MODEL)
    engine = build_engine(model, max_batch=2, max_seq_len=256, defer_compile=True)
    assert [b["step"] for b in engine.bucket_table()] == [None, None]  # no size used yet
    engine.row_table.view(1)  # what the first iteration at batch 1 makes
    assert [b["step"] for b in engine.bucket_table()] == ["eager", None]
    assert sum(engine.generator.compiles.values()) == 0 and engine.generator.deferred
