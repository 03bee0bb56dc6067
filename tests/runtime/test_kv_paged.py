"""Paged KV memory (`kv_cache.PagedKVCache`, `runtime/kv/pool.py`, `runtime/kv/prefix_cache.py`) and the engine over it.

Every check compares tokens against `dg.generate` of each request alone (static cache, eager, moe "dense"): paging,
prefix hits (prompt pages and committed blocks) and eviction change no numerics. Free pages are filled with NaN after
every engine iteration: a row that read one (even masked: 0 x NaN is NaN) would change its tokens. The engine tests
run the step eagerly over every batch size 1..B of their bucket (the engine steps at the smallest size holding its
busy rows), without and (slow) with commit fusion; the compiled bucket over a paged cache is
`test_compiled_paged_engine` (slow).
"""

from __future__ import annotations

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.model.kv_cache import ZERO_PAGE, new_paged_cache, paged_cache
from dgemma_compile.step.row_table import RowTable
from dgemma_runtime import Engine, Request, build_engine
from dgemma_runtime.kv.pool import OutOfPagesError, PagePool
from dgemma_runtime.kv.prefix_cache import PrefixCache
from dgemma_compile.inputs.text import encode_prompt

SLOTS = 256
P = 16  # page size = the demo's canvas (the encoder chunk)
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="
LONG = "rev 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 "  # 37 tokens with BOS: two full pages, then the request's own tail
FUSION = pytest.mark.parametrize("fuse", [pytest.param(False, id="separate"),
                                          pytest.param(True, id="fused", marks=pytest.mark.slow)])
"""Commits separate (the CPU default) and fused (rows of 2C tokens; tokens of `generate(fuse_commit=True)`)."""


def _ids(tok, model, text: str) -> list[int]:
    return encode_prompt(tok, text, bos_token_id=model.config.bos_token_id)


def _poison_free(engine: Engine) -> None:
    engine.row_table.cache.fill_pages(list(engine.memory.pool.free), float("nan"))


def _run(engine: Engine, *, poison: bool = True) -> None:
    """Iterate until idle, checking the pool's bookkeeping and NaN-filling the free pages after every iteration."""
    while not engine.idle():
        engine.step()
        engine.memory.pool.check()
        if poison:
            _poison_free(engine)


def _bucket(model, rows: int, kv_pages: int, fuse: bool = False) -> RowTable:
    """An eager bucket of `rows` rows stepping at every batch size 1..rows, over a pool of `kv_pages` pages."""
    return RowTable(model, range(1, rows + 1), max_seq_len=SLOTS, max_denoising_steps=64, page_size=P,
                  kv_pages=kv_pages, fuse_commit=fuse)


_SOLO: dict = {}  # solo runs by (prompt, config, seed, moe_impl): both bodies compare against the same run


def _solo(model, r: Request, moe_impl: str = "dense", fuse_commit: bool = False):
    key = (tuple(r.prompt), r.config, r.seed, moe_impl, fuse_commit)
    if key not in _SOLO:
        _SOLO[key] = dg.generate(model, [r.prompt], r.config, seed=r.seed, moe_impl=moe_impl, max_seq_len=SLOTS,
                                 fuse_commit=fuse_commit)
    return _SOLO[key]


def _assert_solo(model, reqs, fuse_commit: bool = False) -> None:
    for r in reqs:
        ref = _solo(model, r, fuse_commit=fuse_commit)
        assert r.sequence == ref.sequences[0], r.prompt
        assert r.stats.steps_per_block == ref.stats[0].steps_per_block
        assert r.stats.finish_reason == ref.stats[0].finish_reason


