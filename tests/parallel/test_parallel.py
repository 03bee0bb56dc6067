"""Tensor parallel (dgemma_compile/parallel/, docs/parallel.md): the head plan, the vocabulary's padded split and the
split checks (fast), and on 2 and 4 gloo ranks of the demo model and on 2 ranks of a released-width slice (slow):
prefill, denoise (with and without self-conditioning) and commit logits of the sharded model against the
single-process model, a shape that cannot be
split refused with nothing changed, and a dead or stalled rank making its peer fail within the group's timeout
instead of hanging."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile import parallel
from dgemma_compile.model.config import ConfigError
from dgemma_compile.parallel import RankFailed, RendezvousError, attention_heads, split, vocab_range
from dgemma_compile.parallel.vocab import local_rows
from dgemma_compile.parallel.group import env_rank
from dgemma_compile.step.sampler import SCHEME

# Logits of the sharded model vs the single process, max abs over every real position (float32, |logits| <= 30 by
# the softcap). Each row-parallel projection sums its K products in world_size partial sums instead of one: a
# different rounding order, a few float32 ulps per output (eps = 1.2e-7 relative; the spike measured 1.7e-6 abs on a
# K = 256 product of unit-scale values). The layers carry that to the logits scaled by their magnitude (<= 30):
# at the demo's shapes (longest sum K = 256) measured 5.4e-6 .. 2.1e-5 over the forwards below (2026-12-01), bound
# 1e-4 (a 5x margin; the bound of the transformers parity tests). Rounding errors of a K-term sum grow like sqrt(K),
# so the bound scales by sqrt(K / 256): the released-width slice (K up to 8192, o_proj of the full layers) gets
# 5.7e-4; measured 7e-6 .. 4.7e-5 there. A wrong shard moves logits by O(1) (o_proj reading another rank's heads:
# 20..25).
LOGITS_ATOL = 1e-4


def logits_bound(longest_sum: int) -> float:
    """The max abs logits difference allowed when the longest row-parallel sum has `longest_sum` terms (above)."""
    return LOGITS_ATOL * max(1.0, (longest_sum / 256) ** 0.5)
GROUP_TIMEOUT_S = 5.0


# ----- fast: the plan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,Hkv,N", [(H, Hkv, N) for H in (1, 2, 4, 8, 16) for Hkv in (1, 2, 4, 8) if H % Hkv == 0
                                     for N in (1, 2, 4, 8)])
def test_attention_heads_cover_every_query_head_once_with_the_kv_heads_it_reads(H, Hkv, N):
    ok = H % N == 0 and (Hkv % N == 0 if Hkv >= N else N % Hkv == 0)
    if not ok:
        with pytest.raises(ValueError, match=r"layers\.3\.self_attn\.(q|k)_proj\.weight"):
            attention_heads(H, Hkv, 0, N, layer=3)
        return
    seen_q, seen_kv = [], set()
    for r in range(N):
        q, kv = attention_heads(H, Hkv, r, N, layer=3)
        assert len(q) == H // N and len(kv) == max(Hkv // N, 1)
        assert {h // (H // Hkv) for h in q} <= set(kv)  # GQA: query head h reads KV head h // group
        # local GQA inside the rank: local query head j reads local KV head j // (len(q) / len(kv))
        assert [kv[j // (len(q) // len(kv))] for j in range(len(q))] == [h // (H // Hkv) for h in q]
        seen_q += q
        seen_kv |= set(kv)
    assert sorted(seen_q) == list(range(H)) and seen_kv == set(range(Hkv))


def test_released_shapes_split_over_2_4_8_ranks_and_refuse_3():
    for N in (2, 4, 8):  # 16 query heads; sliding layers 8 KV heads, full layers 2 (replicated from N = 4)
        for r in range(N):
            assert len(attention_heads(16, 8, r, N, 0)[1]) == 8 // N
            assert len(attention_heads(16, 2, r, N, 5)[1]) == max(2 // N, 1)
    with pytest.raises(ValueError, match=r"layers\.5\.self_attn\.q_proj\.weight has 16 query heads"):
        attention_heads(16, 2, 0, 3, 5)


def test_split_names_the_tensor_it_cannot_split():
    w = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(split(w, 0, 1, 3, "w"), w[2:4])
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_proj\.weight \[6, 2\] cannot be split over 4"):
        split(w, 0, 0, 4, "layers.0.mlp.gate_proj.weight")


@pytest.mark.parametrize("V,N", [(27, 2), (27, 4), (28, 4), (5, 4), (262144, 8)])
def test_vocabulary_rows_pad_to_a_multiple_of_the_ranks_and_cover_every_id_once(V, N):
    table = torch.arange(float(V))[:, None].expand(V, 3)
    parts = [local_rows(table, r, N) for r in range(N)] if V < 1000 else []
    per = -(-V // N)
    owners = []
    for r in range(N):
        start, rows = vocab_range(V, r, N)
        assert rows == per and start == r * per
        owners += [i for i in range(start, start + per) if i < V]
        if parts:
            assert parts[r].shape == (per, 3)
            real = max(0, min(V, start + per) - start)
            assert torch.equal(parts[r][:real, 0], torch.arange(float(start), float(start + real)))
            assert not parts[r][real:].any()  # padding rows are zero
    assert owners == list(range(V))


def test_env_rank_names_missing_variables(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RendezvousError, match=r"\['WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        env_rank()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(RendezvousError, match=r"RANK=2 is outside \[0, WORLD_SIZE=2\)"):
        env_rank()


def test_shard_without_a_process_group_raises(demo):
    model, _ = demo
    with pytest.raises(RuntimeError, match="no process group"):
        parallel.shard(model)
    assert model.tensor_parallel is None


# ----- slow: 2 gloo ranks of the demo model ------------------------------------------------------------------------
def _forwards(model) -> dict[str, torch.Tensor]:
    """Prefill (two chunks, rows of different lengths, past the sliding window), denoise without and with
    self-conditioning, commit, denoise after the commit: float32 logits of each, real positions only."""
    g = torch.Generator().manual_seed(0)
    V, C = model.config.vocab_size, model.config.canvas_length
    cache = model.new_cache(batch_size=2, max_seq_len=64)
    prompt = torch.randint(3, V, (2, 20), generator=g)
    lengths = torch.tensor([20, 13])
    out = {}
    with torch.no_grad():
        out["embed"] = model.embed(prompt)  # bitwise: one rank contributes each row
        pre = model.logits(dg.encode(model, prompt, cache, lengths))
        out["prefill_row0"], out["prefill_row1"] = pre[0], pre[1, :13]
        canvas = torch.randint(0, V, (2, C), generator=g)
        out["denoise"] = dg.denoise(model, canvas, cache)
        sc = torch.randn(2, C, V, generator=g) * 3
        out["denoise_self_conditioned"] = dg.denoise(model, canvas, cache, sc)
        out["commit"] = model.logits(dg.encode(model, torch.randint(3, V, (2, C), generator=g), cache))
        out["denoise_after_commit"] = dg.denoise(model, canvas, cache, sc)
    return out


def _load_demo():
    from dgemma_compile.demo import DEMO_MODEL

    return dg.load(DEMO_MODEL)


def _rank_forwards(rank: int, world: int, out_dir: str) -> None:
    parallel.init("cpu", timeout_s=60)
    bad = _load_demo()  # a dense MLP of 255 features cannot be split: refused, naming it, nothing changed
    bad.layers[2].mlp.gate_proj = torch.nn.Linear(bad.config.hidden_size, 255, bias=False)
    q_before = bad.layers[0].self_attn.q_proj.weight
    try:
        parallel.shard(bad)
        raise AssertionError("shard accepted an MLP of 255 features")
    except ValueError as e:
        assert "layers.2.mlp.gate_proj.weight [255, 128] cannot be split" in str(e), e
    assert getattr(bad, "tensor_parallel", None) is None and bad.layers[0].self_attn.q_proj.weight is q_before
    assert type(bad.embed_tokens) is torch.nn.Embedding and bad.config.num_kv_heads == (2, 1, 2, 1)
    model = parallel.shard(_load_demo())
    try:  # the other order is refused too: quantizing a sharded model
        dg.quantize(model, "fp8-weight-only")
        raise AssertionError("quantize accepted a sharded model")
    except ConfigError as e:
        assert "sharded for tensor parallel" in str(e), e
    from dgemma_compile.demo import DEMO_MODEL

    lazy = parallel.load_sharded(DEMO_MODEL)  # only this rank's slices read from the file: the same model, bitwise
    _same_model(model, lazy, "load_sharded")
    report = lazy.tensor_parallel.load_report
    # expert parallel: E/N whole experts a rank (the demo's 8: 4 or 2 a rank); 5 experts cannot be split by expert
    bad = _load_demo()
    for p in (bad.layers[1].experts.gate_up_proj, bad.layers[1].experts.down_proj):
        p.weight = torch.nn.Parameter(p.weight[:5], requires_grad=False)
    try:
        parallel.shard(bad, experts="expert")
        raise AssertionError("shard accepted 5 experts split by expert")
    except ValueError as e:
        assert f"layers.1.experts.gate_up_proj.weight holds 5 experts, which cannot be split over {world}" in str(e), e
    assert getattr(bad, "tensor_parallel", None) is None and type(bad.layers[0].experts).__name__ == "Experts"
    by_expert = parallel.shard(_load_demo(), experts="expert")
    assert by_expert.tensor_parallel.experts == "expert"
    assert by_expert.layers[0].experts.gate_up_proj.weight.shape[0] == 8 // world
    lazy_ep = parallel.load_sharded(DEMO_MODEL, experts="expert")
    _same_model(by_expert, lazy_ep, "load_sharded(experts='expert')")
    ep_read = lazy_ep.tensor_parallel.load_report.largest
    from dgemma_compile.step.sampler import step_scheme

    quantized = _quantized_ranks(world)
    torch.save({"out": _forwards(model), "out_expert": _forwards(by_expert), "kv_heads": model.config.num_kv_heads,
                **quantized,
                "scheme": step_scheme(model),
                "ep_read": {k: v for k, v in ep_read.items() if ".experts." in k},
                "cache_heads": [k.shape[1] for k in model.new_cache(1, 8).keys],
                "load": (report.bytes_read, report.full_bytes, report.largest, report.full)},
               Path(out_dir, f"rank{rank}.pt"))
    parallel.destroy()


QUANT_FIXTURES = Path(__file__).parents[1] / "fixtures" / "quant"
FP8_SQNR_FLOOR = 25.0
"""fp8 (dynamic activations) on 2 ranks against the float demo, dB over each forward's logits: a row-parallel
projection scales each rank's slice of an activation row by its own amax, so its logits are another draw of fp8's
rounding than one process's (routing flips included), not within float32 bounds of it. Measured (2026-12-03) over
`_forwards`: one process 28.9-31.2 dB, 2 ranks 26.9-31.3 dB (the two differ by up to 2.6 abs, logits up to 30); a
scale one row off measures ~5 dB."""


def _quantized_ranks(world: int) -> dict:
    """2 ranks only: a compressed-tensors NVFP4 checkpoint read slice by slice (`load_sharded`, the same model as
    sharding the whole loaded one, part for part) and the float demo quantized to fp8, then sharded: their
    forwards, and their step numerics' names."""
    if world != 2:
        return {}
    from helpers import assert_same_parts

    from dgemma_compile.step.sampler import step_scheme

    lazy = parallel.load_sharded(QUANT_FIXTURES / "demo-nvfp4a16")
    whole = parallel.shard(dg.load(QUANT_FIXTURES / "demo-nvfp4a16"))
    want, got = whole.state_dict(), lazy.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert_same_parts(want[k], got[k], k)
    fp8 = _load_demo()
    dg.quantize(fp8, "fp8")
    fp8 = parallel.shard(fp8)
    return {"out_nvfp4": _forwards(lazy), "out_fp8": _forwards(fp8), "scheme_fp8": step_scheme(fp8),
            "nvfp4_read": lazy.tensor_parallel.load_report.bytes_read / lazy.tensor_parallel.load_report.full_bytes}


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum()))


