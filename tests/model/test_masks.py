"""Mask factories of `dgemma_compile.model.masks` against the dense reference `dense_block_mask`, and FlexAttention
(eager and compiled) against `model.dense_attention` under that mask.

Legend: B batch, T block length, S committed slots, H query heads, Hkv kv heads, D head dim.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from dgemma_compile.model.masks import (
    WINDOW_KINDS,
    block_mask_mod,
    block_sparsity,
    commit_denoise_mask_mod,
    dense_block_mask,
    dense_commit_denoise_mask,
    flex_block_attention,
    make_block_mask,
    select_mask_mod,
)
from dgemma_compile.model.backbone import dense_attention
from helpers import assert_sparsity_of_create_block_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

SETTINGS = settings(derandomize=True, deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw, max_B=4, max_T=12, max_S=40):
    """A batch mix: per-row lengths, n_new and causal flags, plus T, S, window and window kind."""
    B = draw(st.integers(1, max_B))
    T = draw(st.integers(1, max_T))
    S = draw(st.integers(0, max_S))
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    n_new = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    causal = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    W = draw(st.none() | st.integers(1, S + T + 2))
    kind = draw(st.sampled_from(WINDOW_KINDS))
    return dict(lengths_B=torch.tensor(lengths), n_new_B=torch.tensor(n_new), causal_B=torch.tensor(causal),
                T=T, S=S, W=W, kind=kind)


def _dense(c):
    return dense_block_mask(c["lengths_B"], c["n_new_B"], c["causal_B"], block_len=c["T"], cache_slots=c["S"],
                            sliding_window=c["W"], window_kind=c["kind"])


def _mask_mod(c):
    return block_mask_mod(c["lengths_B"], c["n_new_B"], c["causal_B"], cache_slots=c["S"], sliding_window=c["W"],
                          window_kind=c["kind"])


# --- mask_mod == dense reference ---------------------------------------------------------------------------------

@SETTINGS
@given(layouts())
def test_mask_mod_matches_dense(c):
    B, T, S = len(c["lengths_B"]), c["T"], c["S"]
    got = create_mask(_mask_mod(c), B, 1, T, S + T, device="cpu")
    assert got.shape == (B, 1, T, S + T)
    assert torch.equal(got[:, 0], _dense(c))


def test_mask_mod_name_carries_parameters():
    L, n, c = torch.tensor([3]), torch.tensor([2]), torch.tensor([True])
    assert block_mask_mod(L, n, c, cache_slots=64, sliding_window=16).__name__ == "block_mask_S64_W16_anchored_mixed"
    assert (block_mask_mod(L, n, False, cache_slots=64, sliding_window=4, window_kind="symmetric").__name__
            == "block_mask_S64_W4_symmetric_bidir")
    assert block_mask_mod(L, None, True, cache_slots=8).__name__ == "block_mask_S8_full_causal"


@settings(max_examples=60)
@given(data=st.data(), causal=st.booleans(), all_real=st.booleans(), W=st.one_of(st.none(), st.integers(1, 20)),
       kind=st.sampled_from(["anchored", "symmetric"]))
def test_static_mode_arguments_match_per_row_tensors(data, causal, all_real, W, kind):
    """One bool for every row and n_new=None (every block token real) give the mask of the equivalent tensors."""
    B, T, S = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9)), data.draw(st.integers(0, 30))
    L = torch.tensor(data.draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    n = torch.full((B,), T) if all_real else torch.tensor(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    c = torch.full((B,), causal)
    kw = dict(cache_slots=S, sliding_window=W, window_kind=kind)
    expected = dense_block_mask(L, n, c, block_len=T, **kw)
    got = create_mask(block_mask_mod(L, None if all_real else n, causal, **kw), B, 1, T, S + T, device="cpu")[:, 0]
    assert torch.equal(got, expected)
    assert torch.equal(dense_block_mask(L, None if all_real else n, causal, block_len=T, **kw), expected)


@pytest.mark.parametrize("override, match", [
    (dict(window_kind="sliding"), "window_kind"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(causal_B=torch.tensor([1])), "bool"),
    (dict(n_new_B=torch.tensor([1, 2])), "1-D of one length"),
])
def test_mask_mod_rejects_bad_arguments(override, match):
    args = dict(lengths_B=torch.tensor([3]), n_new_B=torch.tensor([2]), causal_B=torch.tensor([True]), cache_slots=8)
    with pytest.raises(ValueError, match=match):
        block_mask_mod(**(args | override))


@st.composite
def commit_layouts(draw, max_B=4, max_C=10, max_S=40):
    """A fused commit + denoise forward: per-row lengths and committed counts (room for them in S), C, S, window."""
    B, C = draw(st.integers(1, max_B)), draw(st.integers(1, max_C))
    S = draw(st.integers(C, max_S))
    n_new = draw(st.lists(st.sampled_from([0, C]) | st.integers(0, C), min_size=B, max_size=B))
    lengths = [draw(st.integers(0, S - n)) for n in n_new]
    W = draw(st.none() | st.integers(1, S + C + 2))
    return dict(lengths_B=torch.tensor(lengths), n_new_B=torch.tensor(n_new), C=C, S=S, W=W,
                kind=draw(st.sampled_from(WINDOW_KINDS)))


@SETTINGS
@given(commit_layouts())
def test_commit_denoise_mask_mod_matches_dense(c):
    B, C, S = len(c["lengths_B"]), c["C"], c["S"]
    kw = dict(canvas=C, cache_slots=S, sliding_window=c["W"], window_kind=c["kind"])
    got = create_mask(commit_denoise_mask_mod(c["lengths_B"], c["n_new_B"], **kw), B, 1, 2 * C, S + 2 * C,
                      device="cpu")
    assert torch.equal(got[:, 0], dense_commit_denoise_mask(c["lengths_B"], c["n_new_B"], **kw))


# --- block_sparsity == create_block_mask's sparsity --------------------------------------------------------------

BLOCK_SIZES = st.sampled_from([(4, 4), (8, 16), (16, 8), (128, 128)])


@SETTINGS
@given(layouts(max_T=20, max_S=60), BLOCK_SIZES)
def test_block_sparsity_equals_create_block_mask(c, block_size):
    """Per-row mixed masks (both modes, both window kinds, padded rows), at block sizes that divide T and S + T and
    ones that do not (edge blocks are never full)."""
    assert_sparsity_of_create_block_mask(_mask_mod(c), len(c["lengths_B"]), c["T"], c["S"] + c["T"], block_size)


@SETTINGS
@given(commit_layouts(max_S=60), BLOCK_SIZES, st.data())
def test_block_sparsity_of_commit_denoise_and_selected_rows(c, block_size, data):
    """The fused layout: commit + denoise rows, and a fused plan's per-row choice between those and mixed rows."""
    B, C, S = len(c["lengths_B"]), c["C"], c["S"]
    window = dict(sliding_window=c["W"], window_kind=c["kind"])
    fused = commit_denoise_mask_mod(c["lengths_B"], c["n_new_B"], canvas=C, cache_slots=S, **window)
    assert_sparsity_of_create_block_mask(fused, B, 2 * C, S + 2 * C, block_size)
    causal = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    rows = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B)))
    n_all = torch.full((B,), 2 * C)
    other = block_mask_mod(c["lengths_B"], torch.minimum(n_all, c["n_new_B"] * 2), causal, cache_slots=S, **window)
    assert_sparsity_of_create_block_mask(select_mask_mod(rows, fused, other), B, 2 * C, S + 2 * C, block_size)


