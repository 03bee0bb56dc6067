"""Weight quantization through torchao (`dgemma_compile/quant/`): what each scheme covers and leaves out, the
quantized projections against their bfloat16 originals (SQNR), all-zero activation rows, refusals that change
nothing, and compiled tokens equal to eager tokens on the demo model."""

import pytest
import torch

pytest.importorskip("torchao")

import dgemma_compile as dg  # noqa: E402
from dgemma_compile.model.config import ConfigError  # noqa: E402
from dgemma_compile.demo import DEMO_MODEL  # noqa: E402
from dgemma_compile.quant import EXCLUDED_PARTS, quantize  # noqa: E402

# SQNR floors (dB) of a quantized projection's output against the bfloat16 one on the demo's layers with random
# inputs. Measured worst layer (64 rows): fp8 28.1, fp8-weight-only 31.0, nvfp4-w4a16 19.7 dB; floors ~4 dB below.
SQNR_FLOOR = {"fp8": 24.0, "fp8-weight-only": 27.0, "nvfp4-w4a16": 15.5}


def _demo_bf16():
    return dg.load(DEMO_MODEL, dtype=torch.bfloat16)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum().clamp(min=1e-30))).item()


@pytest.mark.parametrize("scheme", sorted(SQNR_FLOOR))
def test_each_covered_projection_against_bf16_and_the_report(scheme):
    model, original = _demo_bf16(), _demo_bf16()
    report = quantize(model, scheme)
    linears = {n for n, m in original.named_modules() if isinstance(m, torch.nn.Linear) and ".router." not in f".{n}."}
    experts = {f"layers.{i}.experts.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")}
    assert set(report.quantized) == linears | experts and len(linears) == 29
    # the demo's 27-row vocabulary: neither tied copy can be made (dims), each listed with its reason
    assert [n for n, _ in report.excluded[:2]] == ["lm_head (the tied embeddings' logits)",
                                                   "sc_embedding (the self-conditioning product probs @ embeddings)"]
    assert "27" in report.excluded[0][1] and model.lm_head is None and model.sc_embedding is None
    assert report.excluded[-len(EXCLUDED_PARTS):] == list(EXCLUDED_PARTS)
    assert report.bytes_after < report.bytes_before and model.checkpoint.quant_scheme == scheme
    assert model.expert_quant == scheme
    g = torch.Generator().manual_seed(0)
    mods, refs = dict(model.named_modules()), dict(original.named_modules())
    sqnr = {n: _sqnr(refs[n](x), mods[n](x)) for n in linears
            for x in [torch.randn(16, refs[n].in_features, generator=g).to(torch.bfloat16)]}
    for i in range(4):  # the routed experts through the reference loop, every expert used
        x = torch.randn(64, model.config.hidden_size, generator=g).to(torch.bfloat16)
        w = torch.rand(64, 2, generator=g)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(64)])
        sqnr[f"layers.{i}.experts"] = _sqnr(original.layers[i].experts(x, w, idx, "loop"),
                                            model.layers[i].experts(x, w, idx, "loop"))
    worst = min(sqnr, key=sqnr.get)
    assert sqnr[worst] >= SQNR_FLOOR[scheme], f"{scheme}: worst SQNR {sqnr[worst]:.1f} dB ({worst})"
    # what the model never quantizes stays as it was
    assert type(model.embed_tokens.weight) is torch.nn.Parameter
    assert torch.equal(model.embed_tokens.weight, original.embed_tokens.weight)


@pytest.mark.parametrize("scheme", sorted(SQNR_FLOOR))
def test_tied_embeddings_logits_and_self_conditioning_copies(scheme, tiny_dir):
    """A tied model whose vocabulary (48) and width (32) the schemes take: the logits and the self-conditioning product
    read quantized copies of the table (`lm_head`, `sc_embedding`), the lookup keeps the table."""
    model, original = dg.load(tiny_dir, dtype=torch.bfloat16), dg.load(tiny_dir, dtype=torch.bfloat16)
    report = quantize(model, scheme)
    assert {"lm_head", "sc_embedding"} <= set(report.quantized)
    assert type(model.lm_head.weight) is not torch.nn.Parameter  # a torchao tensor
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 32, generator=g).to(torch.bfloat16)
    assert _sqnr(original.logits(hidden), model.logits(hidden)) >= SQNR_FLOOR[scheme]
    assert torch.equal(model.embed(torch.zeros(2, 8, dtype=torch.long)),
                       original.embed(torch.zeros(2, 8, dtype=torch.long)))
    probs = torch.softmax(torch.randn(2, 8, 48, generator=g) * 3, -1).to(torch.bfloat16)
    # the self-conditioning product through the quantized copy (`sc_embedding`) against the float table
    ref = original.self_conditioning_embedding(probs)
    assert _sqnr(ref, model.self_conditioning_embedding(probs)) >= SQNR_FLOOR[scheme]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", sorted(SQNR_FLOOR))
def test_all_zero_activation_rows_and_weight_rows_stay_finite(scheme, dtype):
    """Step 1's self-conditioning input is exactly zero, and frozen rows of a bucket can be: a zero row in, a zero row
    out (dynamic fp8 activations divide by the row's amax: floored, in float16 too, where 1e-12 is 0); a zero weight
    row (a pruned channel) gives a zero output column, not NaN. NVFP4 on float16 is refused up front."""
    model = dg.load(DEMO_MODEL, dtype=dtype)
    lin = model.self_conditioning.gate_proj
    lin.weight.data[5] = 0
    if scheme.startswith("nvfp4") and dtype == torch.float16:
        with pytest.raises(ConfigError, match="bfloat16 or float32"):
            quantize(model, scheme)
        assert model.lm_head is None and type(lin.weight) is torch.nn.Parameter  # nothing changed
        return
    quantize(model, scheme)
    x = torch.randn(4, lin.in_features).to(dtype)
    x[1] = 0
    y = lin(x)
    assert torch.isfinite(y).all() and not y[1].any() and not y[:, 5].any()


def test_refusals_change_nothing():
    model = _demo_bf16()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="'nvfp4' .*sm100.*nvfp4-w4a16"):
        quantize(model, "nvfp4")
    with pytest.raises(ConfigError, match="quant scheme: must be one of"):
        quantize(model, "int4")
    assert model.checkpoint.quant_scheme is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    quantize(model, "fp8-weight-only")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize(model, "fp8")


@pytest.mark.slow
def test_compiled_tokens_equal_eager_tokens_fp8(demo):
    """The served scheme, compiled (one bucket of 2) against the eager generator on the same quantized model."""
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.demo import tasks

    _, tok = demo
    model = _demo_bf16()
    quantize(model, "fp8")
    prompts = [tok(p)["input_ids"] for _, p, _ in tasks.make_split("heldout", 2, seed=0)]
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256))
    compiled = gen.generate(prompts, seed=[1, 2])
    eager = dg.generate(model, prompts, seed=[1, 2], moe_impl=gen.moe_impl, max_seq_len=256)
    assert compiled.sequences == eager.sequences
    answers = [tok.decode(seq, skip_special_tokens=True) for seq in compiled.sequences]
    assert all(tasks.check(p, a) for (_, p, _), a in zip(tasks.make_split("heldout", 2, seed=0), answers)), answers
