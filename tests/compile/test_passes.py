"""Our Inductor graph passes (`dgemma_compile/compile/`) and the op they insert (`dgemma::sample_step`):
the op against `sampler.sample_step`; the pipeline's cache key; the fusion pass on small graphs (match counts, values,
the generated code) and on the demo model's real captured units (counts per unit, the code, identical tokens with the
pass on and off)."""

import re
import shutil

import pytest
import torch
from torch.testing import FileCheck

from dgemma_compile.step import sampler
from dgemma_compile.compile import CompileOptions
from dgemma_compile.compile.units import UnitFactory
from dgemma_compile.model.config import ConfigError
from dgemma_compile.kernels.sample import op as sample_op
from dgemma_compile.compile import passes as pipeline, pass_records as records

FUSION = "sample_step_fusion"


def fusion(rewrites, softcap=0, sc_dtype=0):
    """The pass's counts: rewrites, and how many of them took the softcap / the self-conditioning dtype in."""
    return {FUSION: rewrites, f"{FUSION}.softcap_folded": softcap, f"{FUSION}.sc_dtype_folded": sc_dtype}


def _inputs(B, C, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, C, V, generator=g) * 4).to(dtype)
    T = torch.rand(B, generator=g) + 0.1
    greedy = torch.zeros(B, dtype=torch.bool)
    greedy[0] = True
    return logits, T, greedy, torch.rand(B, C, generator=g)


@pytest.mark.parametrize("V,dtype", [(27, torch.float32), (4096 + 27, torch.float32), (300, torch.bfloat16)])
def test_sample_step_op_equals_the_reference_also_in_slices(V, dtype, monkeypatch):
    args = _inputs(3, 5, V, dtype)
    ref = sampler.sample_step(*args)
    whole = torch.ops.dgemma.sample_step(*args)
    monkeypatch.setattr(sample_op, "CHUNK_BYTES", 4 * V * 2)  # two positions per slice: 8 slices for 15 positions
    sliced = torch.ops.dgemma.sample_step(*args)
    for out in (whole, sliced):
        for name, a, b in zip(sampler.SampleStep._fields, out, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert torch.equal(ref.sampled[0], ref.argmax[0]) and not ref.entropy[0].any()  # the greedy row


@pytest.mark.parametrize("bad,name", [(lambda a: (a[0][0], *a[1:]), "logits"),
                                      (lambda a: (a[0], a[1].double(), *a[2:]), "temperature"),
                                      (lambda a: (*a[:2], a[2].int(), a[3]), "greedy"),
                                      (lambda a: (*a[:3], a[3][:, :2]), "uniform")])
def test_sample_step_op_names_a_bad_tensor(bad, name):
    with pytest.raises(ValueError, match=name):
        torch.ops.dgemma.sample_step(*bad(_inputs(2, 3, 11)))


def test_disabled_passes_is_checked_by_name():
    assert CompileOptions(disabled_passes=(FUSION,)).disabled_passes == (FUSION,)
    with pytest.raises(ConfigError, match="disabled_passes: unknown pass"):
        CompileOptions(disabled_passes=("no_such_pass",))
    with pytest.raises(ConfigError, match="disabled_passes: must be a tuple"):
        CompileOptions(disabled_passes=FUSION)


def test_pipeline_uuid_changes_with_a_pass_source_and_the_enabled_passes(tmp_path, monkeypatch):
    copies = []
    for path in pipeline._SOURCES:
        copies.append(tmp_path / f"{len(copies)}_{path.rsplit('/', 1)[-1]}")
        shutil.copy(path, copies[-1])
    monkeypatch.setattr(pipeline, "_SOURCES", tuple(map(str, copies)))
    pipeline.sources_hash.cache_clear()
    try:
        on = pipeline.inductor_config()[pipeline.sample_step_fusion.STAGE].uuid()
        assert pipeline.inductor_config((FUSION,)) == {}  # nothing installed when the only pass is off
        fusion_copy = next(p for p in copies if p.name.endswith("_fusion.py"))
        fusion_copy.write_text(fusion_copy.read_text() + "\n# edited\n")
        pipeline.sources_hash.cache_clear()
        edited = pipeline.inductor_config()[pipeline.sample_step_fusion.STAGE].uuid()
        assert edited != on
    finally:
        pipeline.sources_hash.cache_clear()
    assert pipeline.PassPipeline("joint_custom_pre_pass", ()).uuid() != pipeline.PassPipeline(
        "joint_custom_pre_pass", (FUSION,)).uuid()


def _region(logits_scale, T, greedy, u, renoise):
    """A denoise-step tail: the model's float32 softcap as the logits' producer (`DiffusionGemma.logits`), the region,
    and consumers of every output."""
    logits = torch.tanh(logits_scale.float() / 30.0) * 30.0
    out = sampler.sample_step(logits, T, greedy, u)
    accepted = sampler.entropy_bound_accept(out.entropy, 0.5)
    return (torch.where(accepted, out.sampled, renoise), out.argmax, out.entropy.mean(-1),
            out.sc_probs.to(logits_scale.dtype))


def _compile_region(args, disabled=(), fresh=True, min_bytes=0):
    """The region compiled by our units' backend (passes installed, rewriting regions of any size unless
    `min_bytes`); returns (outputs, code, PassMatches)."""
    from torch._inductor.utils import run_and_get_code

    factory = UnitFactory(CompileOptions(disabled_passes=disabled, sample_step_fusion_min_bytes=min_bytes), "cpu")
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=not fresh):
        fn = torch.compile(_region, backend=factory.backend("region"), fullgraph=True)
        out, (code,) = run_and_get_code(fn, *args)
    return out, code, factory.pass_matches["region"]


