"""Per-row modes in one forward (`plan.py`, `DiffusionGemma.forward_plan`): a batch mixing a prefill chunk, a denoise
row with self-conditioning, one without, a commit and an idle row gives, row by row, the outputs (logits of denoise
rows, final hidden states of the encoder rows' real tokens) and the cache contents (committed slots, lengths) of
separate single-row calls, eager and compiled, FlexAttention and dense masks (float32, <= 1e-5)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import dgemma_compile as dg
from dgemma_compile.model.masks import dense_block_mask, dense_commit_denoise_mask
from dgemma_compile.model.plan import COMMIT_DENOISER, DENOISER, ENCODER, IDLE, PlanBuffers, build_plan, every_row
from dgemma_compile.model.forwards import commit_denoise_block, denoise_block, encode_block

S = 48  # committed slots per row
# (mode, tokens committed before the forward, real tokens of an encoder row, self-conditioned)
ROWS = [(ENCODER, 0, 5, False),   # a prefill chunk (shorter than the block)
        (DENOISER, 21, 0, True),   # a denoise step with the previous step's logits
        (DENOISER, 9, 0, False),   # a block's first denoise step
        (ENCODER, 30, 8, False),  # a commit (a whole block)
        (IDLE, 5, 0, False)]      # a row with nothing to do


def _setup(model, seed=0):
    """A cache of len(ROWS) rows holding each row's prior context (random ids encoded in one batched call), the
    block's ids [B, T], self-conditioning logits [B, T, V] and the plan inputs."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = len(ROWS), model.config.canvas_length, model.config.vocab_size
    before = torch.tensor([r[1] for r in ROWS])
    cache = model.new_cache(B, S)
    dg.encode(model, torch.randint(3, V, (B, int(before.max())), generator=g), cache, input_lengths=before)
    ids = torch.randint(3, V, (B, T), generator=g)
    sc_logits = torch.randn(B, T, V, generator=g) * 3
    mode = torch.tensor([r[0] for r in ROWS])
    n_new = torch.tensor([r[2] for r in ROWS])
    sc = torch.tensor([r[3] for r in ROWS])
    return cache, ids, sc_logits, mode, n_new, sc


def _row_cache(cache, r):
    """Row r of `cache` as a cache of its own (copies)."""
    return type(cache)(keys=[k[r:r + 1].clone() for k in cache.keys], values=[v[r:r + 1].clone() for v in cache.values],
                       lengths=cache.lengths[r:r + 1].clone(), max_seq_len=cache.max_seq_len,
                       block_size=cache.block_size)


def _separately(model, cache, ids, sc_logits, moe_impl):
    """Per row: (output, cache after) from its own single-row call (None output for the idle row)."""
    out = []
    for r, (mode, _, n, with_sc) in enumerate(ROWS):
        c = _row_cache(cache, r)
        if mode == ENCODER:
            y = encode_block(model, ids[r:r + 1], c, torch.tensor([n]), moe_impl=moe_impl)[0, :n]
        elif mode == DENOISER:
            y = denoise_block(model, ids[r:r + 1], c, sc_logits[r:r + 1] if with_sc else None,
                                    moe_impl=moe_impl)[0]
        else:
            y = None
        out.append((y, c))
    return out


def _soft(model, sc_logits):
    """The self-conditioning signal `forward_plan` takes: the soft embedding of softmax(logits) [B, T, D]."""
    return model.self_conditioning_embedding(torch.softmax(sc_logits, dim=-1, dtype=torch.float32))


