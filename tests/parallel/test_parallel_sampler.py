"""`kernels.sample.vocab_parallel.VocabShard` against the single-process sampler: N ranks simulated by N threads whose
collectives meet at a barrier (no process group; the same reduction ops the gloo group runs, element for element),
so every property runs in the fast tier. The real 2-rank gloo run is tests/parallel/test_parallel.py's."""

import threading
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_compile.step import sampler, mixed_step as steps
from dgemma_compile.kernels.sample.vocab_parallel import VocabShard
from dgemma_compile.parallel.vocab import vocab_range


class Hub:
    """The collectives of `world` threads: each rank's tensor in, the reduction over ranks out (rank order, as a
    ring's result is the same on every rank)."""

    def __init__(self, world: int):
        self.world, self.parts, self.barrier = world, [None] * world, threading.Barrier(world)

    def reduce(self, rank: int, x: torch.Tensor, op: str) -> torch.Tensor:
        self.parts[rank] = x
        self.barrier.wait()
        stacked = torch.stack(self.parts)
        out = {"sum": lambda t: t.sum(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}[op](stacked)
        self.barrier.wait()  # nobody overwrites a part before every rank read them
        return out.to(x.dtype)


@dataclass(frozen=True, eq=False)
class ThreadShard(VocabShard):
    hub: Hub = None

    def _reduce(self, x, op):
        return self.hub.reduce(self.rank, x, op)


def run_ranks(world: int, V: int, fn):
    """fn(shard, lo, hi) on every rank in its own thread (lo, hi: the rank's columns of the padded vocabulary);
    returns the ranks' results."""
    hub, out, errors = Hub(world), [None] * world, []

    def rank(r):
        start, per = vocab_range(V, r, world)
        try:
            out[r] = fn(ThreadShard(group=None, rank=r, world_size=world, start=start, per=per, vocab_size=V, hub=hub),
                        start, start + per)
        except BaseException as e:  # noqa: BLE001 -- re-raised below, with the barrier broken for the others
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def local(x_BCV, lo, hi):
    """The rank's slice of full logits [B, C, V], zero-padded to hi - lo columns (what the sharded lm_head gives:
    the padding rows of the table are zero)."""
    V = x_BCV.shape[-1]
    return F.pad(x_BCV[..., lo:min(hi, V)], (0, max(0, hi - max(lo, V))))


def _logits(seed, B, C, V, spread, ties):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, V, generator=g) * torch.rand(B, C, 1, generator=g) * spread
    if ties:  # repeated maxima across the rank boundary: the first-maximum rule decides
        x[..., V // 2:] = x[..., :V - V // 2].clone()
        x[..., -1] = x.amax(-1)
    return (torch.tanh(x / 30) * 30).float()


def _gather(parts, V):
    return torch.cat(parts, dim=-1)[..., :V]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 3), C=st.integers(1, 9), V=st.sampled_from([2, 27, 61, 128, 4096 * 2 + 5]),
       world=st.sampled_from([2, 3, 4]), spread=st.floats(0.1, 40.0), ties=st.booleans(), greedy_row=st.booleans(),
       constrained=st.booleans())