@pytest.mark.slow
@pytest.mark.parametrize("V,dtype", [(27, torch.float32), (4096 + 27, torch.float32), (96, torch.bfloat16)])
def test_fusion_pass_rewrites_the_region_with_equal_values(V, dtype):
    logits, T, greedy, u = _inputs(2, 4, V, dtype, seed=3)
    args = (logits, T, greedy, u, torch.randint(V, (2, 4)))
    ref = _region(*args)
    out, code, matches = _compile_region(args)
    assert matches.counts == fusion(1, softcap=1, sc_dtype=int(dtype != torch.float32))
    assert matches.source == "compiled"
    FileCheck().check('dgemma::sample_step').run(code)
    assert "searchsorted" not in code  # the inverse CDF is inside the op
    assert "tanh" not in code  # the softcap folded into the op: the float32 logits never exist whole
    off, code_off, matches_off = _compile_region(args, disabled=(FUSION,))
    assert matches_off.counts == {} and matches_off.source == "no pass enabled"
    assert "dgemma::sample_step" not in code_off and "dgemma.sample_step" not in code_off and "tanh" in code_off
    # pass on vs off: the same compiled producer of the logits (eager bf16 rounds the softcap's every op; Inductor
    # computes it in float32), so the values agree to float reduction order
    for a, b in zip(out, off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # below the size threshold the region stays with Inductor's loops (counted: 0 rewrites)
    small, code_small, matches_small = _compile_region(args, min_bytes=4 * logits.numel() + 1)
    assert matches_small.counts == fusion(0) and "dgemma::sample_step" not in code_small


@pytest.mark.slow
def test_a_compile_served_by_the_fx_cache_reports_the_recorded_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    args = (*_inputs(2, 4, 27, seed=4), torch.randint(27, (2, 4)))
    first = _compile_region(args, fresh=False)[2]
    again = _compile_region(args, fresh=False)[2]
    assert first.counts == again.counts == fusion(1, softcap=1)
    assert (first.source, again.source) == ("compiled", "cache record")
    assert len(list((tmp_path / "dgemma_pass_counts").glob("*.json"))) == 1
    for path in (tmp_path / "dgemma_pass_counts").glob("*.json"):
        path.unlink()  # a lost record is "unknown", never a wrong count
    assert _compile_region(args, fresh=False)[2].source == "unknown"


def test_record_key_depends_on_the_graph_inputs_and_passes():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    x = torch.zeros(2, 3)
    key = records.record_key(gm, [x], pipeline.inductor_config())
    assert key == records.record_key(gm, [torch.ones(2, 3)], pipeline.inductor_config())
    assert key != records.record_key(gm, [torch.zeros(3, 2)], pipeline.inductor_config())
    assert key != records.record_key(gm, [x], pipeline.inductor_config((FUSION,)))
    assert key != records.record_key(torch.fx.symbolic_trace(lambda x: x + 2), [x], pipeline.inductor_config())


def _cumsum_sizes(code):
    return [tuple(int(d) for d in m.group(1).replace("L", "").split(","))
            for m in re.finditer(r'assert_size_stride\(\w+, \{([^}]*)\}, \{[^}]*\}, "torch\.ops\.aten\.cumsum', code)]


@pytest.mark.slow
def test_fusion_on_the_demo_units_counts_code_and_identical_tokens(demo, demo_gen):
    """The demo's real captured step (batch 2), the pass forced on at the demo's size (`sample_step_fusion_min_bytes`
    0): it matches once in the step (its sampler region; the prefill and commit rows share the forward); the code calls the op and keeps no
    scan over the vocabulary (the unfused code's scan: `test_fusion_pass_rewrites_the_region_with_equal_values`);
    tokens equal the default generator's, where the demo's small region stays with Inductor's loops (0 rewrites)."""
    from torch._inductor.utils import run_and_get_code

    from dgemma_compile.compile import build
    from dgemma_compile.demo import tasks

    model, tok = demo
    C = model.config.canvas_length
    prompts = [tok(p)["input_ids"] for _, p, _ in tasks.make_split("heldout", 6, seed=0)]

    def run(gen):
        return run_and_get_code(lambda: [gen.generate(prompts[i:i + 2], seed=[i, i + 1]).sequences
                                         for i in range(0, 6, 2)])

    default = run(demo_gen)[0]
    unit = f"step[B2_{demo_gen.row_table().tag}]"
    assert demo_gen.units.pass_matches[unit].counts == fusion(0)
    # artifact_cache off: this test reads the code Inductor generates, which a step loaded from the cache skips
    on_gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256, sample_step_fusion_min_bytes=0,
                                         artifact_cache=False))
    on, codes = run(on_gen)
    matches = on_gen.units.pass_matches
    # float32 state: no dtype to fold; the softcap folds in: the constrained rows' first-position mask is inside the
    # op (`sampler.mask_first` in `sampler.sample_step`), so the op alone reads the softcap's output
    capped = int(model.config.final_logit_softcapping is not None)
    assert matches[unit].counts == fusion(1, softcap=capped)
    (denoise_code,) = [c for c in codes if "sort.default" in c]  # the entropy bound's sort
    FileCheck().check('"dgemma::sample_step"').run(denoise_code)
    assert _cumsum_sizes(denoise_code) and all(s[-1] == C for s in _cumsum_sizes(denoise_code))

    assert on == default  # the default threshold leaves the demo's region unrewritten: the pass-off tokens


