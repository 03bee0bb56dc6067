"""The encoder's image-group overlay (`masks.image_group_mask_mod`, `block_mask_mod(groups_BT=...)`) against its dense
reference, against transformers' own mask functions (causal / sliding causal OR `blockwise_overlay`), and its
properties under per-row causality and both window kinds.

Legend: B batch, T block length, S committed slots.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from dgemma_compile.model.masks import (
    WINDOW_KINDS,
    block_mask_mod,
    dense_block_mask,
    dense_image_group_mask,
    flex_block_attention,
    image_group_mask_mod,
    make_block_mask,
)
from dgemma_compile.model.backbone import dense_attention
from helpers import assert_sparsity_of_create_block_mask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])


def runs_to_groups(runs: list[tuple[int, int]], T: int) -> list[int]:
    """Group ids [T] from (start, length) runs, numbered in order, -1 elsewhere."""
    g = [-1] * T
    for k, (start, n) in enumerate(runs):
        for i in range(start, min(start + n, T)):
            g[i] = k
    return g


@st.composite
def group_rows(draw, T: int) -> list[int]:
    """One row's group ids: contiguous runs of image tokens separated by text (as the processor writes them)."""
    g, i, k = [-1] * T, 0, 0
    while i < T:
        i += draw(st.integers(0, 3))  # text before the run
        n = draw(st.integers(0, 6))
        for j in range(i, min(i + n, T)):
            g[j] = k
        k, i = k + 1, i + n + 1  # runs never touch (boi / eoi between them)
    return g


@st.composite
def layouts(draw, max_B=3, max_T=12, max_S=24):
    B = draw(st.integers(1, max_B))
    T = draw(st.integers(1, max_T))
    S = draw(st.integers(0, max_S))
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    n_new = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    causal = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    groups = [draw(group_rows(T)) for _ in range(B)]
    # the contract: padded tokens carry -1 (the forward's builder writes them so); the masks do not rely on it
    if draw(st.booleans()):
        groups = [[g if i < n else -1 for i, g in enumerate(row)] for row, n in zip(groups, n_new)]
    W = draw(st.none() | st.integers(1, S + T + 2))
    kind = draw(st.sampled_from(WINDOW_KINDS))
    return dict(lengths_B=torch.tensor(lengths), n_new_B=torch.tensor(n_new), causal_B=torch.tensor(causal),
                groups_BT=torch.tensor(groups, dtype=torch.long).view(B, T), T=T, S=S, W=W, kind=kind)


def _dense(c, groups=True):
    return dense_block_mask(c["lengths_B"], c["n_new_B"], c["causal_B"], block_len=c["T"], cache_slots=c["S"],
                            sliding_window=c["W"], window_kind=c["kind"], groups_BT=c["groups_BT"] if groups else None)


def _flex(c, mask_mod):
    B, T, S = c["groups_BT"].shape[0], c["T"], c["S"]
    return create_mask(mask_mod, B, None, T, S + T, device="cpu")[:, 0]


@settings(SETTINGS, max_examples=25)
@given(c=layouts())
def test_mask_mod_with_groups_matches_dense(c):
    mm = block_mask_mod(c["lengths_B"], c["n_new_B"], c["causal_B"], cache_slots=c["S"], sliding_window=c["W"],
                        window_kind=c["kind"], groups_BT=c["groups_BT"])
    assert mm.__name__.endswith("_mixed_groups")
    assert torch.equal(_flex(c, mm), _dense(c))
    overlay = image_group_mask_mod(c["groups_BT"], cache_slots=c["S"])
    assert torch.equal(_flex(c, overlay), dense_image_group_mask(c["groups_BT"], cache_slots=c["S"]))


@settings(SETTINGS, max_examples=25)
@given(c=layouts(), block_size=st.sampled_from([(4, 4), (8, 4)]))
def test_block_sparsity_with_groups_equals_create_block_mask(c, block_size):
    """`masks.block_sparsity` (the compiled step's in-place sparsity) on masks with image groups."""
    mm = block_mask_mod(c["lengths_B"], c["n_new_B"], c["causal_B"], cache_slots=c["S"], sliding_window=c["W"],
                        window_kind=c["kind"], groups_BT=c["groups_BT"])
    assert_sparsity_of_create_block_mask(mm, c["groups_BT"].shape[0], c["T"], c["S"] + c["T"], block_size)


@SETTINGS
@given(c=layouts())
def test_overlay_properties(c):
    """Encoder rows: exactly the text mask plus every real block key of the query's own group (later ones and ones
    beyond the window included); denoise rows and padded queries: unchanged; all -1 groups: the text mask."""
    with_groups, without = _dense(c), _dense(c, groups=False)
    S, T = c["S"], c["T"]
    assert bool((with_groups >= without).all())  # a superset
    g = c["groups_BT"]
    for b in range(g.shape[0]):
        n = int(c["n_new_B"][b])
        if not bool(c["causal_B"][b]):
            assert torch.equal(with_groups[b], without[b])
            continue
        for i in range(T):
            for kv in range(S + T):
                j = kv - S
                same = kv >= S and i < n and j < n and int(g[b, i]) >= 0 and int(g[b, i]) == int(g[b, j])
                assert bool(with_groups[b, i, kv]) == (bool(without[b, i, kv]) or same)
    none = dict(c, groups_BT=torch.full_like(g, -1))
    assert torch.equal(_dense(none), without)