def _check(model, mixed_hidden, mixed_cache, expected):
    for r, ((mode, _, n, _), (y, c)) in enumerate(zip(ROWS, expected)):
        if mode == ENCODER:
            torch.testing.assert_close(mixed_hidden[r, :n], y, atol=1e-5, rtol=1e-5, msg=f"row {r} hidden")
        elif mode == DENOISER:
            torch.testing.assert_close(model.logits(mixed_hidden[r:r + 1])[0], y, atol=1e-5, rtol=1e-5,
                                       msg=f"row {r} logits")
        assert mixed_cache.lengths[r] == c.lengths[0], f"row {r} length"
        for layer, (k, v) in enumerate(zip(mixed_cache.keys, mixed_cache.values)):
            torch.testing.assert_close(k[r, :, :S], c.keys[layer][0, :, :S], atol=1e-5, rtol=1e-5,
                                       msg=f"row {r} layer {layer} keys")
            torch.testing.assert_close(v[r, :, :S], c.values[layer][0, :, :S], atol=1e-5, rtol=1e-5,
                                       msg=f"row {r} layer {layer} values")


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["flex", "dense"])
def test_mixed_rows_equal_separate_calls_eagerly(tiny_dir, attention):
    model = dg.load(tiny_dir, attention=attention)
    cache, ids, sc_logits, mode, n_new, sc = _setup(model)
    expected = _separately(model, cache, ids, sc_logits, "loop")
    before = [(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values)]
    with torch.no_grad():
        plan = build_plan(model, cache, ids.shape[1], mode=mode, n_new=n_new, self_conditioning=sc)
        hidden = model.forward_plan(ids, cache, plan, _soft(model, sc_logits), moe_impl="loop")
    _check(model, hidden, cache, expected)
    assert cache.lengths.tolist() == [r[1] + (r[2] if r[0] == ENCODER else 0) for r in ROWS]
    idle = [r for r, row in enumerate(ROWS) if row[0] == IDLE][0]
    for (k, v), (k0, v0) in zip(zip(cache.keys, cache.values), before):  # the idle row's committed slots: untouched
        assert torch.equal(k[idle, :, :S], k0[idle, :, :S]) and torch.equal(v[idle, :, :S], v0[idle, :, :S])


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["flex", "dense"])
def test_mixed_rows_equal_separate_calls_compiled(tiny_dir, attention):
    """The mixed plan built by a compiled builder into preallocated tensors (`PlanBuffers(mixed=True)`, BlockMask
    included), then the mixed forward compiled over them (graph inputs), experts `gathered` as the compiled
    generator runs them on float32, against eager single-row calls with the loop."""
    model = dg.load(tiny_dir, attention=attention)
    cache, ids, sc_logits, mode, n_new, sc = _setup(model, seed=1)
    expected = _separately(model, cache, ids, sc_logits, "loop")
    buffers = PlanBuffers(model, cache, ids.shape[1], mixed=True)
    with torch.no_grad():
        torch.compile(lambda: buffers.fill(mode, n_new, sc), fullgraph=True, dynamic=False)()
        soft = _soft(model, sc_logits)
        step = torch.compile(lambda: model.forward_plan(ids, cache, buffers.plan, soft, moe_impl="gathered"),
                             fullgraph=True, dynamic=False)
        hidden = step()
    _check(model, hidden, cache, expected)


@pytest.mark.parametrize("kw,msg", [(dict(mode="encoder"), "mode must be an int64 tensor"),
                                    (dict(mode=torch.tensor([1, 2])), r"mode must be an int64 tensor \[B=5\]"),
                                    (dict(mode=torch.ones(5, dtype=torch.long), n_new=torch.ones(3, dtype=torch.long)),
                                     r"n_new must be \[B=5\]"),
                                    (dict(mode=torch.ones(5, dtype=torch.long)), "n_new: required"),
                                    (dict(mode=torch.full((5,), 2), self_conditioning=torch.ones(5, dtype=torch.long)),
                                     "self_conditioning must be bool"),
                                    (dict(mode=torch.full((5,), 3)), r"COMMIT_DENOISER \(3\) only in a fused plan"),
                                    (dict(mode=torch.full((5,), 4), n_new=torch.ones(5, dtype=torch.long), canvas=8,
                                          T=16), "per-row modes are IDLE"),
                                    (dict(mode=torch.full((5,), 3), canvas=8, T=16), "n_new: required for encoder"),
                                    (dict(mode=torch.full((5,), 2), canvas=5), "canvas: a plan's canvas is T or T / 2"),
                                    (dict(mode=torch.full((5,), -1)), "per-row modes are IDLE, ENCODER, DENOISER"),
                                    (dict(mode=torch.full((5,), 2), groups=torch.zeros(5, 16, dtype=torch.long),
                                          canvas=8, T=16), "groups: .* not fused"),
                                    (dict(mode=torch.full((5,), 1), groups=torch.zeros(5, 3, dtype=torch.long),
                                          n_new=torch.ones(5, dtype=torch.long)), r"groups: an int64 tensor \[B=5, T=\d+\]"),
                                    (dict(mode=torch.full((5,), 3), n_new=torch.ones(5, dtype=torch.long), canvas=3,
                                          T=7), "canvas: a plan's canvas is T or T / 2")])
