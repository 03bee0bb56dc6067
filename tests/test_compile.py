"""The compiled generator against the eager oracle, and its compile reports (CPU: Inductor C++, no CUDA graphs)."""

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.config import ConfigError

PROMPTS = [[2, 5, 6], [2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [2, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model = dg.load(tiny_dir)
    # two buckets keep CI compile time down: 1-2 requests run in the first, 3-4 in the second, more in groups
    return model, build(model, CompileOptions(batch_buckets=(2, 4), max_seq_len=64))


@pytest.mark.parametrize("stop_early", [True, False])
def test_compiled_tokens_equal_eager(tiny, stop_early):
    """Several prompts of different lengths (one longer than the canvas), several blocks, batch sizes 1 and 3
    (padded to buckets of 2 and 4), sampling on."""
    model, gen = tiny
    cfg = dg.GenerationConfig(max_new_tokens=20, max_denoising_steps=5, t_min=0.8, t_max=1.5, entropy_bound=0.5,
                              eos_token_ids=(1,), stop_early=stop_early)
    seeds = [11, 12, 13]
    eager = dg.generate(model, PROMPTS, cfg, seed=seeds)
    compiled = gen.generate(PROMPTS, cfg, seed=seeds)
    assert compiled.sequences == eager.sequences
    assert compiled.stats == eager.stats
    solo = gen.generate(PROMPTS[1:2], cfg, seed=seeds[1])
    assert solo.sequences[0] == eager.sequences[1] and solo.stats[0] == eager.stats[1]
    assert sum(s.blocks for s in eager.stats) >= 6


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


def test_too_long_for_the_static_cache_is_a_clear_error(tiny):
    _, gen = tiny
    with pytest.raises(ConfigError, match="max_seq_len"):
        gen.generate([[2] * 60], dg.GenerationConfig(max_new_tokens=16))


def test_more_requests_than_the_largest_bucket_run_in_groups(tiny):
    model, gen = tiny
    prompts = [[2, 3 + i] for i in range(6)]  # a group of 4, then a group of 2 in the smaller bucket
    cfg = dg.GenerationConfig(max_new_tokens=8, max_denoising_steps=3, eos_token_ids=(1,))
    streamed = []
    out = gen.generate(prompts, cfg, seed=1, on_block=lambda i, toks: streamed.append(toks))
    assert out.sequences == dg.generate(model, prompts, cfg, seed=1).sequences
    assert all(len(toks) == 6 for toks in streamed)
    assert {k.split("[")[1] for k in gen.compiles} >= {"B2_P1_stop]", "B4_P1_stop]"}


@pytest.mark.parametrize("kw,name", [(dict(batch_buckets=(4, 2)), "batch_buckets"),
                                     (dict(batch_buckets=()), "batch_buckets"),
                                     (dict(max_seq_len=0), "max_seq_len"),
                                     (dict(recompile_limit=1), "recompile_limit")])
def test_compile_options_are_validated(kw, name):
    with pytest.raises(ConfigError, match=name):
        CompileOptions(**kw)


def test_explain_reports_one_graph_and_no_breaks(tiny):
    """`torch._dynamo.explain` on both units, then a mixed workload: one graph each, zero breaks, zero recompiles.
    (Last in this file: explain resets Dynamo.)"""
    _, gen = tiny
    reports = gen.explain(1)
    assert [r.unit.split("[")[0] for r in reports] == ["denoise_step", "encoder_chunk"]
    for r in reports:
        assert r.graph_count == 1 and r.graph_break_count == 0 and r.break_reasons == []
        assert r.ops_per_graph[0] > 0 and r.guard_count > 0
        assert r.recompiles_in_workload == 0
        assert "graph_breaks=0" in r.text()