@pytest.mark.slow
def test_fusion_on_bf16_units_with_softcap_and_commit_fusion(tmp_path):
    """A tiny bfloat16 checkpoint whose config.json holds an integer softcap (30), compiled with commit fusion: the
    pass rewrites the step's sampler region once; the op takes the softcap in
    (so it reads the bfloat16 lm_head output) and writes the state's bfloat16 (the fold counts; the folded node itself
    is checked on a small graph below); tokens equal the eager generator's (no pass)."""
    import json

    import dgemma_compile as dg
    from dgemma_compile.compile import build
    from helpers import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", vocab_size=48, final_logit_softcapping=30, tokenizer=True)
    cfg_file = path / "config.json"
    config = json.loads(cfg_file.read_text())
    config["text_config"]["final_logit_softcapping"] = 30  # an int, as a hand-written config may hold it
    cfg_file.write_text(json.dumps(config))
    model = dg.load(path, dtype=torch.bfloat16)
    prompts = [[2, 5, 6, 7], [2] + list(range(3, 30))]
    gcfg = dg.GenerationConfig(max_new_tokens=3 * model.config.canvas_length, max_denoising_steps=4, eos_token_ids=())
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256, fuse_commit=True,
                                      sample_step_fusion_min_bytes=0))
    out = gen.generate(prompts, gcfg, seed=[3, 4])
    # counts recorded at compile time, also when the caches serve the compile
    counts = {k.split("[")[0]: m.counts for k, m in gen.units.pass_matches.items()}
    assert counts == {"step": fusion(1, 1, 1)}  # the first-position mask is inside the op: the softcap folds
    # the eager generator runs `sampler.sample_step` itself: the pass-off reference, without a second compile
    eager = dg.generate(model, prompts, gcfg, seed=[3, 4], moe_impl=gen.moe_impl, fuse_commit=True, max_seq_len=256)
    assert out.fused_commits > 0 and out.sequences == eager.sequences
    # a constrained row beside a free one through the same compiled step: the first-position mask is the op's
    # per-row tensor data (no recompile), tokens equal the eager oracle's and the text matches
    from dgemma_compile.inputs.constraint import Constraint, GrammarLibrary

    tok = dg.load_tokenizer(path)
    ccfg = gcfg.replace(eos_token_ids=(1,))  # a grammar ends on eos (a new end rule: its own compile, once)
    gen.generate(prompts, ccfg, seed=[5, 6], constraint=[Constraint.choice(["ab", "c d"]), None], tokenizer=tok)
    compiles = sum(gen.compiles.values())
    cons = [Constraint.regex("[a-z]+( [0-9]+)*"), None]
    out = gen.generate(prompts, ccfg, seed=[5, 6], constraint=cons, tokenizer=tok)
    assert sum(gen.compiles.values()) == compiles  # another grammar: data in the same buffers, no recompile
    assert out.sequences[1] == gen.generate(prompts[1:], ccfg, seed=6).sequences[0]  # the free row: its solo run
    # the constrained row is valid (a bf16 compile and the eager loop round differently, pass on or off, so tokens
    # are compared with the oracle in float32: tests/inputs/test_constrained.py)
    lib = GrammarLibrary.for_model(tok, model, ccfg.eos_token_ids)
    assert out.sequences[0] and lib.matcher(cons[0]).accept(out.sequences[0]) == len(out.sequences[0])