def test_bad_plans_are_refused(tiny_dir, kw, msg):
    model = dg.load(tiny_dir)
    T = kw.pop("T", model.config.canvas_length)
    with pytest.raises(ValueError, match=msg):
        build_plan(model, model.new_cache(5, S, block_size=2 * model.config.canvas_length), T, **kw)


def test_reset_cache_leaves_nothing_of_a_previous_request(tiny_dir):
    """kv_cache.py's invariant, eagerly: NaN written into the unused committed slots of a cache makes a denoise pass
    NaN (masking alone does not protect: 0 x NaN); after `reset()` the same encode + denoise equal a fresh cache's."""
    model = dg.load(tiny_dir)
    V, C = model.config.vocab_size, model.config.canvas_length
    g = torch.Generator().manual_seed(2)
    prompt, canvas = torch.randint(3, V, (1, 13), generator=g), torch.randint(3, V, (1, C), generator=g)

    def run(cache):
        dg.encode(model, prompt, cache)
        return dg.denoise(model, canvas, cache)

    fresh = run(model.new_cache(1, S))
    cache = model.new_cache(1, S)
    dg.encode(model, prompt, cache)
    for t in (*cache.keys, *cache.values):
        t[:, :, 13:S] = float("nan")
    assert dg.denoise(model, canvas, cache).isnan().all()
    cache.reset()
    assert torch.equal(run(cache), fresh)


# --- commit fusion: a block's commit and the next block's first denoise step in one forward ----------------------

def _commit_setup(model, seed):
    """Rows with different committed contexts (one past the sliding window), each committing a whole block but one
    (a finished row: n_new 0), plus the next block's canvas."""
    g = torch.Generator().manual_seed(seed)
    V, C = model.config.vocab_size, model.config.canvas_length
    before = torch.tensor([0, 7, 19, 30])
    n_new = torch.tensor([C, C, 0, C])
    cache = model.new_cache(len(before), S, block_size=2 * C)
    dg.encode(model, torch.randint(3, V, (len(before), int(before.max())), generator=g), cache, input_lengths=before)
    return cache, torch.randint(3, V, (len(before), C), generator=g), torch.randint(3, V, (len(before), C), generator=g), n_new


def _unfused(model, cache, ids, canvas, n_new, moe_impl):
    """The commit, then the denoise step, as two forwards (on a copy of the cache): (logits, cache after)."""
    c = type(cache)(keys=[k.clone() for k in cache.keys], values=[v.clone() for v in cache.values],
                    lengths=cache.lengths.clone(), max_seq_len=cache.max_seq_len, block_size=cache.block_size)
    encode_block(model, ids, c, n_new, moe_impl=moe_impl)
    return denoise_block(model, canvas, c, None, moe_impl=moe_impl), c