def _same_model(want_model, got_model, what: str) -> None:
    want, got = want_model.state_dict(), got_model.state_dict()
    assert want.keys() == got.keys() and got_model.config == want_model.config
    assert all(torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype for k in want), f"{what} differs"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_the_single_process_model(tmp_path, world):
    """2 ranks: sliding layers' 2 KV heads split, full layers' 1 replicated, vocabulary 27 padded to 28; 4 ranks:
    one query head a rank, every KV head replicated, 7 vocabulary rows a rank (the last holds 6 and a pad). The
    experts split by intermediate slice (the default) and, the same forwards again, by expert (experts="expert":
    4 or 2 of the 8 experts a rank, read as E/N whole experts from the file), both under the same bound. At 2 ranks
    also quantized: an NVFP4 checkpoint read slice by slice under the same bound against one process, and fp8
    (dynamic activations, per-rank activation scales) against the float demo by SQNR (`FP8_SQNR_FLOOR`)."""
    t0 = time.monotonic()
    parallel.spawn(_rank_forwards, world, (str(tmp_path),), timeout_s=150)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ref = _forwards(_load_demo())
    # the cache holds the rank's KV heads only: 1 per layer at 2 and 4 ranks
    assert all(r["kv_heads"] == (1, 1, 1, 1) and r["cache_heads"] == [1, 1, 1, 1] for r in ranks)
    for r in ranks:
        assert torch.equal(r["out"]["embed"], ref["embed"])  # the vocabulary-parallel lookup is exact
        assert r["scheme"] == f"{SCHEME}+vocab-shard-{world}/v1"  # the numerics name the split
    _check_slices_read(ranks, world, _load_demo())
    for r in ranks:  # a rank read its experts' rows only: 1/N of each expert tensor
        n_experts = {k: v for k, v in ranks[0]["load"][3].items() if ".experts." in k}
        assert r["ep_read"].keys() == n_experts.keys() and all(r["ep_read"][k] == n // world
                                                               for k, n in n_experts.items()), r["ep_read"]
    for which in ("out", "out_expert"):
        for name, want in ref.items():
            got = ranks[0][which][name]
            for r in ranks[1:]:  # the sampler needs the same bits on every rank
                assert torch.equal(r[which][name], got), f"{which} {name}: ranks disagree"
            assert want.abs().max() > 1000 * LOGITS_ATOL  # real values, not a degenerate output
            diff = float((got - want).abs().max())
            assert diff <= LOGITS_ATOL, f"{which} {name}: max abs diff {diff:.3g} > {LOGITS_ATOL}"
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (which, name)
            print(which, name, f"{diff:.3g}")
    if world == 2:  # quantized: NVFP4 weights only (within the float bound of one process), fp8 activations too
        one = _forwards(dg.load(QUANT_FIXTURES / "demo-nvfp4a16"))
        fp8 = _load_demo()
        dg.quantize(fp8, "fp8")
        one_fp8 = _forwards(fp8)
        assert ranks[0]["scheme_fp8"] == f"{SCHEME}+vocab-shard-2/v1+fp8-rank-activations/v1"
        assert 0.45 < ranks[0]["nvfp4_read"] < 0.6, ranks[0]["nvfp4_read"]  # half the sharded parts, not all
        for name, want in one.items():
            for r in ranks[1:]:
                assert torch.equal(r["out_nvfp4"][name], ranks[0]["out_nvfp4"][name])
                assert torch.equal(r["out_fp8"][name], ranks[0]["out_fp8"][name])
            diff = float((ranks[0]["out_nvfp4"][name] - want).abs().max())
            assert diff <= LOGITS_ATOL and torch.equal(ranks[0]["out_nvfp4"][name].argmax(-1), want.argmax(-1)), name
            if name != "embed":  # the lookup is exact, not quantized
                sqnr = _sqnr(ref[name], ranks[0]["out_fp8"][name])
                one_sqnr = _sqnr(ref[name], one_fp8[name])
                assert sqnr >= FP8_SQNR_FLOOR, f"fp8 {name}: {sqnr:.1f} dB (one process {one_sqnr:.1f} dB)"
                print("nvfp4", name, f"{diff:.3g}", "fp8", f"{sqnr:.1f} dB")
    print(f"{world} ranks: {time.monotonic() - t0:.1f} s")


