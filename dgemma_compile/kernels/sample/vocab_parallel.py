"""The denoise step's vocabulary-wide part over one rank's slice of the vocabulary: `VocabShard`.

Under tensor parallel each rank holds the logits of its rows [start, start + per) of the padded vocabulary (`vocab.py`:
per = ceil(V / N)), never the full [B, C, V]. The sampler's reductions over the vocabulary become a local reduction
and one all-reduce of a small tensor; what every rank then decides (argmax, sampled token, entropy) is bitwise the
same on every rank, because each all-reduced value is either exact (max, min, a sum with one nonzero term) or the
same collective's output on every rank.

`VocabShard.sample_step` is `sampler.sample_step` (its reference: same arguments, same `SampleStep`, the
self-conditioning probabilities as the rank's slice [B, C, per]); `VocabShard.logprobs` is `mixed_step.logprobs`.
What each computes, with x the rank's float32 logits (padding ids set to `sampler.MASKED_LOGIT`, so probability 0):
- max: m = all-reduce max of the local max (exact); scaled = (x - m) / T, whose global max is exactly 0;
- argmax: the first id whose scaled value is 0: each rank's first local one, all-reduce min (exact, the single
  process's first-maximum rule);
- sample: the chunked inverse CDF (`sampler.sample_chunked_icdf`) with chunks of min(SAMPLE_CHUNK, per) ids inside
  each rank's slice: the chunk masses sum(exp(scaled)) are gathered (an all-reduce of each rank's masses placed in
  zeros: [B, C, N * chunks], exact), every rank picks the same chunk, its owner picks the id inside it, and an
  all-reduce sum with one nonzero term hands it to every rank. Chunk boundaries fall where the single process's do
  whenever per is a multiple of SAMPLE_CHUNK (the release: 262144 / N for N = 2, 4, 8, 64 chunks of 4096), so the
  masses are the same sums; elsewhere (the demo's 27 ids: one chunk in one process, one per rank here) it is the same
  inverse CDF cut at other places, equal up to float32 rounding of the cumulative masses;
- entropy: lse = log(total mass) (the max is 0), each rank's sum of -p log p over its ids, all-reduce sum;
- self-conditioning: exp(scaled) / total on the rank's ids (one-hot at the argmax for greedy rows); the product with
  the rank's embedding rows and its all-reduce are `vocab.VocabParallelProduct.local`.
Bytes all-reduced per step, B rows of C positions: 4 (max) + 8 (argmax) + 4 * N * chunks (masses) + 8 (token) + 4
(entropy) per position: at the release (64 chunks of 4096) 280 bytes a position, against 2 * 262144 (bf16) for
gathering the logits. Reduction-order differences from one process are the float32 sums' (total mass, entropy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from ...step.sampler import MASKED_LOGIT, SAMPLE_CHUNK, SCHEME, SampleStep, _finite, _last_positive, mask_first


@dataclass(frozen=True, eq=False)
class VocabShard:
    """One rank's slice of the vocabulary: ids [start, start + per) of `vocab_size` (ids past it are padding), over
    `group` (rank `rank` of `world_size`). Held by a sharded model's lm_head (`vocab.VocabParallelHead.shard`), read
    as `model.vocab_shard`."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    start: int
    per: int
    vocab_size: int
    rank_activation_scales: bool = False
    """The model's quantization scheme quantizes activations per row at run time (`quant.schemes.Scheme
    .dynamic_activations`: fp8), which names its numerics under the split."""

    @property
    def scheme(self) -> str:
        """The step numerics under this split (`sampler.SCHEME` plus the chunks cut per rank: a sampled id can differ
        from one process's where the slice is not whole SAMPLE_CHUNK chunks; module docstring). With fp8 (dynamic
        activations) also `+fp8-rank-activations/v1`: a row-parallel projection quantizes each rank's slice of an
        activation row with that slice's own scale, where one process scales the whole row (docs/parallel.md)."""
        suffix = "+fp8-rank-activations/v1" if self.rank_activation_scales else ""
        return f"{SCHEME}+vocab-shard-{self.world_size}/v1{suffix}"

    def masked(self, logits_BCV: torch.Tensor) -> torch.Tensor:
        """float32 [B, C, per]: the rank's logits with the padding ids at `MASKED_LOGIT` (probability 0)."""
        ids = self.start + torch.arange(self.per, device=logits_BCV.device)
        return torch.where(ids < self.vocab_size, logits_BCV.float(), MASKED_LOGIT)

    def gather(self, local_BCV: torch.Tensor) -> torch.Tensor:
        """[..., V]: every rank's slice [..., per] placed in zeros and summed (exact: one nonzero term per id), the
        padding cut. For tests and the eager helpers that want the whole vocabulary; the step never calls it."""
        placed = F.pad(local_BCV, (self.rank * self.per, (self.world_size - 1 - self.rank) * self.per))
        return funcol.all_reduce(placed, "sum", self.group)[..., :self.vocab_size]

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        return funcol.all_reduce(x, op, self.group)

    def _placed(self, x_BCK: torch.Tensor) -> torch.Tensor:
        """[B, C, N * K]: every rank's [B, C, K] side by side (an all-reduce of the placed slice, exact)."""
        K = x_BCK.shape[-1]
        return self._reduce(F.pad(x_BCK, (self.rank * K, (self.world_size - 1 - self.rank) * K)), "sum")

    def sample_step(self, logits_BCV: torch.Tensor, temperature_B: torch.Tensor, greedy_B: torch.Tensor,
                    uniform_BC: torch.Tensor, allowed_BW: torch.Tensor | None = None,
                    constrained_B: torch.Tensor | None = None) -> SampleStep:
        """`sampler.sample_step` over the rank's slice (module docstring). Args as there, with logits float
        [B, C, per] (the rank's ids; `DiffusionGemma.logits(hidden, local=True)`) and the full bitmask `allowed_BW`
        int32 [B, ceil(V / 32)]. Returns argmax, sampled (global ids), entropy: [B, C], the same on every rank;
        sc_probs float32 [B, C, per], the rank's slice of the self-conditioning input."""
        B, C, per = logits_BCV.shape
        greedy_B1 = greedy_B[:, None]
        x = self.masked(logits_BCV)
        if allowed_BW is not None:
            x = mask_first(x, allowed_BW, constrained_B, first_id=self.start)
        m = self._reduce(x.amax(dim=-1, keepdim=True), "max")
        scaled = _finite((x - m) / torch.where(greedy_B, 1.0, temperature_B)[:, None, None])
        ids = self.start + torch.arange(per, device=x.device)
        # the global max of scaled is exactly 0 (x - m is 0 where x == m, <= 0 elsewhere): the first id holding it
        holds = scaled.amax(dim=-1) == 0
        argmax = self._reduce(torch.where(holds, self.start + scaled.argmax(dim=-1), self.vocab_size), "min")
        # the chunked inverse CDF: chunk masses gathered, the chosen chunk's owner picks the id
        c = min(SAMPLE_CHUNK, per)
        Kl = -(-per // c)
        padded = F.pad(scaled, (0, Kl * c - per), value=float("-inf")) if Kl * c != per else scaled
        e_BCKc = torch.exp(padded.view(B, C, Kl, c))
        masses = self._placed(e_BCKc.sum(-1))  # [B, C, N * Kl]
        cum = torch.cumsum(masses, dim=-1)
        total = cum[..., -1:]
        target = uniform_BC[..., None] * total
        k = torch.minimum(torch.searchsorted(cum, target, right=True), _last_positive(masses)[..., None])
        before = torch.where(k > 0, cum.gather(-1, (k - 1).clamp(min=0)), 0.0)
        kl = (k - self.rank * Kl).clamp(0, Kl - 1)
        e_BC1c = e_BCKc.gather(2, kl[..., None].expand(B, C, 1, c))
        j = torch.minimum(torch.searchsorted(torch.cumsum(e_BC1c, dim=-1), (target - before)[..., None],
                                             right=True)[..., 0], _last_positive(e_BC1c))
        mine = (k // Kl) == self.rank
        token = self._reduce(torch.where(mine, self.start + kl * c + j, 0), "sum")[..., 0]
        sampled = torch.where(greedy_B1, argmax, token)
        # entropy of softmax(scaled): log-sum-exp = log(total), the max being 0
        log_p = (scaled - torch.log(total)).clamp(min=torch.finfo(torch.float32).min)
        ent = self._reduce(-(log_p * log_p.exp()).sum(-1), "sum")
        ent = torch.where(greedy_B1, 0.0, ent)
        sc_probs = torch.where(greedy_B[:, None, None], (ids == argmax[..., None]).float(), torch.exp(scaled) / total)
        return SampleStep(argmax=argmax, sampled=sampled, entropy=ent, sc_probs=sc_probs)

    def logprobs(self, logits_BCV: torch.Tensor, tokens_BC: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`mixed_step.logprobs` over the rank's slice: (log p(tokens) float32 [B, C], the k most likely ids int64
        [B, C, k], their log p float32 [B, C, k], descending), the same on every rank. Args: logits float32
        [B, C, per] (the rank's ids), tokens int64 [B, C] (global ids), k <= 64."""
        x = self.masked(logits_BCV)
        m = self._reduce(x.amax(dim=-1, keepdim=True), "max")
        lse = m + torch.log(self._reduce(torch.exp(x - m).sum(-1, keepdim=True), "sum"))
        local = tokens_BC - self.start
        inside = (local >= 0) & (local < self.per)
        picked = x.gather(-1, local.clamp(0, self.per - 1)[..., None])[..., 0]
        token = self._reduce(torch.where(inside, picked, 0.0), "sum") - lse[..., 0]
        if k == 0:
            empty = x.new_zeros(*tokens_BC.shape, 0)
            return token, empty.long(), empty
        top, at = x.topk(min(k, self.per), dim=-1)
        values, ids = self._placed(top), self._placed(at + self.start)
        best, where = values.topk(k, dim=-1)
        return token, ids.gather(-1, where), best - lse