def test_page_pool_lru():
    """Reference counts, the cached state and LRU eviction on a pool of 4 pages (no model): a released registered page
    is kept until the pool needs it, the least recently released goes first, a cached page a row maps again is
    retained before the row's own pages are allocated (never evicted for them), a failed allocation changes nothing,
    and every page handed out is zeroed."""
    cache = new_paged_cache(batch_size=2, max_seq_len=64, block_size=16, page_size=16, pool_pages=4,
                            layer_shapes=[(1, 2)], dtype=torch.float32, device="cpu")
    pool = PagePool(cache)
    prefix = PrefixCache(pool)
    a, b, c, d = range(cache.first_pool_page, cache.num_pages)
    keys = prefix.chain(list(range(64)), 4)
    assert pool.assign_row(0, [], 3) == [a, b, c]
    cache.fill_pages([a, b, c, d], float("nan"))
    prefix.insert(keys[0], a), prefix.insert(keys[1], b)
    assert not prefix.insert(keys[0], c)  # one page per key
    pool.release_row(0)
    assert list(pool.cached) == [a, b] and list(pool.free) == [d, c] and pool.available() == 4
    assert prefix.lookup(list(range(64)), 3) == [a, b]
    pool.check()
    # row 1 maps the cached b (a prefix of other tokens would not match: keys are a chain) and needs 3 fresh pages:
    # d and c are free, then a is evicted; b is retained first, so it survives
    assert pool.assign_row(1, [b], 3) == [b, d, c, a]
    assert pool.stats.evicted == 1 and prefix.lookup(list(range(64)), 3) == [] and keys[1] in prefix.pages
    assert torch.equal(cache.keys[0][[d, c, a]], torch.zeros(3, 1, 16, 2))
    with pytest.raises(OutOfPagesError):
        pool.assign_row(0, [], 1)
    assert pool.rows[0] == [] and pool.refs[b] == 1
    pool.check()
    pool.release_row(1)
    assert list(pool.cached) == [b] and len(pool.free) == 3
    with pytest.raises(ValueError, match="free"):
        pool.retain(d)


@pytest.mark.slow
def test_paged_cache_equals_static_cache(demo):
    """Prefill in chunks and a denoise pass over a paged cache whose pages are scattered through the pool (handed
    out backwards) and whose unmapped pages hold NaN give bitwise the static cache's logits, lengths and keys."""
    model, _ = demo
    S, B, V = 64, 2, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (B, 32), generator=g)
    n = torch.tensor([32, 19])
    static = model.new_cache(B, S)
    paged = paged_cache(model, B, S, block_size=model.config.canvas_length, page_size=P, kv_pages=8)
    pool = list(range(paged.first_pool_page, paged.num_pages))[::-1]
    paged.map_pages(0, pool[:2])
    paged.map_pages(1, pool[2:4])
    paged.fill_pages(pool[4:], float("nan"))
    for cache in (static, paged):
        dg.encode(model, ids, cache, input_lengths=n)
    canvas = torch.randint(3, V, (B, model.config.canvas_length), generator=g)
    assert torch.equal(dg.denoise(model, canvas, paged), dg.denoise(model, canvas, static))
    assert torch.equal(paged.lengths, static.lengths)
    C = model.config.canvas_length
    for layer in range(model.config.num_layers):
        for got, want in zip(paged.layer_kv(layer, C), static.layer_kv(layer, C)):
            assert got.shape == want.shape and got.is_contiguous()
            for b in range(B):
                assert torch.equal(got[b, :, :int(n[b])], want[b, :, :int(n[b])])
    assert paged.page_table[:, 3:4].eq(ZERO_PAGE).all() and paged.keys[0][ZERO_PAGE].eq(0).all()
    with pytest.raises(ValueError, match="multiple of page_size"):
        paged_cache(model, B, 60, block_size=C, page_size=P)


@pytest.mark.slow
@FUSION
def test_engine_paged_equals_generate(demo, fuse):
    """Staggered admission into 3 rows over a pool too small for three requests at once: requests wait for pages
    (never a running one), rows and pages are reused, the free pages hold NaN throughout, and every request's
    tokens equal its solo `dg.generate` run. A request larger than the whole pool is refused at submit."""
    model, tok = demo
    base = model.generation_config
    specs = [(REV, base, 0), ("sort 3 1 2 9 5=", base.with_temperature(0), 1), ("add 123+045=", base, 2),
             ("dedup 3 1 3 2=", base.replace(max_new_tokens=3), 3), (REV, base.replace(max_denoising_steps=3), 4),
             ("rev 4 4 1=", base.with_temperature(2.0), 5)]
    engine = Engine(model, _bucket(model, 3, kv_pages=7, fuse=fuse), tokenizer=tok, prefix_cache=False)
    with pytest.raises(dg.ConfigError, match="KV pages"):
        engine.submit(Request(prompt=_ids(tok, model, REV), config=base.replace(max_new_tokens=160), seed=0))
    _poison_free(engine)
    reqs, waited = [], 0
    for k, (text, cfg, seed) in enumerate(specs):
        reqs.append(engine.submit(Request(prompt=_ids(tok, model, text), config=cfg, seed=seed)))
        for _ in range(k % 3):
            engine.step()
            engine.memory.pool.check()
            _poison_free(engine)
            waited += engine.queue_depth > 0 and engine.running < 3
    _run(engine)
    assert waited  # a free row stood empty while a request waited for pages
    _assert_solo(model, reqs, fuse_commit=fuse)
    assert engine.stats.requests == {"eos": 5, "length": 1}
    assert len(engine.stats.forwards_by_size) > 1  # the step ran at several sizes as rows came and went
    assert engine.memory.pool.available() == engine.memory.pool.capacity and engine.memory.pool.stats.evicted == 0