@SETTINGS
@given(layouts(max_T=20, max_S=60), BLOCK_SIZES)
def test_make_block_mask_is_create_block_mask(c, block_size):
    """`make_block_mask` (block_sparsity + `BlockMask.from_kv_blocks`, no vmap: no Dynamo import) gives the BlockMask
    create_block_mask gives: every tensor (partial and full blocks, by key and by query), the block size, the
    lengths and the mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T, S = len(c["lengths_B"]), c["T"], c["S"]
    mm = _mask_mod(c)
    ours = make_block_mask(mm, B, T, S, "cpu", block_size=block_size)
    ref = create_block_mask(mm, B, None, T, S + T, device="cpu", BLOCK_SIZE=block_size)
    assert (ours.BLOCK_SIZE, ours.seq_lengths, ours.mask_mod) == (ref.BLOCK_SIZE, ref.seq_lengths, ref.mask_mod)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_masks_import_no_compiler():
    """Building a plan's block mask imports neither Dynamo nor Inductor (a fresh interpreter): a CLI start that
    loads its step from the compile cache pays for neither."""
    import subprocess
    import sys

    code = ("import sys, torch; from dgemma_compile.model.masks import block_mask_mod, make_block_mask; "
            "mm = block_mask_mod(torch.tensor([3]), torch.tensor([4]), torch.tensor([False]), cache_slots=8); "
            "make_block_mask(mm, 1, 4, 8, 'cpu', block_size=4); "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_block_sparsity_marks_whole_visible_blocks_full():
    """A denoise row with 8 committed tokens and a canvas of 8, blocks of 4: the committed blocks and the canvas
    blocks are full, the empty committed slots visited by no query (and the edge of a padded row is partial)."""
    lengths, n_new, causal = torch.tensor([8, 8]), torch.tensor([8, 6]), torch.tensor([False, True])
    mm = block_mask_mod(lengths, n_new, causal, cache_slots=16)
    partial, p_idx, full, f_idx = block_sparsity(mm, 2, 8, 24, (4, 4), "cpu")
    assert full[0, 0].tolist() == [4, 4] and f_idx[0, 0, 0, :4].tolist() == [0, 1, 4, 5]
    assert partial[0, 0].tolist() == [0, 0]
    # the causal row with 6 real tokens: query block 0 (all real) sees both committed blocks whole and its
    # block keys causally (partial); query block 1 holds the padded queries 6, 7, which see only their own slot,
    # so no block of it is full (both committed ones and both block-key ones partial)
    assert full[1, 0].tolist() == [2, 0] and partial[1, 0].tolist() == [1, 4]


# --- properties of the dense reference ---------------------------------------------------------------------------

@SETTINGS
@given(layouts())
def test_dense_mask_properties(c):
    mask = _dense(c)
    T, S, W, kind = c["T"], c["S"], c["W"], c["kind"]
    assert mask.shape == (len(c["lengths_B"]), T, S + T)
    assert mask.any(-1).all(), "every query row sees at least one key"
    for b, (L, n, causal) in enumerate(zip(c["lengths_B"].tolist(), c["n_new_B"].tolist(), c["causal_B"].tolist())):
        k_pos = torch.cat([torch.arange(S), L + torch.arange(T)])
        real_key = torch.cat([torch.arange(S) < L, torch.arange(T) < n])
        for i in range(T):
            row = mask[b, i]
            if i >= n:  # padded query: exactly its own block slot
                assert row.nonzero().flatten().tolist() == [S + i]
                continue
            q_pos = L + i
            vis_pos = k_pos[row]
            assert not (row & ~real_key).any(), "padded keys never visible to real queries"
            committed, block = int(row[:S].sum()), int(row[S:].sum())
            if causal:
                assert (vis_pos <= q_pos).all(), "causal rows never see a later key"
                expected = q_pos + 1 if W is None else min(q_pos + 1, W)  # anchored causal window, either kind
                assert committed + block == expected
                assert set(vis_pos.tolist()) == set(range(q_pos + 1 - expected, q_pos + 1))
            elif W is None:
                assert (committed, block) == (L, n)
            elif kind == "anchored":  # the same last W-1 committed tokens + the whole canvas
                assert (committed, block) == (min(L, W - 1), n)
                assert row[:S].nonzero().flatten().tolist() == list(range(max(0, L - (W - 1)), L))
            else:  # symmetric: |q_pos - k_pos| <= W over the real keys
                assert committed == max(0, L - max(0, q_pos - W))
                assert block == min(n - 1, i + W) - max(0, i - W) + 1
                assert committed + block <= 2 * W + 1
                assert ((vis_pos - q_pos).abs() <= W).all()


def test_symmetric_and_anchored_differ_on_long_context():
    """A denoise row with 40 committed tokens and W=4: anchored gives every canvas query the same last W-1=3
    committed tokens; symmetric's committed keys slide with the query (|q_pos - k_pos| <= 4) and run out."""
    L, n, T, S, W = 40, 8, 8, 64, 4
    args = (torch.tensor([L]), torch.tensor([n]), torch.tensor([False]))
    anchored = dense_block_mask(*args, block_len=T, cache_slots=S, sliding_window=W, window_kind="anchored")[0]
    symmetric = dense_block_mask(*args, block_len=T, cache_slots=S, sliding_window=W, window_kind="symmetric")[0]
    for i in range(T):
        assert anchored[i, :S].nonzero().flatten().tolist() == [37, 38, 39]
        assert anchored[i, S:].all()  # the whole canvas
        assert symmetric[i, :S].nonzero().flatten().tolist() == list(range(L + i - W, L))  # empty from i = 4 on
        assert symmetric[i, S:].nonzero().flatten().tolist() == list(range(max(0, i - W), min(T, i + W + 1)))
    assert symmetric[0, :S].sum() == 4 and symmetric[3, :S].sum() == 1 and symmetric[4, :S].sum() == 0


