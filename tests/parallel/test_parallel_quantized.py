"""A quantized weight's per-rank slice (`parallel/quantized.py`, docs/parallel.md "Quantized weights"), one process:
the rule that slices each part (codes, per-row, per-block and per-tensor scales) as a property; torchao tensors and
expert projections sliced to exactly the slice of the dequantized weight, padded with zeros, refused by name where
a slice would cut an NVFP4 block; and the compressed-tensors fixtures read slice by slice from their files
(`FileWeights`) equal to the slices of the whole loaded model, per-expert and fused layouts alike, reading fewer
bytes. The ranks themselves (gloo, logits against one process) are in tests/parallel/test_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("torchao")

import dgemma_compile as dg  # noqa: E402
from helpers import assert_same_parts  # noqa: E402
from dgemma_compile.model.backbone import ExpertProjection  # noqa: E402
from dgemma_compile.parallel.load import is_sharded  # noqa: E402
from dgemma_compile.parallel.quantized import (cat_projections, narrow_part,  # noqa: E402
                                               narrow_projection, narrow_tensor, projection)
from dgemma_compile.parallel.source import FileWeights, ModelWeights  # noqa: E402
from dgemma_compile.quant.quantize import quiet_torchao  # noqa: E402
from dgemma_compile.kernels.moe.formats import NONE  # noqa: E402
from dgemma_compile.quant.schemes import scheme as scheme_named  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "quant"


@given(extent_groups=st.integers(1, 12), group=st.sampled_from([1, 2, 16]), data=st.data())
def test_a_part_keeps_the_values_of_the_range_it_covers(extent_groups, group, data):
    """A part holding one value per `group` of the weight's `extent` values: its slice for [start, start + length)
    holds, for each weight position of the range, the value that position had (what makes the slice dequantize to
    the slice of the dequantized weight); a part of size 1 is kept whole; padding adds zeros; a range that cuts a
    group is refused. A part of one value for the whole dimension (extent == group) is shared, kept whole: whether
    the slice is still a valid layout (an NVFP4 input slice of a multiple of 16) is the layout's check."""
    extent = extent_groups * group
    start = data.draw(st.integers(0, extent - 1))
    length = data.draw(st.integers(1, extent - start))
    part = torch.arange(1, extent // group + 1, dtype=torch.float32)[None, :].repeat(3, 1)  # [3, extent / group]
    shared = torch.tensor([[7.0]] * 3)
    if extent == group:
        assert torch.equal(narrow_part(part, extent, 1, start, length, "x"), part)
        return
    if start % group or length % group:
        with pytest.raises(ValueError, match=r"layers\.0\.x \(scale\) holds one value per"):
            narrow_part(part, extent, 1, start, length, "layers.0.x (scale)")
        return
    got = narrow_part(part, extent, 1, start, length, "x")
    positions = torch.arange(start, start + length)
    assert torch.equal(got.repeat_interleave(group, dim=1), part[:, positions // group])
    assert torch.equal(narrow_part(shared, extent, 1, start, length, "x"), shared)
    padded = narrow_part(part, extent, 1, start, length, "x", padded=length + group)
    assert torch.equal(padded[:, :length // group], got) and not padded[:, length // group:].any()


def _linear_weight(scheme: str, w: torch.Tensor) -> torch.Tensor:
    """`w` quantized as `quant.quantize` quantizes a linear's weight for `scheme`."""
    with quiet_torchao():
        config = scheme_named(scheme).torchao_config()
        if config is None:
            return scheme_named(scheme).direct_weight()(w)
        from torchao.quantization import quantize_

        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w.clone(), requires_grad=False)
        quantize_(lin, config)
        return lin.weight


@pytest.mark.parametrize("scheme", ["fp8", "fp8-weight-only", "nvfp4-w4a16"])
def test_a_torchao_weight_slices_to_the_slice_of_its_dequantized_weight(scheme):
    torch.manual_seed(0)
    w = _linear_weight(scheme, torch.randn(160, 96))  # 160 rows: NVFP4's swizzled scales pad to 128-row tiles
    full = w.dequantize(torch.float32)
    x = torch.randn(5, 96)
    for dim, start, length in ((0, 16, 32), (0, 128, 32), (1, 32, 32), (1, 48, 48), (1, 0, 16)):
        part = narrow_tensor(w, dim, start, length, "w")
        assert type(part) is type(w) and part.dtype == w.dtype
        assert torch.equal(part.dequantize(torch.float32), full.narrow(dim, start, length)), (dim, start, length)
        y = nn.functional.linear(x.narrow(1, start, length) if dim == 1 else x, part)
        assert y.shape == (5, length if dim == 0 else 160) and torch.isfinite(y).all()
    padded = narrow_tensor(w, 0, 144, 16, "w", padded=32)  # the vocabulary's padding rows: zero codes, zero scales
    assert torch.equal(padded.dequantize(torch.float32), torch.cat([full[144:], torch.zeros(16, 96)]))
    if scheme.startswith("nvfp4"):
        with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.weight \(NVFP4 block scales\) holds "
                                             r"one value per 16 .* cuts a group of 16"):
            narrow_tensor(w, 1, 8, 40, "layers.0.self_attn.o_proj.weight")
    else:  # one scale per row: any column range (the rank's columns keep the whole row's scale)
        part = narrow_tensor(w, 1, 8, 40, "w")
        assert torch.equal(part.dequantize(torch.float32), full[:, 8:48]) and torch.equal(part.scale, w.scale)


def _dequantized(p: ExpertProjection) -> torch.Tensor:
    """An expert projection's [E, N, K] weight by its docstring's formula (float32)."""
    if p.quant == "nvfp4-w4a16":
        e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        codes = torch.stack([p.weight & 15, p.weight >> 4], dim=-1).flatten(-2).long()
        values = e2m1[codes & 7] * (1 - 2 * (codes >> 3)).float()
        return values * (p.weight_scale.float() / p.weight_global_scale).repeat_interleave(16, dim=-1)
    return p.weight.float() * p.weight_scale if p.quant != "none" else p.weight.float()


@pytest.mark.parametrize("scheme", ["none", "fp8", "nvfp4-w4a16"])
def test_an_expert_projection_slices_by_expert_row_and_column(scheme):
    torch.manual_seed(0)
    w = torch.randn(4, 64, 96)
    if scheme == "none":
        proj = projection(NONE, w, [], (4, 64, 96))
    else:
        weight, *scales = scheme_named(scheme).expert_weights(w, parts=2)
        proj = projection(scheme_named(scheme).experts, weight, scales, (4, 64, 96))
    full = _dequantized(proj)
    for dim, start, length in ((0, 2, 2), (1, 16, 16), (1, 32, 32), (2, 48, 48)):
        part = narrow_projection(proj, dim, start, length, "layers.0.experts.down_proj.weight")
        assert part.quant == proj.quant and torch.equal(_dequantized(part), full.narrow(dim, start, length))
    gate, up = (narrow_projection(proj, 1, s, 16, "g") for s in (0, 32))  # a rank's gate rows and up rows
    both = cat_projections([gate, up], 1)
    assert both.shape == (4, 32, 96) and torch.equal(_dequantized(both), torch.cat([full[:, :16], full[:, 32:48]], 1))
    if scheme == "nvfp4-w4a16":
        with pytest.raises(ValueError, match=r"layers\.0\.experts\.down_proj\.weight .* cuts a group of 16"):
            narrow_projection(proj, 2, 0, 88, "layers.0.experts.down_proj.weight")


def _file_source(model) -> FileWeights:
    lazy = model.checkpoint.lazy
    return FileWeights(lazy.float_sources, lazy.dtype, torch.device("cpu"),
                       quantized=lazy.quantized, files=lazy.files, scheme=model.checkpoint.scheme)


def _skewed(name: str, tmp_path: Path) -> Path:
    """A copy of NVFP4 fixture `name` whose experts' global scales differ between experts and between gate and up
    (the fixtures' are equal, so a slice that took another expert's or the other half's would pass unseen); the
    codes are unchanged, so every dequantized weight changes."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = Path(shutil.copytree(FIXTURES / name, tmp_path / name))
    state = load_file(d / "model.safetensors")
    for k, v in state.items():
        if k.endswith("experts.gate_up_proj_global_scale"):  # fused [E, 2]: (gate, up)
            state[k] = v * torch.tensor([1.0, 2.0]) * torch.arange(1, v.shape[0] + 1, dtype=v.dtype)[:, None]
        elif ".experts." in k and k.endswith(("gate_proj.weight_global_scale", "up_proj.weight_global_scale")):
            e = int(k.split(".experts.")[1].split(".")[0])
            state[k] = v * (e + 1) * (2 if k.endswith(".up_proj.weight_global_scale") else 1)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("name", ["demo-fp8-dynamic", "demo-nvfp4a16", "tiny-untied-fp8-dynamic",
                                  "tiny-untied-fp8-dynamic-fused", "tiny-untied-nvfp4a16+skew",
                                  "tiny-untied-nvfp4a16-fused+skew"])
def test_stored_quantized_slices_equal_the_slices_of_the_loaded_model(name, tmp_path):
    """`FileWeights` reads each stored part's range (per-expert and fused experts, the untied lm_head) and builds the
    weight as the loader builds the whole one: every part bitwise the whole model's slice, read without the rest.
    "+skew": the experts' global scales made distinct per expert and per gate / up half (`_skewed`)."""
    path = _skewed(name.removesuffix("+skew"), tmp_path) if name.endswith("+skew") else FIXTURES / name
    whole = dg.load(path)
    lazy = dg.load(path, lazy=is_sharded)
    quantized = {n + ".weight" for n in whole.checkpoint.quant_report.quantized}
    assert set(lazy.checkpoint.lazy.quantized) == {n for n in quantized if is_sharded(n)}
    assert any(not is_sharded(n) for n in quantized)  # the replicated ones (self-conditioning MLP) are read whole
    assert all(p.is_meta for n, p in lazy.named_parameters() if n in lazy.checkpoint.lazy.quantized)
    files, mine = _file_source(lazy), ModelWeights()
    mods, lazy_mods = dict(whole.named_modules()), dict(lazy.named_modules())
    stored = _stored_bytes(lazy)
    checked = 0
    for n, family in lazy.checkpoint.lazy.quantized.items():
        module, meta = mods[n.removesuffix(".weight")], lazy_mods[n.removesuffix(".weight")]
        whole_bytes = sum(stored[k] for k in family.all_keys())
        data_bytes = sum(stored[k] for role in ("weight", "weight_packed") for k in family.keys.get(role, []))
        if isinstance(module, ExpertProjection):
            E, N, K = module.shape
            half = N // 2 if n.endswith("gate_up_proj.weight") else N
            slices = ((0, E // 2, E // 2), (1, 0, half // 2), (1, N - half // 2, half // 2), (2, K - 16, 16),
                      (1, half // 2, half // 2))  # the gate half's second part
            read = lambda dim, start, length: files.take_projection(n, meta, dim, start, length)  # noqa: E731
            want = lambda dim, start, length: mine.take_projection(n, module, dim, start, length)  # noqa: E731
        else:
            (N, K), E = module.weight.shape, 1
            slices = ((0, N // 2, N // 2), (1, K - 16, 16))
            read = lambda dim, start, length: files.take(n, meta.weight, dim, start, length)  # noqa: E731
            want = lambda dim, start, length: mine.take(n, module.weight, dim, start, length)  # noqa: E731
        for dim, start, length in slices:
            before = files.bytes_read
            assert_same_parts(read(dim, start, length), want(dim, start, length), f"{n} {dim} {start}")
            # what was read: the range's share of the codes, the scales at most whole
            share = length / ((E, N, K) if isinstance(module, ExpertProjection) else (N, K))[dim]
            assert files.bytes_read - before <= data_bytes * share + (whole_bytes - data_bytes), (n, dim, start)
            checked += 1
    assert checked >= 3 * whole.config.num_layers


def _stored_bytes(lazy) -> dict[str, int]:
    """checkpoint key -> stored bytes of every part the loader left unread."""
    from safetensors import safe_open

    sizes = {}
    for key, path in lazy.checkpoint.lazy.files.items():
        with safe_open(path, framework="pt") as fh:
            t = fh.get_tensor(key)
            sizes[key] = t.numel() * t.element_size()
    return sizes


@pytest.fixture
def fake_rank():
    """Join torch's `fake` process group as rank r of N (its collectives return their input: a rank's partial sum
    stays its own, so the ranks' parts can be added here, in one process)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def test_quantized_logits_and_self_conditioning_product_split_over_the_vocabulary(tmp_path, fake_rank):
    """A tied model quantized by `dg.quantize` (its lm_head and its self-conditioning product are quantized copies of
    the table) sharded over 2 ranks: each rank's logits are its rows of the one-process logits, and the ranks'
    partial self-conditioning products add up to the one-process product -- the product's columns slice keeps each
    row's fp8 scale."""
    from helpers import write_checkpoint
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    from dgemma_compile import parallel

    d = write_checkpoint(tmp_path / "tiny", vocab_size=64)  # [64, 32] and [32, 64]: both copies quantized
    one = dg.load(d)
    dg.quantize(one, "fp8-weight-only")
    g = torch.Generator().manual_seed(0)
    V, D = one.config.vocab_size, one.config.hidden_size
    hidden, probs = torch.randn(2, 5, D, generator=g), torch.softmax(torch.randn(2, 5, V, generator=g) * 3, -1)
    with torch.no_grad():
        want_logits, want_product = one.logits(hidden), one.self_conditioning_embedding(probs)
    logits, product = [], 0
    for rank in range(2):
        fake_rank(rank, 2)
        model = dg.load(d)
        dg.quantize(model, "fp8-weight-only")
        parallel.shard(model)
        assert type(model.lm_head.weight.data) is Float8Tensor
        assert type(model.sc_embedding.projection.data) is Float8Tensor
        per = model.vocab_shard.per
        with torch.no_grad():
            logits.append(model.logits(hidden, local=True))
            product = product + model.self_conditioning_embedding(probs[..., rank * per:(rank + 1) * per], local=True)
    torch.testing.assert_close(torch.cat(logits, -1)[..., :V], want_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(product, want_product, rtol=0, atol=1e-5)
    assert want_product.abs().max() > 0.1 and want_logits.abs().max() > 0.1


def test_an_nvfp4_block_of_16_inputs_is_refused_from_the_files_too(tmp_path):
    """A weight of 16 inputs holds one block scale per row, which the parts' shapes alone cannot tell from a shared
    scale: keeping 8 of its columns would be no NVFP4 layout. Refused naming the tensor, by both sources: the tiny
    fixture's experts' down_proj (16 inputs) and a stored [32, 16] linear."""
    from safetensors.torch import save_file

    from dgemma_compile.quant.checkpoint import StoredWeight

    d = _skewed("tiny-untied-nvfp4a16", tmp_path)
    whole, lazy = dg.load(d), dg.load(d, lazy=is_sharded)
    name = "layers.0.experts.down_proj.weight"
    assert whole.get_submodule(name.removesuffix(".weight")).shape[2] == 16
    for source, model in ((ModelWeights(), whole), (_file_source(lazy), lazy)):
        with pytest.raises(ValueError, match=r"layers\.0\.experts\.down_proj\.weight.*multiple of 16, got 8"):
            source.take_projection(name, model.get_submodule(name.removesuffix(".weight")), 2, 0, 8)
    key = "model.decoder.layers.0.self_attn.k_proj"
    parts = {f"{key}.weight_packed": torch.randint(0, 255, (32, 8), dtype=torch.uint8),
             f"{key}.weight_scale": torch.ones(32, 1).to(torch.float8_e4m3fn),
             f"{key}.weight_global_scale": torch.ones(1)}
    save_file(parts, tmp_path / "k16.safetensors")
    stored = StoredWeight(name="layers.0.self_attn.k_proj.weight", module=key, keys={k.rsplit(".", 1)[1]: [k]
                                                                                     for k in parts}, rows=32)
    files = FileWeights({}, torch.float32, torch.device("cpu"), quantized={stored.name: stored},
                        files={k: tmp_path / "k16.safetensors" for k in parts}, scheme=scheme_named("nvfp4-w4a16"))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_proj\.weight \(NVFP4\) keeps 8 input columns"):
        files.take(stored.name, torch.empty(32, 16, device="meta"), 1, 0, 8)
