"""The compiled generator against the eager oracle, and its compile reports (CPU: Inductor C++, no CUDA graphs)."""

import logging
from collections import Counter

import pytest
import torch

import dgemma_compile as dg

pytestmark = pytest.mark.slow  # compiles (shared through the session fixture `tiny_compiled`)
from dgemma_compile.compile import CompileOptions, CudaGraphs, UnitFactory, build
from dgemma_compile.model.config import ConfigError

PROMPTS = [[2, 5, 6], [2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [2, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny(tiny_compiled):
    return tiny_compiled


@pytest.mark.parametrize("stop_early", [True, False])
def test_compiled_tokens_equal_eager(tiny, stop_early):
    """Several prompts of different lengths (one longer than the canvas), several blocks, batch sizes 1 and 3
    (padded to buckets of 2 and 4), sampling on."""
    model, gen = tiny
    cfg = dg.GenerationConfig(max_new_tokens=20, max_denoising_steps=5, t_min=0.8, t_max=1.5, entropy_bound=0.5,
                              eos_token_ids=(1,), stop_early=stop_early)
    seeds = [11, 12, 13]
    prompts = PROMPTS if stop_early else PROMPTS[:2]  # fixed steps: one bucket only (each costs a compile)
    eager = dg.generate(model, prompts, cfg, seed=seeds[:len(prompts)], moe_impl=gen.moe_impl)
    compiled = gen.generate(prompts, cfg, seed=seeds[:len(prompts)])
    assert compiled.sequences == eager.sequences
    assert compiled.stats == eager.stats
    solo = gen.generate(PROMPTS[1:2], cfg, seed=seeds[1])
    assert solo.sequences[0] == eager.sequences[1] and solo.stats[0] == eager.stats[1]
    assert sum(s.blocks for s in eager.stats) >= 2 * len(prompts)


def test_nan_left_in_unused_cache_slots_cannot_reach_the_next_request(tiny):
    """kv_cache.py's invariant, compiled: after a request, NaN written into every committed slot its rows do not own
    (the bucket's cache is reused) does not reach the next request, whose tokens equal the eager oracle's on a fresh
    cache. Attention alone would not protect it: a masked slot's probability is 0, and 0 x NaN is NaN."""
    model, gen = tiny
    cfg = dg.GenerationConfig(max_new_tokens=12, max_denoising_steps=4, t_min=0.8, t_max=1.2, eos_token_ids=(1,))
    gen.generate(PROMPTS[:2], cfg, seed=[1, 2])
    cache = gen.row_table(cfg).cache
    S = cache.max_seq_len
    for t in (*cache.keys, *cache.values):
        for row, length in enumerate(cache.lengths.tolist()):
            t[row, :, length:S] = float("nan")
    after = gen.generate(PROMPTS[:2], cfg, seed=[3, 4])
    eager = dg.generate(model, PROMPTS[:2], cfg, seed=[3, 4], moe_impl=gen.moe_impl)
    assert after.sequences == eager.sequences and after.stats == eager.stats
    assert any(tok != model.config.pad_token_id for seq in eager.sequences for tok in seq)  # not a pad-only answer


def test_no_recompiles_across_a_mixed_workload(tiny):
    """After warm-up, prompts of other lengths, other block counts, other batch sizes within the bucket and other
    per-step values (temperatures, bounds, seeds) reuse the same graphs."""
    model, gen = tiny
    base = dg.GenerationConfig(max_new_tokens=8, max_denoising_steps=3, eos_token_ids=(1,))
    gen.generate(PROMPTS, base, seed=0)  # warm both buckets for this structural config
    gen.generate(PROMPTS[:1], base, seed=0)
    before = dict(gen.compiles)
    with torch.compiler.set_stance("fail_on_recompile"):
        gen.generate([[2] * 30, [2, 3]], base.replace(max_new_tokens=24, t_min=0.1, t_max=2.0), seed=[4, 5])
        gen.generate([[2, 9, 9, 9]], base.replace(max_new_tokens=17, entropy_bound=2.0), seed=7)
        gen.generate(PROMPTS + [[2, 4]], base.replace(confidence_threshold=0.5, max_denoising_steps=6), seed=3)
    assert dict(gen.compiles) == before


def test_rows_of_one_bucket_carry_their_own_parameters_without_recompiling(tiny):
    """Per-request configs in one bucket (temperature schedules including a greedy one, entropy bounds, confidence
    thresholds, step budgets, token budgets): no recompile, the eager oracle's tokens, and each row's tokens equal
    its solo run's."""
    model, gen = tiny
    base = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=4, eos_token_ids=(1,))
    cfgs = [base, base.replace(t_min=0.0, t_max=0.0, max_denoising_steps=2),
            base.replace(t_min=1.0, t_max=1.0, entropy_bound=3.0, max_new_tokens=9),
            base.replace(confidence_threshold=0.9, max_denoising_steps=6, t_min=0.2)]
    prompts, seeds = [[2, 5], [2, 6, 7], [2, 8, 9, 10], [2, 11]], [1, 2, 3, 4]
    gen.generate(prompts, base, seed=seeds)  # warm the bucket of 4
    before = dict(gen.compiles)
    with torch.compiler.set_stance("fail_on_recompile"):
        out = gen.generate(prompts, cfgs, seed=seeds)
    assert dict(gen.compiles) == before
    eager = dg.generate(model, prompts, cfgs, seed=seeds, moe_impl=gen.moe_impl)
    assert out.sequences == eager.sequences and out.stats == eager.stats
    for i in range(4):
        solo = dg.generate(model, prompts[i:i + 1], cfgs[i], seed=seeds[i], moe_impl=gen.moe_impl)
        assert solo.sequences[0] == out.sequences[i] and solo.stats[0] == out.stats[i]
    assert max(s.steps_per_block[0] for s in out.stats[:1]) <= 4 and max(out.stats[1].steps_per_block) <= 2
    assert len(out.sequences[2]) <= 9


def test_structural_fields_must_agree_within_a_call(tiny):
    _, gen = tiny
    base = dg.GenerationConfig(max_new_tokens=8, max_denoising_steps=2)
    with pytest.raises(ConfigError, match="stop_early"):
        gen.generate([[2, 3], [2, 4]], [base, base.replace(stop_early=False)])
    with pytest.raises(ConfigError, match="one per prompt"):
        gen.generate([[2, 3], [2, 4]], [base])
    with pytest.raises(ConfigError, match="max_denoising_steps"):
        gen.generate([[2, 3]], base.replace(max_denoising_steps=300))


def test_too_long_for_the_static_cache_is_a_clear_error(tiny):
    _, gen = tiny
    with pytest.raises(ConfigError, match="max_seq_len"):
        gen.generate([[2] * 250], dg.GenerationConfig(max_new_tokens=16))


class Units(dg.Observer):
    def __init__(self):
        self.units, self.steps = Counter(), 0
        self.denoise_s, self.step_s = 0.0, 0.0

    def on_unit(self, name, seconds):
        self.units[name] += 1
        if name.startswith("step["):
            self.denoise_s += seconds

    def on_step(self, seconds):
        self.steps += 1
        self.step_s += seconds


def test_more_requests_than_rows_wait_for_rows(tiny):
    """Six requests over a bucket of 4 rows: 4 run, 2 wait and take rows as earlier ones end; each request's tokens
    and statistics equal the eager oracle's; `on_block` sees each (request, block) once, with the call's request
    indices, and `stop` ends request 5 after its first block; every step is one unit call inside its step span."""
    model, gen = tiny
    prompts = [[2, 3 + i] for i in range(6)]
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=3, eos_token_ids=())
    streamed, seen = [], Units()
    out = gen.generate(prompts, cfg, seed=1, on_block=lambda i, toks: streamed.append((i, toks)), observer=seen,
                       stop=lambda block, toks: [5])
    eager = dg.generate(model, prompts, cfg, seed=1, stop=lambda block, toks: [5], moe_impl=gen.moe_impl)
    assert out.sequences == eager.sequences and out.stats == eager.stats
    assert out.stats[5].finish_reason == "stop" and len(out.sequences[5]) == 8
    assert all(len(toks) == 6 for _, toks in streamed)
    got = sorted((r, block, tuple(t)) for block, toks in streamed for r, t in enumerate(toks) if t)
    want = sorted((r, b, tuple(seq[8 * b:8 * b + 8])) for r, seq in enumerate(eager.sequences)
                  for b in range(len(seq) // 8))
    assert got == want
    assert out.commits == eager.commits == 5 and out.fused_commits == 0, "one per request but the stopped one"
    assert seen.steps == sum(seen.units.values()) and all(name.startswith("step[B") for name in seen.units)
    assert 0 < seen.denoise_s <= seen.step_s, "each unit span lies inside its step span"


class FakeGraphs(CudaGraphs):
    """CUDA-graph calls on a CPU: `capture` records the function instead of kernels; `replay` runs it."""

    def __init__(self, fail: bool = False):
        self.fail, self.captures, self.replays = fail, 0, 0

    def pool(self):
        return "pool"

    def warm_up(self, fn):
        self.warm_ups = getattr(self, "warm_ups", 0) + 1
        fn()

    def capture(self, fn, pool):
        assert pool == "pool"
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        fake = self

        class Graph:
            def replay(self):
                fake.replays += 1
                fn()

        return Graph()


@pytest.mark.parametrize("fail", [False, True])
def test_cuda_graph_capture_and_its_logged_fallback(fail, caplog):
    """The capture logic on a CPU: the first compiled call, a capture right after it (decided once: `strategy`),
    replays from the second call on; a failed capture is logged with its reason and the unit goes on with the next
    strategy (every call still takes effect)."""
    factory = UnitFactory(CompileOptions(), "cpu", graphs=FakeGraphs(fail=fail))
    x = torch.zeros(3)
    unit = factory.unit("add_one", lambda: x.add_(1))
    with caplog.at_level(logging.INFO, logger="dgemma_compile"):
        for _ in range(5):
            unit()
    assert x.tolist() == [5.0] * 3 and factory.graphs.captures == 1 and factory.compiles["add_one"] == 1
    if fail:
        assert unit.graph is None and "operation not permitted" in unit.graph_error and unit.strategy == "dynamo"
        assert any(r.levelno == logging.WARNING and "capture failed for add_one" in r.message for r in caplog.records)
        assert factory.graphs.replays == 0
    else:
        assert unit.graph is not None and unit.graph_error is None and factory.graphs.replays == 4
        assert unit.strategy == "cuda graph"
        assert any("captured CUDA graph for add_one" in r.message for r in caplog.records)


def test_warmup_captures_the_step_before_any_request(tiny_dir):
    """`gen.warmup` compiles the step and captures its CUDA graph (the fake seam on a CPU) during warm-up, after a
    side-stream warm-up call with every row idle: the first request only replays, and its tokens equal the eager
    oracle's."""
    model = dg.load(tiny_dir)
    graphs = FakeGraphs()
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256), graphs=graphs)
    cfg = dg.GenerationConfig(max_new_tokens=12, max_denoising_steps=3, eos_token_ids=(1,))
    gen.warmup(1, cfg)
    (view,) = gen.row_table(cfg).views()
    assert (graphs.warm_ups, graphs.captures, graphs.replays) == (1, 1, 0) and view.step.strategy == "cuda graph"
    out = gen.generate(PROMPTS[:2], cfg, seed=[5, 6])
    assert graphs.captures == 1 and graphs.replays == view.step.calls - 1 > 0
    eager = dg.generate(model, PROMPTS[:2], cfg, seed=[5, 6], moe_impl=gen.moe_impl)
    assert out.sequences == eager.sequences and out.stats == eager.stats


def test_no_cuda_graphs_on_a_cpu_by_default():
    assert UnitFactory(CompileOptions(cuda_graphs=True), "cpu").graphs is None


@pytest.mark.parametrize("kw,name", [(dict(batch_buckets=(4, 2)), "batch_buckets"),
                                     (dict(batch_buckets=()), "batch_buckets"),
                                     (dict(max_seq_len=0), "max_seq_len"),
                                     (dict(recompile_limit=1), "recompile_limit"),
                                     (dict(attention_kernel_options={"decode": {}}), "attention_kernel_options"),
                                     (dict(attention_kernel_options={"canvas": {"local": {}}}),
                                      "attention_kernel_options")])
def test_compile_options_are_validated(kw, name):
    with pytest.raises(ConfigError, match=name):
        CompileOptions(**kw)


def test_explain_reports_one_graph_and_no_breaks(tiny_dir):
    """`dgemma explain --json` on the tiny checkpoint, run in this process (`dgemma explain --quant` runs it in a
    subprocess; its bucket of 2 rows and 256 slots is the one `tiny_compiled` compiles: Inductor cache hits):
    `torch._dynamo.explain` on the bucket's one step (CPU: no commit fusion), then a mixed workload: one graph, zero
    breaks, zero recompiles; the JSON holds every field of the report. (Near the end of this file: explain resets
    Dynamo.)"""
    import dataclasses
    import json

    from dgemma_compile.compile.explain import UnitReport
    from test_cli import run_main

    res = run_main("explain", "--json", "--model", str(tiny_dir))
    assert res.returncode == 0, res.stderr
    reports = [UnitReport(**r) for r in json.loads(res.stdout)]
    assert json.loads(res.stdout) == [dataclasses.asdict(r) for r in reports]
    assert [r.unit for r in reports] == ["step[B2_P1_stop]"]
    for r in reports:
        assert r.graph_count == 1 and r.graph_break_count == 0 and r.break_reasons == []
        assert r.ops_per_graph[0] > 0 and r.guard_count > 0
        assert r.recompiles_in_workload == 0
        assert "graph_breaks=0" in r.text()
        # our passes ran (or their record was read) during the workload; the tiny model's sampler region is below
        # `sample_step_fusion_min_bytes`, so it stays with Inductor's loops (rewrites: tests/compile/test_passes.py)
        assert r.pass_matches == {"sample_step_fusion": 0, "sample_step_fusion.softcap_folded": 0,
                                  "sample_step_fusion.sc_dtype_folded": 0}, r.text()
        assert "passes=sample_step_fusion:0," in r.text()
    canvas = {"FORCE_USE_FLEX_ATTENTION": True}
    assert reports[0].attention_kernel_options == {t: canvas for t in dg.load(tiny_dir).config.layer_types}
    assert "attention full_attention: kernel_options={'FORCE_USE_FLEX_ATTENTION': True}" in reports[0].text()


@pytest.mark.slow
def test_compiled_commit_fusion_tokens_equal_eager(tiny_dir):
    """`fuse_commit=True` (CPU default: off): every commit runs inside the next block's first step (rows of 2C);
    tokens and statistics equal the eager generator's, fused and unfused (prompts shorter and longer than the
    canvas, five blocks, sampling on, a stop hook ending one row after its second block, so the later fused steps
    commit nothing for it)."""
    model = dg.load(tiny_dir)
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256, fuse_commit=True))
    prompts = [[2, 5, 6, 7], [2] + list(range(3, 30))]
    cfg = dg.GenerationConfig(max_new_tokens=5 * model.config.canvas_length, max_denoising_steps=4, eos_token_ids=())
    seen = Units()
    stop = lambda block, toks: [0] if block == 1 else []  # noqa: E731 - row 0 commits nothing in the later fused steps
    out = gen.generate(prompts, cfg, seed=[3, 4], observer=seen, stop=stop)
    assert out.fuse_commit and out.commits == 0 and out.fused_commits == 5  # row 0: one, row 1: four
    assert out.stats[0].finish_reason == "stop" and out.stats[0].blocks == 2
    assert list(seen.units) == ["step[B2_P1_stop]"]
    for fuse in (True, False):
        eager = dg.generate(model, prompts, cfg, seed=[3, 4], moe_impl=gen.moe_impl, fuse_commit=fuse, stop=stop)
        assert (eager.commits, eager.fused_commits) == ((0, 5) if fuse else (5, 0))
        assert out.sequences == eager.sequences and out.stats == eager.stats