def _check_fused(logits, cache, expected_logits, expected_cache):
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)
    assert torch.equal(cache.lengths, expected_cache.lengths)
    for k, v, k1, v1 in zip(cache.keys, cache.values, expected_cache.keys, expected_cache.values):
        torch.testing.assert_close(k[:, :, :S], k1[:, :, :S], atol=1e-5, rtol=0)
        torch.testing.assert_close(v[:, :, :S], v1[:, :, :S], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention,window_kind", [  # one case in the fast tier
    ("flex", "anchored"), pytest.param("flex", "symmetric", marks=pytest.mark.slow),
    pytest.param("dense", "anchored", marks=pytest.mark.slow), pytest.param("dense", "symmetric", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_commit_fusion_equals_commit_then_denoise_eagerly(tiny_dir, attention, window_kind):
    """Logits of the fused forward within 1e-5 (float32) of the unfused commit + denoise step; the same committed
    keys/values and lengths."""
    model = dg.load(tiny_dir, attention=attention, window_kind=window_kind)
    cache, ids, canvas, n_new = _commit_setup(model, seed=3)
    expected = _unfused(model, cache, ids, canvas, n_new, "loop")
    with torch.no_grad():
        logits = commit_denoise_block(model, ids, canvas, cache, n_new, moe_impl="loop")
    _check_fused(logits, cache, *expected)


@pytest.mark.slow
def test_commit_fusion_equals_commit_then_denoise_compiled(tiny_dir):
    """The fused forward compiled over a commit + denoise plan built outside the graph (its per-row tensors graph
    inputs, as `PlanBuffers` gives a step: Inductor's CPU flex template refuses mask tensors computed in the graph)."""
    model = dg.load(tiny_dir)
    cache, ids, canvas, n_new = _commit_setup(model, seed=4)
    expected = _unfused(model, cache, ids, canvas, n_new, "loop")
    C = canvas.shape[1]
    with torch.no_grad():
        plan = build_plan(model, cache, 2 * C, mode=every_row(cache, COMMIT_DENOISER), n_new=n_new, canvas=C)
        both = torch.cat([ids, canvas], dim=1)
        step = torch.compile(lambda: model.logits(model.forward_plan(both, cache, plan, moe_impl="gathered")[:, C:]),
                             fullgraph=True, dynamic=False)
        logits = step()
    _check_fused(logits, cache, *expected)


def test_commit_fusion_needs_two_blocks_of_cache_slots(tiny_dir):
    model = dg.load(tiny_dir)
    C = model.config.canvas_length
    ids = torch.zeros(1, C, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size >= 2C"):
        commit_denoise_block(model, ids, ids, model.new_cache(1, S), torch.tensor([C]))


# --- the block's denoise plan in static buffers, built once per block --------------------------------------------

@pytest.mark.parametrize("attention", ["flex", "dense"])
def test_plan_buffers_hold_the_plan_of_the_current_lengths(tiny_dir, attention):
    """`PlanBuffers.fill` rebuilds the denoise plan for the cache's lengths into the same tensors (no new ones), and
    a denoise pass over the filled plan equals one that builds its own plan, bitwise."""
    model = dg.load(tiny_dir, attention=attention)
    V, C = model.config.vocab_size, model.config.canvas_length
    g = torch.Generator().manual_seed(5)
    cache = model.new_cache(3, S)
    plan = PlanBuffers(model, cache, C)
    ids = [t.data_ptr() for t in plan.tensors]
    canvas = torch.randint(3, V, (3, C), generator=g)
    for lengths in ([4, 19, 0], [11, 3, 30]):
        cache.reset()
        dg.encode(model, torch.randint(3, V, (3, max(lengths)), generator=g), cache, input_lengths=torch.tensor(lengths))
        plan.fill()
        fresh = build_plan(model, cache, C, mode=every_row(cache, DENOISER))
        assert torch.equal(plan.plan.positions, fresh.positions)
        with torch.no_grad():
            assert torch.equal(denoise_block(model, canvas, cache, None, plan=plan.plan),
                               denoise_block(model, canvas, cache, None))
    assert [t.data_ptr() for t in plan.tensors] == ids, "filled in place"
    with pytest.raises(ValueError, match="mixed=True"):
        plan.fill(mode=torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("sparsity_in_place", [False, True])
def test_mixed_plan_buffers_equal_a_freshly_built_plan(tiny_dir, sparsity_in_place):
    """A mixed `PlanBuffers` filled with the ROWS mix gives the forward of `build_plan`'s plan, bitwise, and keeps
    its tensors; refilled with every row idle, then with the mix again, still the same. With `sparsity_in_place`
    (the masks' blocks from `masks.block_sparsity`, no create_block_mask) too, its masks' partial and full blocks
    equal the fresh plan's create_block_mask ones after every fill."""
    model = dg.load(tiny_dir)
    cache, ids, sc_logits, mode, n_new, sc = _setup(model, seed=6)
    buffers = PlanBuffers(model, cache, ids.shape[1], mixed=True, sparsity_in_place=sparsity_in_place)

    def assert_same_sparsity(fresh):
        if not sparsity_in_place:
            return
        for lt, mask in buffers.plan.masks.items():
            ref = fresh.masks[lt]
            assert torch.equal(mask.kv_num_blocks, ref.kv_num_blocks) and torch.equal(mask.kv_indices, ref.kv_indices)
            full = torch.zeros_like(ref.kv_num_blocks) if ref.full_kv_num_blocks is None else ref.full_kv_num_blocks
            assert torch.equal(mask.full_kv_num_blocks, full), lt
    ptrs = [t.data_ptr() for t in buffers.tensors]
    snapshot = lambda c: ([k.clone() for k in c.keys], [v.clone() for v in c.values], c.lengths.clone())  # noqa: E731

    def forward(plan):
        keys, values, lengths = snapshot(cache)
        with torch.no_grad():
            out = model.forward_plan(ids, cache, plan, _soft(model, sc_logits))
        for t, saved in zip((*cache.keys, *cache.values), (*keys, *values)):
            t.copy_(saved)
        cache.lengths.copy_(lengths)
        return out

    fresh = build_plan(model, cache, ids.shape[1], mode=mode, n_new=n_new, self_conditioning=sc)
    expected = forward(fresh)
    buffers.fill(mode, n_new, sc)
    assert_same_sparsity(fresh)
    assert torch.equal(forward(buffers.plan), expected)
    buffers.fill(torch.full_like(mode, IDLE))
    assert buffers.plan.commit.eq(0).all() and not buffers.plan.self_conditioning.any()
    assert_same_sparsity(build_plan(model, cache, ids.shape[1], mode=torch.full_like(mode, IDLE), n_new=n_new))
    buffers.fill(mode)
    assert_same_sparsity(fresh)
    assert torch.equal(forward(buffers.plan), expected)
    assert [t.data_ptr() for t in buffers.tensors] == ptrs


KERNELS = {"encoder": {"sliding_attention": {"BLOCK_M": 32}, "full_attention": {}},
           "canvas": {"sliding_attention": {"FORCE_USE_FLEX_ATTENTION": True},
                      "full_attention": {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": 64}}}


def test_kernel_options_reach_flex_attention_per_query_kind_and_layer_type(tiny_dir, monkeypatch):
    """Eagerly: each layer's `flex_attention` call gets its layer type's options of the plan's query kind."""
    from dgemma_compile.model import masks

    model = dg.load(tiny_dir)
    seen = []
    real = masks.flex_attention
    monkeypatch.setattr(masks, "flex_attention", lambda *a, **kw: seen.append(kw["kernel_options"]) or real(*a, **kw))
    cache = model.new_cache(1, S)
    C = model.config.canvas_length
    with torch.no_grad():
        encode_block(model, torch.randint(3, 40, (1, C)), cache, torch.tensor([4]), kernel_options=KERNELS)
        encoder, seen[:] = list(seen), []
        plan = PlanBuffers(model, cache, C, kernel_options=KERNELS)
        denoise_block(model, torch.randint(3, 40, (1, C)), cache, None, plan=plan.plan)
        canvas, seen[:] = list(seen), []
        denoise_block(model, torch.randint(3, 40, (1, C)), cache, None)  # no options: the kernels' defaults
    types = model.config.layer_types
    assert encoder == [KERNELS["encoder"][t] or None for t in types]
    assert canvas == [KERNELS["canvas"][t] for t in types]
    assert seen == [None] * len(types)


@pytest.mark.slow
def test_kernel_options_are_in_the_captured_graph(tiny_dir):
    """Compiled: the Dynamo graph's flex_attention calls carry the canvas options of their layer type (what Inductor's
    flex lowering reads to choose its kernel; CPU's template ignores them)."""
    from dgemma_compile.compile import CompileOptions

    model = dg.load(tiny_dir)
    C = model.config.canvas_length
    cache = model.new_cache(1, S)
    plan = PlanBuffers(model, cache, C, kernel_options=CompileOptions().attention_kernels())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    canvas = torch.randint(3, 40, (1, C))
    with torch.no_grad():
        torch.compile(lambda: denoise_block(model, canvas, cache, None, plan=plan.plan), backend=backend,
                      fullgraph=True)()
    (gm,) = graphs
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
    assert len(calls) == model.config.num_layers
    for node in calls:
        options = next(a for a in node.args if isinstance(a, dict))
        assert options.get("FORCE_USE_FLEX_ATTENTION") is True, options


# --- a fused mixed plan (T = 2C): the serving engine's commit fusion, row by row ------------------------------------
# (mode, tokens committed before the forward, committed tokens (encoder: real), self-conditioned)
FUSED_ROWS = [(ENCODER, 0, 5, False),          # a prefill chunk in the first half
              (DENOISER, 21, 0, True),          # a denoise step (canvas in the first half), self-conditioned
              (COMMIT_DENOISER, 9, None, False),  # a commit (n_new = C) and the next block's first step
              (DENOISER, 30, 0, False),         # a block's first denoise step (after its prompt)
              (IDLE, 5, 0, False)]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["flex", "dense"])
def test_fused_mixed_rows_equal_separate_calls_bitwise(tiny_dir, attention):
    """Each row of a fused mixed plan (`build_plan(..., canvas=C)`, T = 2C, moe "dense": row-invariant) gives
    bitwise what its own call gives in a cache of 2C block slots, as the fused generator makes them: a prefill chunk
    (`encode_block` at T = C; hidden states of its real tokens and the committed keys/values), a denoise step with
    and without self-conditioning (`denoise_block` at T = C: logits), a commit + denoise (`commit_denoise_block`:
    logits, committed keys/values); lengths advance by each row's committed tokens; the idle row's cache is
    untouched."""
    model = dg.load(tiny_dir, attention=attention)
    C, V = model.config.canvas_length, model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    B = len(FUSED_ROWS)
    before = torch.tensor([r[1] for r in FUSED_ROWS])
    n_new = torch.tensor([C if r[2] is None else r[2] for r in FUSED_ROWS])
    cache = model.new_cache(B, S, block_size=2 * C)
    dg.encode(model, torch.randint(3, V, (B, int(before.max())), generator=g), cache, input_lengths=before)
    first, second = torch.randint(3, V, (B, C), generator=g), torch.randint(3, V, (B, C), generator=g)
    sc_probs = torch.softmax(torch.randn(B, C, V, generator=g) * 3, dim=-1)
    mode = torch.tensor([r[0] for r in FUSED_ROWS])
    expected = []
    with torch.no_grad():
        for r, (m, _, _, with_sc) in enumerate(FUSED_ROWS):
            c = _row_cache(cache, r)
            if m == ENCODER:
                y = encode_block(model, first[r:r + 1], c, n_new[r:r + 1], moe_impl="dense")[0, :n_new[r]]
            elif m == DENOISER:
                y = denoise_block(model, first[r:r + 1], c, None, torch.tensor([with_sc]), moe_impl="dense",
                                        self_conditioning_embeds=model.self_conditioning_embedding(sc_probs[r:r + 1]))[0]
            elif m == COMMIT_DENOISER:
                y = commit_denoise_block(model, first[r:r + 1], second[r:r + 1], c, n_new[r:r + 1], moe_impl="dense")[0]
            else:
                y = None
            expected.append((y, c))
        before_kv = [(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values)]
        plan = build_plan(model, cache, 2 * C, mode=mode, n_new=n_new, canvas=C,
                          self_conditioning=torch.tensor([r[3] for r in FUSED_ROWS]))
        ids = torch.cat([first, torch.where((mode == COMMIT_DENOISER)[:, None], second, 0)], dim=1)
        hidden = model.forward_plan(ids, cache, plan, model.self_conditioning_embedding(sc_probs), moe_impl="dense")
    for r, ((m, _, _, _), (y, c)) in enumerate(zip(FUSED_ROWS, expected)):
        if m == ENCODER:
            assert torch.equal(hidden[r, :n_new[r]], y), f"row {r} hidden"
        elif m == DENOISER:
            assert torch.equal(model.logits(hidden[r:r + 1, :C])[0], y), f"row {r} logits"
        elif m == COMMIT_DENOISER:
            assert torch.equal(model.logits(hidden[r:r + 1, C:])[0], y), f"row {r} logits"
        assert cache.lengths[r] == c.lengths[0], f"row {r} length"
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
            assert torch.equal(k[r, :, :S], c.keys[layer][0, :, :S]), f"row {r} layer {layer} keys"
            assert torch.equal(v[r, :, :S], c.values[layer][0, :, :S]), f"row {r} layer {layer} values"
    assert cache.lengths.tolist() == (before + torch.where(mode == DENOISER, 0, n_new) * (mode != IDLE)).tolist()
    for (k, v), (k0, v0) in zip(zip(cache.keys, cache.values), before_kv):  # the idle row: untouched
        assert torch.equal(k[-1, :, :S], k0[-1, :, :S]) and torch.equal(v[-1, :, :S], v0[-1, :, :S])


@pytest.fixture(scope="module")
def tiny_flex_and_dense(tiny_dir):
    return dg.load(tiny_dir), dg.load(tiny_dir, attention="dense")


@settings(derandomize=True, deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow,
                                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fused_mixed_masks_are_the_unfused_passes_masks(tiny_flex_and_dense, data):
    """Property of a fused mixed plan's masks (T = 2C), flex (the block mask's mask_mod) equal to dense: a commit +
    denoise row's is `dense_commit_denoise_mask`'s; a denoise or encoder row's first C queries see exactly what the
    [C] pass of that row sees (`dense_block_mask` at T = C) and no key of the second half. Why a [2C] row computes
    bitwise what the [C] pass computes: the same visible keys, at the same slots."""
    flex, dense = tiny_flex_and_dense
    C = flex.config.canvas_length
    B = data.draw(st.integers(1, 5))
    mode = torch.tensor(data.draw(st.lists(st.sampled_from([IDLE, ENCODER, DENOISER, COMMIT_DENOISER]), min_size=B,
                                           max_size=B)))
    n_new = torch.tensor([data.draw(st.integers(0, C)) for _ in range(B)])
    lengths = torch.tensor([data.draw(st.integers(0, S - C)) for _ in range(B)])
    masks = {}
    for model in (flex, dense):
        cache = model.new_cache(B, S, block_size=2 * C)
        cache.lengths.copy_(lengths)
        masks[model.attention] = build_plan(model, cache, 2 * C, mode=mode, n_new=n_new, canvas=C).masks
    for lt, m in masks["flex"].items():
        window = dict(sliding_window=flex.config.sliding_window if lt == "sliding_attention" else None,
                      window_kind=flex.window_kind)
        got = create_mask(m.mask_mod, B, 1, 2 * C, S + 2 * C, device="cpu")[:, 0]
        assert torch.equal(got, masks["dense"][lt]), lt
        cd = dense_commit_denoise_mask(lengths, n_new, canvas=C, cache_slots=S, **window)
        for b in range(B):
            if mode[b] == COMMIT_DENOISER:
                assert torch.equal(got[b], cd[b]), (lt, b)
            elif mode[b] in (ENCODER, DENOISER):
                enc = bool(mode[b] == ENCODER)
                ref = dense_block_mask(lengths[b:b + 1], n_new[b:b + 1] if enc else torch.tensor([C]),
                                       torch.tensor([enc]), block_len=C, cache_slots=S, **window)[0]
                assert torch.equal(got[b, :C, :S + C], ref), (lt, b)
                assert not got[b, :C, S + C:].any(), (lt, b)


def test_every_plan_holds_tensors_per_row(tiny_dir):
    """One form (issue 38): a uniform pass's plan is every row one mode code, and each per-row field is a tensor of
    the rows' shape, as a mixed plan's; the model never dispatches on a field's type."""
    model = dg.load(tiny_dir)
    C = model.config.canvas_length
    cache = model.new_cache(3, S, block_size=2 * C)
    n_new = torch.tensor([2, 0, 5])
    for mode, T, canvas in ((ENCODER, C, None), (DENOISER, C, None), (COMMIT_DENOISER, 2 * C, C)):
        plan = build_plan(model, cache, T, mode=every_row(cache, mode), n_new=n_new, canvas=canvas)
        assert plan.mode.tolist() == [mode] * 3
        for name in ("real", "commit", "self_conditioning"):
            assert getattr(plan, name).shape == (3,), (mode, name)
        for name in ("encoder_tokens", "denoise_tokens"):
            t = getattr(plan, name)
            assert t.dtype == torch.bool and t.shape in ((3, 1), (3, T)), (mode, name)
        assert plan.slots.shape == (3, T) and plan.positions.shape == (3, T)
        assert plan.commit.tolist() == ([0, 0, 0] if mode == DENOISER else n_new.tolist())