@pytest.mark.slow
def test_prefix_cache_shared_prefix_computed_once(demo):
    """A prompt's two full pages are encoded once: a request submitted with it waits while they are computed (a
    request of another prompt behind it is admitted meanwhile), three later requests starting with them (other
    tails, seeds and temperatures) map the cached pages at once (held by all three rows); each encodes only its
    tail and gives its solo run's tokens."""
    model, tok = demo
    base = model.generation_config.replace(max_new_tokens=16)
    first = Request(prompt=_ids(tok, model, LONG + "7="), config=base, seed=0)
    twin = Request(prompt=_ids(tok, model, LONG + "8="), config=base, seed=1)
    later = [Request(prompt=_ids(tok, model, LONG + tail), config=cfg, seed=s)
             for s, (tail, cfg) in enumerate([("9=", base), ("7 8 9=", base.with_temperature(0)), ("7=", base)], 2)]
    engine = build_engine(model, max_batch=3, max_seq_len=SLOTS, max_denoising_steps=64, eager=True, tokenizer=tok,
                          page_size=P)
    other = Request(prompt=_ids(tok, model, "add 1234567+7654321 = 0 0 0="), config=base, seed=5)
    engine.submit(first), engine.submit(twin), engine.submit(other)
    engine.step()
    assert engine.rows == [first, other, None] and engine.queue_depth == 1
    _run(engine)
    st, prefix = engine.stats, engine.memory.prefix
    assert st.prefix_hit_tokens == 2 * P and prefix.stats.registered == 3  # first's two pages, other's one
    assert st.prefill_tokens == len(first.prompt) + len(twin.prompt) - 2 * P + len(other.prompt)
    shared = prefix.lookup(first.prompt, 2)
    for r in later:
        engine.submit(r)
    engine.step()
    assert [engine.memory.pool.refs[p] for p in shared] == [3, 3]
    assert all(engine.memory.pool.rows[b][:2] == shared for b in range(3))
    _run(engine)
    assert st.prefix_hit_tokens == 4 * 2 * P and prefix.stats.hit_pages == 8
    assert st.prefill_tokens == len(first.prompt) + len(other.prompt) + sum(len(r.prompt) - 2 * P
                                                                             for r in [twin, *later])
    _assert_solo(model, [first, twin, other, *later])
    assert len(engine.memory.pool.cached) == 3 and not engine.memory.pending  # kept for the next request, evictable


@pytest.mark.slow
def test_eviction_under_memory_pressure(demo):
    """A pool of 6 pages for 2 rows, 6 requests of 4 prefixes (each needs 2-3 pages): cached prefix pages are evicted
    to admit new requests, later requests still hit the pages that survive, no running request is lost, and every
    answer equals its solo run (`test_page_pool_lru` checks the eviction order)."""
    model, tok = demo
    base = model.generation_config.replace(max_new_tokens=16)
    texts = [LONG + "1=", "sort 9 8 7 6 5 4 3 2 1 0 9 8 7 6 5=", LONG + "2=", "add 1234567+7654321 = 0 0 0=",
             "dedup 1 1 2 2 3 3 4 4 5 5 6 6 7 7=", LONG + "3="]
    engine = Engine(model, _bucket(model, 2, kv_pages=6), tokenizer=tok)
    events = []
    reqs = [engine.submit(Request(prompt=_ids(tok, model, t), config=base, seed=k, on_event=events.append))
            for k, t in enumerate(texts)]
    assert max(engine.memory.pool.pages_for(r.slots) for r in reqs) == 3
    _run(engine)
    assert engine.memory.pool.stats.evicted > 0 and engine.memory.prefix.stats.evicted == engine.memory.pool.stats.evicted
    assert engine.stats.prefix_hit_tokens > 0
    assert engine.stats.requests["eos"] + engine.stats.requests["length"] == len(reqs)
    assert {id(e.request) for e in events if e.finish_reason is not None} == {id(r) for r in reqs}
    _assert_solo(model, reqs)