def _check_slices_read(ranks, world: int, model) -> None:
    """`load_sharded` read, of each sharded tensor, no more than the rank's slice: 1/N of it (gate and up halves of
    the experts' gate_up_proj read apart: 1/2N each; the vocabulary's last rank fewer real rows), a KV head's rows
    where the KV heads are replicated (the demo's full layers: 1 KV head, the only tensors read whole); so the bytes
    read are the sum of those slices, about 1/N of the sharded tensors' bytes."""
    from dgemma_compile.parallel.load import is_sharded

    cfg = model.config
    names = {n for n in model.state_dict() if is_sharded(n)}  # q/k/v/o, MLP, experts of every layer; the vocabulary
    for bytes_read, full_bytes, largest, full in (r["load"] for r in ranks):
        assert set(largest) == set(full) == names
        expect = 0
        for name, n in full.items():
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            hkv = cfg.num_kv_heads[layer] if layer is not None else 0
            if name.endswith(("k_proj.weight", "v_proj.weight")) and hkv < world:
                want = n // hkv  # one replicated KV head
            elif name.endswith("gate_up_proj.weight"):
                want = n // (2 * world)
            elif name in ("embed_tokens.weight", "lm_head.weight"):
                want = -(-cfg.vocab_size // world) * (n // cfg.vocab_size)
            else:
                want = n // world
            assert largest[name] <= want, f"{name}: read {largest[name]} elements, its slice is {want} of {n}"
            assert largest[name] < n or (hkv == 1 and "_proj" in name and name.split(".")[-2][0] in "kv"), name
            expect += want * 2 if name.endswith("gate_up_proj.weight") else want
        assert bytes_read <= 4 * expect and bytes_read < full_bytes / world * 1.5, (bytes_read, full_bytes)


def _released_slice():
    """2 layers (sliding, full) at the released widths: hidden 2816, 16 query heads, sliding 8 KV heads of 256, full
    2 KV heads of 512 (split 1 a rank at 2 ranks, not replicated), dense MLP 2112, experts of 704 (4 of them, top 2,
    instead of 128 top 8), vocabulary 61 (padded to 62); random float32 weights from one seeded generator (every
    process builds the same model), fan-in scaled, norm weights and router scales around 1."""
    from dgemma_compile.model.config import FULL, SLIDING, ModelConfig, RopeConfig
    from dgemma_compile.model.backbone import DiffusionGemma

    cfg = ModelConfig(vocab_size=61, hidden_size=2816, intermediate_size=2112, num_layers=2, num_attention_heads=16,
                      layer_types=(SLIDING, FULL), head_dims=(256, 512), num_kv_heads=(8, 2), sliding_window=16,
                      rope={SLIDING: RopeConfig(rope_type="default", theta=1e4),
                            FULL: RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25)},
                      num_experts=4, top_k_experts=2, moe_intermediate_size=704, canvas_length=16)
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    model = model.to_empty(device="cpu")
    model.init_buffers("cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(1.0)
    return model.eval()


def _rank_released(rank: int, world: int, out_dir: str) -> None:
    parallel.init("cpu", timeout_s=120)
    model = parallel.shard(_released_slice())
    torch.save({"out": _forwards(model), "kv_heads": model.config.num_kv_heads}, Path(out_dir, f"rank{rank}.pt"))
    parallel.destroy()


@pytest.mark.slow
def test_released_width_slice_on_two_ranks_matches_the_single_process_model(tmp_path):
    """The reduction lengths of the release (o_proj sums 4096 and 8192 products, down_proj 2112, experts 704, the
    hidden 2816) under the same bound."""
    parallel.spawn(_rank_released, 2, (str(tmp_path),), timeout_s=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = _forwards(_released_slice())
    assert ranks[0]["kv_heads"] == (4, 1)
    assert torch.equal(ranks[0]["out"].pop("embed"), ref.pop("embed"))
    bound = logits_bound(16 * 512)  # the full layers' o_proj
    for name, want in ref.items():
        got = ranks[0]["out"][name]
        assert torch.equal(ranks[1]["out"][name], got), f"{name}: ranks disagree"
        assert want.abs().max() > 1000 * LOGITS_ATOL
        diff = float((got - want).abs().max())
        assert diff <= bound, f"{name}: max abs diff {diff:.3g} > {bound:.3g}"
        print(name, f"{diff:.3g}", f"max|logit| {float(want.abs().max()):.3g}")


def _rank_dies(rank: int, world: int, out_dir: str, how: str) -> None:
    parallel.init("cpu", timeout_s=GROUP_TIMEOUT_S)
    model = parallel.shard(_load_demo())
    if rank == 1:
        if how == "exit":
            os._exit(3)  # a crash: the socket closes
        time.sleep(10 * GROUP_TIMEOUT_S)  # a stall: alive, never joining the collective
        return
    t0 = time.monotonic()
    try:
        _forwards(model)
    except Exception as e:
        Path(out_dir, "rank0.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}",
                                                            "elapsed_s": time.monotonic() - t0}))
        raise
    Path(out_dir, "rank0.json").write_text(json.dumps({"error": None}))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_dead_rank_makes_its_peer_fail_within_the_timeout(tmp_path, how):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        parallel.spawn(_rank_dies, 2, (str(tmp_path), how), timeout_s=90)
    wall = time.monotonic() - t0
    rep = json.loads((tmp_path / "rank0.json").read_text())
    assert rep["error"] is not None, "rank 0 finished its forwards without its peer"
    assert rep["elapsed_s"] <= GROUP_TIMEOUT_S + 5, rep
    # gloo's own words: a crash closes (or resets) the peer's socket at once; a stall runs into the group's timeout
    timed_out = f"Timed out waiting {int(GROUP_TIMEOUT_S * 1000)}ms"
    want = r"Connection (closed|reset) by peer" if how == "exit" else timed_out
    assert re.search(want, rep["error"]), rep
    # rank 0 raised (exit code 1), it was not left running; rank 1 crashed (3) or was still stalled (None)
    assert info.value.exit_codes == [1, 3 if how == "exit" else None], (info.value.exit_codes, str(info.value))
    assert "rank 0: exit code 1" in str(info.value)
    assert wall < 60, wall
    print(how, rep)