# --- FlexAttention vs dense attention ----------------------------------------------------------------------------

def _random_state(B, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, S + 1, (B,), generator=g)
    n_new = torch.randint(0, T + 1, (B,), generator=g)
    causal = torch.randint(0, 2, (B,), generator=g).bool()
    # make sure the mix has an encoder row, a denoise row, a full block, an empty context and a full cache
    causal[0], lengths[0], n_new[0] = True, 0, T
    if B > 1:
        causal[1], lengths[1] = False, S
    return lengths, n_new, causal


def _qkv(B, H, Hkv, T, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, S + T, D, generator=g),
            torch.randn(B, Hkv, S + T, D, generator=g))


def _assert_blocks_cover(bm, dense_BTS):
    """Every visible (b, q, kv) lies in a block the BlockMask computes (partial or full)."""
    qb, kb = bm.BLOCK_SIZE
    blocks = bm.to_dense().bool()[:, 0]  # [B, q blocks, kv blocks]
    b, i, kv = dense_BTS.nonzero(as_tuple=True)
    assert blocks[b, i // qb, kv // kb].all()


def _check_against_dense(out, q, k, v, dense, n_new):
    ref = dense_attention(q, k, v, dense)
    real_q = (torch.arange(q.shape[2])[None, :] < n_new[:, None])[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real_q], ref[real_q], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("B, H, Hkv, T, S, D, W, kind, block_size", [
    (2, 2, 2, 16, 32, 16, None, "anchored", 128),   # full-attention layer, MHA
    (3, 4, 2, 8, 64, 16, 16, "anchored", 128),      # GQA, decode-shaped canvas against 64 slots
    (3, 4, 2, 8, 64, 16, 4, "symmetric", 16),       # small BLOCK_SIZE, T not a multiple of it
    (4, 4, 1, 5, 37, 8, 7, "anchored", (8, 16)),    # odd sizes, MQA, rectangular block size
    (2, 8, 2, 32, 96, 32, 24, "symmetric", 128),    # prefill-like chunk, S+T = 128
])
def test_flex_eager_matches_dense_attention(B, H, Hkv, T, S, D, W, kind, block_size):
    for seed in range(3):
        lengths, n_new, causal = _random_state(B, T, S, seed)
        mm = block_mask_mod(lengths, n_new, causal, cache_slots=S, sliding_window=W, window_kind=kind)
        bm = make_block_mask(mm, B, T, S, "cpu", block_size=block_size)
        assert bm.shape == (B, 1, T, S + T)
        dense = dense_block_mask(lengths, n_new, causal, block_len=T, cache_slots=S, sliding_window=W,
                                 window_kind=kind)
        _assert_blocks_cover(bm, dense)
        q, k, v = _qkv(B, H, Hkv, T, S, D, seed)
        with torch.no_grad():
            _check_against_dense(flex_block_attention(q, k, v, bm), q, k, v, dense, n_new)


# One compiled shape for the whole session (first compile ~20 s on CPU): GQA, a 16-token canvas. (8 query tokens of
# head dim 16 hit an Inductor CPU bug on AVX2-only hosts, not on every run: docs/testing.md, 2026-12-07.)
CB, CH, CHKV, CT, CS, CD, CW = 3, 4, 2, 16, 64, 16, 16


@functools.cache
def _compiled_attention():
    return torch.compile(flex_block_attention, fullgraph=True, dynamic=False)


def _compiled_call(lengths, n_new, causal, q, k, v):
    mm = block_mask_mod(lengths, n_new, causal, cache_slots=CS, sliding_window=CW)
    bm = make_block_mask(mm, CB, CT, CS, "cpu")
    with torch.no_grad():
        return _compiled_attention()(q, k, v, bm)


def _dense_c(lengths, n_new, causal):
    return dense_block_mask(lengths, n_new, causal, block_len=CT, cache_slots=CS, sliding_window=CW)
@pytest.mark.slow
def test_flex_compiled_matches_dense_attention():
    q, k, v = _qkv(CB, CH, CHKV, CT, CS, CD, seed=0)
    for seed in range(3):
        lengths, n_new, causal = _random_state(CB, CT, CS, seed)
        out = _compiled_call(lengths, n_new, causal, q, k, v)
        _check_against_dense(out, q, k, v, _dense_c(lengths, n_new, causal), n_new)
@pytest.mark.slow
def test_flex_compiled_does_not_recompile_on_new_row_state():
    q, k, v = _qkv(CB, CH, CHKV, CT, CS, CD, seed=1)
    lengths, n_new, causal = _random_state(CB, CT, CS, seed=0)
    _compiled_call(lengths, n_new, causal, q, k, v)  # warm-up (a cache hit when the test above ran)
    with torch.compiler.set_stance("fail_on_recompile"):
        # new tensor objects, new mask_mod closure, new BlockMask
        for seed in (5, 6):
            lengths, n_new, causal = _random_state(CB, CT, CS, seed)
            lengths, n_new, causal = lengths.flip(0), n_new.flip(0), causal.flip(0)
            out = _compiled_call(lengths, n_new, causal, q, k, v)
            _check_against_dense(out, q, k, v, _dense_c(lengths, n_new, causal), n_new)
        # the same tensors updated in place, one mask_mod, BlockMask rebuilt
        lengths, n_new, causal = _random_state(CB, CT, CS, seed=7)
        mm = block_mask_mod(lengths, n_new, causal, cache_slots=CS, sliding_window=CW)
        for new in ((torch.tensor([10, 64, 0]), torch.tensor([1, 8, 0]), torch.tensor([False, True, False])),
                    (torch.tensor([63, 2, 33]), torch.tensor([8, 3, 7]), torch.tensor([True, True, False]))):
            for t, x in zip((lengths, n_new, causal), new):
                t.copy_(x)
            bm = make_block_mask(mm, CB, CT, CS, "cpu")
            with torch.no_grad():
                out = _compiled_attention()(q, k, v, bm)
            _check_against_dense(out, q, k, v, _dense_c(lengths, n_new, causal), n_new)
