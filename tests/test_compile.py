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
    # one bucket keeps CI compile time down; batch sizes 1-3 all run padded in it
    return model, build(model, CompileOptions(batch_buckets=(4,), max_seq_len=64))


@pytest.mark.parametrize("stop_early", [True, False])
def test_compiled_tokens_equal_eager(tiny, stop_early):
    """Several prompts of different lengths (one longer than the canvas), several blocks, batch sizes 1 and 3
    (both padded to the bucket of 4), sampling on."""
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
    gen.generate(PROMPTS, base, seed=0)  # warm the bucket for this structural config
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
    prompts = [[2, 3 + i] for i in range(6)]
    cfg = dg.GenerationConfig(max_new_tokens=8, max_denoising_steps=3, eos_token_ids=(1,))
    assert gen.generate(prompts, cfg, seed=1).sequences == dg.generate(model, prompts, cfg, seed=1).sequences


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