@settings(SETTINGS, max_examples=12)
@given(L=st.integers(0, 10), T=st.integers(1, 14), W=st.none() | st.integers(1, 8), data=st.data())
def test_encoder_rows_match_transformers_mask_functions(L, T, W, data):
    """An encoder row of L committed tokens and T real new ones equals transformers' encoder mask over absolute
    positions: causal (or sliding-window causal) OR `blockwise_overlay(block_sequence_ids)`, what
    `create_masks_for_generate(..., block_sequence_ids=get_block_sequence_ids_for_mask(mm_token_type_ids))` builds
    for every layer type of DiffusionGemma's encoder. Both window kinds: the encoder's window is the same."""
    from transformers.masking_utils import (blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_causal_mask_function)
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import get_block_sequence_ids_for_mask

    S = L + data.draw(st.integers(0, 4))
    groups = data.draw(group_rows(T))
    # transformers' ids: mm_token_type_ids over the whole sequence (committed text, then the block)
    types = torch.tensor([[0] * L + [1 if x >= 0 else 0 for x in groups]])
    ids = get_block_sequence_ids_for_mask(types, torch.device("cpu"))
    base = causal_mask_function if W is None else sliding_window_causal_mask_function(W)
    fn = or_masks(base, blockwise_overlay(ids))
    kv = torch.arange(S + T)
    unused = (kv < S) & (kv >= L)  # committed slots the row does not hold
    k_pos = torch.where(kv < S, kv, L + kv - S).masked_fill(unused, 0)
    q_pos = L + torch.arange(T)
    expected = fn(torch.tensor(0), None, q_pos[:, None], k_pos[None, :]) & ~unused[None, :]
    # our group ids are block-local and need only to be equal within a run: renumber them from the absolute ones
    ours_groups = torch.where(torch.tensor(groups) >= 0, ids[0, L:], -1).view(1, T)
    for kind in WINDOW_KINDS:
        args = dict(lengths_B=torch.tensor([L]), n_new_B=torch.tensor([T]), causal_B=torch.tensor([True]))
        dense = dense_block_mask(**args, block_len=T, cache_slots=S, sliding_window=W, window_kind=kind,
                                 groups_BT=ours_groups)
        assert torch.equal(dense[0], expected), kind
        mm = block_mask_mod(*args.values(), cache_slots=S, sliding_window=W, window_kind=kind, groups_BT=ours_groups)
        assert torch.equal(create_mask(mm, 1, None, T, S + T, device="cpu")[0, 0], expected), kind


def test_static_causal_and_rejects_bad_groups():
    lengths, n_new = torch.tensor([3, 0]), torch.tensor([5, 4])
    groups = torch.tensor([[-1, 0, 0, 0, -1], [1, 1, -1, -1, -1]])
    c = dict(lengths_B=lengths, n_new_B=n_new, groups_BT=groups, T=5, S=6, W=2, kind="anchored")
    mm = block_mask_mod(lengths, n_new, True, cache_slots=6, sliding_window=2, groups_BT=groups)
    assert mm.__name__ == "block_mask_S6_W2_anchored_causal_groups"
    assert torch.equal(_flex(c, mm), _dense(dict(c, causal_B=True)))
    # a denoise pass ignores groups: the mask is the text one
    bidir = block_mask_mod(lengths, None, False, cache_slots=6, sliding_window=2, groups_BT=groups)
    plain = block_mask_mod(lengths, None, False, cache_slots=6, sliding_window=2)
    assert torch.equal(_flex(c, bidir), _flex(c, plain))
    # group 0 of row 0 spans block tokens 1..3: token 1 sees token 3 (later, and past the causal window of 2)
    assert bool(_dense(dict(c, causal_B=True))[0, 1, 6 + 3])
    for bad, match in ((groups.int(), "groups_BT must be an int64"), (groups[:1], r"\[B=2"),
                       (groups[:, :, None], "groups_BT must be")):
        with pytest.raises(ValueError, match=match):
            block_mask_mod(lengths, n_new, True, cache_slots=6, groups_BT=bad)
    with pytest.raises(ValueError, match=r"T=5"):
        dense_block_mask(lengths, n_new, True, block_len=5, cache_slots=6, groups_BT=groups[:, :4])


def test_flex_attention_with_groups_matches_dense_attention():
    """FlexAttention under the grouped block mask equals softmax attention under the dense one (float32)."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, S, D = 2, 4, 2, 12, 20, 8
    lengths, n_new = torch.tensor([5, 0]), torch.tensor([12, 9])
    groups = torch.tensor([runs_to_groups([(1, 6)], T), runs_to_groups([(0, 3), (4, 4)], T)])
    causal = torch.tensor([True, True])
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S + T, D, generator=g), torch.randn(B, Hkv, S + T, D, generator=g)
    for W in (None, 3):
        dense = dense_block_mask(lengths, n_new, causal, block_len=T, cache_slots=S, sliding_window=W,
                                 groups_BT=groups)
        mm = block_mask_mod(lengths, n_new, causal, cache_slots=S, sliding_window=W, groups_BT=groups)
        out = flex_block_attention(q, k, v, make_block_mask(mm, B, T, S, "cpu"))
        ref = dense_attention(q, k, v, dense)
        assert (out - ref).abs().max() < 1e-5