def test_shard_sample_step_equals_the_single_process_sampler(seed, B, C, V, world, spread, ties, greedy_row,
                                                             constrained):
    """argmax and sampled ids equal the single process's, bitwise the same on every rank; entropy and the gathered
    self-conditioning probabilities within float32 reduction order; padding ids never chosen, probability 0."""
    x = _logits(seed, B, C, V, spread, ties)
    g = torch.Generator().manual_seed(seed + 1)
    T = torch.rand(B, generator=g) * 1.5 + 0.05
    greedy = torch.zeros(B, dtype=torch.bool)
    greedy[0] = greedy_row
    u = torch.rand(B, C, generator=g)
    allowed = cons = None
    if constrained:
        W = -(-V // 32)
        allowed = torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
        allowed[:, 0] |= 1  # at least one allowed id
        cons = torch.rand(B, generator=g) < 0.7
    want = sampler.sample_step(x, T, greedy, u, allowed, cons)
    got = run_ranks(world, V, lambda sh, lo, hi: sh.sample_step(local(x, lo, hi), T, greedy, u, allowed, cons))
    for r in got[1:]:
        for a, b in zip(r[:3], got[0][:3]):
            assert torch.equal(a, b), "ranks disagree"
    assert torch.equal(got[0].argmax, want.argmax)
    # the inverse CDF over other chunk boundaries: equal up to float32 rounding of the cumulative masses, so a
    # uniform within ~1e-6 of a boundary may pick its neighbour; nothing else may differ
    diff = got[0].sampled != want.sampled
    assert int(diff.sum()) <= max(1, diff.numel() // 1000), (got[0].sampled, want.sampled)
    assert int(got[0].sampled.max()) < V
    torch.testing.assert_close(got[0].entropy, want.entropy, atol=1e-4, rtol=1e-4)
    probs = _gather([p.sc_probs for p in got], V)
    torch.testing.assert_close(probs, want.sc_probs, atol=1e-6, rtol=1e-5)
    pad = torch.cat([p.sc_probs for p in got], dim=-1)[..., V:]
    assert pad.numel() == 0 or float(pad.abs().max()) == 0.0


def test_shard_sample_step_bitwise_where_chunks_align():
    """Slices of whole SAMPLE_CHUNK chunks (the release: 262144 / N): the chunk masses are the single process's
    sums, so the sampled ids are equal for every uniform, boundaries included."""
    V, world = 4 * sampler.SAMPLE_CHUNK, 2
    x = _logits(3, 2, 64, V, 8.0, False)
    T, greedy = torch.tensor([1.0, 0.7]), torch.zeros(2, dtype=torch.bool)
    u = torch.rand(2, 64, generator=torch.Generator().manual_seed(4))
    want = sampler.sample_step(x, T, greedy, u)
    got = run_ranks(world, V, lambda sh, lo, hi: sh.sample_step(local(x, lo, hi), T, greedy, u))
    assert torch.equal(got[0].sampled, want.sampled) and torch.equal(got[1].sampled, want.sampled)


@pytest.mark.parametrize("world,V,k", [(2, 27, 5), (4, 27, 20), (3, 100, 0), (2, 61, 30)])
def test_shard_logprobs_equal_the_single_process(world, V, k):
    """`VocabShard.logprobs` against `mixed_step.logprobs`: the tokens' log p and the top k (ids as sets where values
    tie), the same on every rank."""
    x = _logits(7, 2, 5, V, 20.0, False)
    tokens = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(8))
    want = steps.logprobs(x, tokens, k)
    got = run_ranks(world, V, lambda sh, lo, hi: sh.logprobs(local(x, lo, hi), tokens, k))
    for r in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, got[0])), "ranks disagree"
    token, ids, top = got[0]
    torch.testing.assert_close(token, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(top, want[2], atol=1e-5, rtol=1e-5)
    assert ids.shape == want[1].shape and (ids.numel() == 0 or int(ids.max()) < V)
    torch.testing.assert_close(x.gather(-1, ids), x.gather(-1, want[1]))  # the same values, whatever the tie order


def test_padding_ids_never_win_even_when_every_real_logit_is_below_zero():
    """The table's padding rows give logit 0 on the last rank; with every real logit negative a sampler that did not
    mask them would pick a padding id (27 for the demo's 27 ids on 2 ranks)."""
    V = 27
    x = -5 - torch.rand(1, 4, V, generator=torch.Generator().manual_seed(0))
    T, greedy, u = torch.ones(1), torch.tensor([False]), torch.full((1, 4), 0.9999)
    want = sampler.sample_step(x, T, greedy, u)
    got = run_ranks(2, V, lambda sh, lo, hi: sh.sample_step(local(x, lo, hi), T, greedy, u))
    assert torch.equal(got[0].argmax, want.argmax) and int(got[0].sampled.max()) < V