@pytest.mark.slow
@FUSION
def test_prefix_cache_committed_blocks(demo, fuse):
    """The next turn of a chat maps the previous answer: a request whose prompt is a multiple of C tokens registers
    the full pages of its committed block once the commit ran; a request whose prompt is its prompt + its answer + a
    new question maps those pages beside the prompt's (`prefix_hit_tokens`) and its tokens equal its solo run (no
    prefix cache). A request with an unaligned prompt, running beside the first, registers only its full prompt
    pages (its committed block straddles the chunks a later prefill would run)."""
    model, tok = demo
    C = model.config.canvas_length
    greedy = model.generation_config.replace(max_new_tokens=48).with_temperature(0)
    first = Request(prompt=_ids(tok, model, "sort 1 2 3 4 5 6 7 8 9 0 1 2 3="), config=greedy, seed=0)
    odd = Request(prompt=_ids(tok, model, "sort 1 2 3 4 5 6 7 8 9 0 1 2 3 4="), config=greedy, seed=1)
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, max_denoising_steps=64, eager=True, tokenizer=tok,
                          page_size=P, fuse_commit=fuse)
    engine.submit(first), engine.submit(odd)
    _run(engine)
    assert len(first.prompt) % C == 0 and len(odd.prompt) % C
    assert first.stats.blocks == odd.stats.blocks == 2  # one committed block each
    prefix = engine.memory.prefix
    whole = [r.prompt + r.sequence for r in (first, odd)]
    cached = [len(prefix.lookup(t, len(t) // P)) for t in whole]
    assert cached == [(len(first.prompt) + C) // P, len(odd.prompt) // P] == [3, 2]
    assert prefix.stats.hit_pages == 1 and prefix.stats.registered == 4  # odd maps first's page 0 (the same tokens)
    # the committed page holds bitwise what a prefill of the same tokens writes (chunks of C from 0)
    static, page = model.new_cache(1, SLOTS), prefix.lookup(whole[0], 3)[2]
    dg.encode(model, torch.tensor([whole[0][:3 * P]]), static, moe_impl="dense")
    for layer in range(model.config.num_layers):
        for pool, want in ((engine.row_table.cache.keys, static.keys), (engine.row_table.cache.values, static.values)):
            assert torch.equal(pool[layer][page], want[layer][0, :, 2 * P:3 * P])
    follow = Request(prompt=whole[0] + _ids(tok, model, "rev 1 2=")[1:], config=model.generation_config, seed=3)
    hits = engine.stats.prefix_hit_tokens
    engine.submit(follow)
    _run(engine)
    assert engine.stats.prefix_hit_tokens - hits == cached[0] * P > len(first.prompt)
    _assert_solo(model, [first, odd, follow], fuse_commit=fuse)


@pytest.mark.slow
def test_compiled_paged_engine(demo):
    """A compiled bucket of 2 rows over a paged cache, stepping at batch sizes 1 and 2 (the page table is a graph
    input, so admission, page changes and size changes never recompile), gives, with prefix hits and NaN-filled free
    pages, the tokens of each request alone under the eager generator with the compiled experts' implementation
    (`tests/compile/test_compile.py` ties those to the compiled generator's)."""
    from dgemma_compile.compile import CompileOptions, build

    model, tok = demo
    base = model.generation_config
    gen = build(model, CompileOptions(batch_buckets=(1, 2), max_seq_len=SLOTS, fuse_commit=False))
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, tokenizer=tok, generator=gen, page_size=P,
                          kv_pages=10, max_denoising_steps=64)
    reqs = [engine.submit(Request(prompt=_ids(tok, model, LONG + t), config=cfg, seed=s))
            for s, (t, cfg) in enumerate([("1=", base), ("2=", base.with_temperature(0)), ("3 4=", base),
                                          ("1=", base.replace(max_new_tokens=3))])]
    _run(engine)
    assert engine.stats.prefix_hit_tokens >= 2 * 2 * P and engine.recompiles() == {}
    for r in reqs:
        assert r.sequence == _solo(model, r, gen.moe_impl).sequences[0], r.prompt
    tag = engine.row_table.tag
    assert dict(gen.ready) == {f"step[B1_{tag}]": 1, f"step[B2_{tag}]": 1}