def _region_into_state(logits_bf16, T, greedy, u, sc_state):
    """The model's path in bfloat16: float32 cast and softcap of the lm_head output, the region, and the
    self-conditioning output copied into the step's bfloat16 state buffer (as `mixed_step.denoise_step` does)."""
    logits = torch.tanh(logits_bf16.float() / 30.0) * 30.0
    out = sampler.sample_step(logits, T, greedy, u)
    sc_state.copy_(out.sc_probs)
    return out.argmax, out.sampled, out.entropy


@pytest.mark.slow
def test_fusion_folds_the_softcap_and_the_state_dtype_into_the_op():
    """The op reads the bfloat16 lm_head output itself (softcap folded in: the float32 logits never exist whole) and
    writes the self-conditioning probabilities in the state's dtype (the copy's conversion folded in); values equal
    the unfused compile's."""
    seen = []

    def record(graph):
        seen.extend(n for n in graph.find_nodes(op="call_function", target=torch.ops.dgemma.sample_step.default))

    logits, T, greedy, u = _inputs(2, 4, 4096 + 27, torch.bfloat16, seed=5)
    results = []
    for disabled in ((), (FUSION,)):
        state = torch.zeros(2, 4, 4096 + 27, dtype=torch.bfloat16)
        factory = UnitFactory(CompileOptions(disabled_passes=disabled, sample_step_fusion_min_bytes=0), "cpu")
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=record):
            out = torch.compile(_region_into_state, backend=factory.backend("region"), fullgraph=True)(
                logits, T, greedy, u, state)
        results.append((out, state))
    (node,) = seen
    assert node.kwargs == {"softcap": 30.0, "sc_dtype": torch.bfloat16}
    assert node.args[0].meta["val"].dtype == torch.bfloat16  # the lm_head output, not a float32 copy of it
    (on, state_on), (off, state_off) = results
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    torch.testing.assert_close(on[2], off[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_on.float(), state_off.float(), rtol=2**-8, atol=1e-7)
