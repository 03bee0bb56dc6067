"""The denoise-step math as pure, batched tensor functions with per-row state and per-row parameters.

Sources (transformers `generation_diffusion_gemma.py`): `LinearTemperatureScheduleLogitsProcessor`,
`EntropyBoundSampler.accept_canvas / renoise_canvas`, `StableAndConfidentStoppingCriteria`, and the per-row
freezing of `_denoising_step`. Random draws come in as tensors (`StepNoise`, drawn from `rng.py`'s counter-based
streams inside the step), so one row's tokens depend only on its own seed and config, never on the batch, and the
step itself holds no host synchronisation.

Sampling scheme (`SCHEME`): one Philox uniform per position (`rng.LANE_SAMPLE`) turned into a token by a chunked
inverse CDF over softmax(logits / T) (`sample_chunked_icdf`): exact in distribution, and a fused kernel computes it
reading the logits about once (the per-chunk max and sum-exp it needs are the ones the entropy needs anyway; only the
chosen chunk is read again). Gumbel-max would need one hashed value and two logs per vocabulary entry: measured
here, Philox alone costs ~67 ms per 2**20 draws compiled on one core, ~4 s per step at the released vocabulary
(256 x 262,144) against a fraction of a second for the whole chunked inverse CDF (`bench/sampling.py`).

Temperatures: a per-row table computed in float64 on the host (`temperature_table`), stored as float32, with greedy
positions flagged instead of dividing by T = 0: any T below float32's smallest normal (1.18e-38), zero and denormals
included, is greedy by definition (argmax token, entropy 0, one-hot self-conditioning input). Every tensor a step
outputs or carries to the next step is finite.

Legend: B batch, C canvas, V vocab, P stability_threshold (history depth), N steps, K vocabulary chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

SAMPLE_CHUNK = 4096
"""Vocabulary ids per chunk of the inverse-CDF sampler (part of the scheme: a kernel must use the same chunks)."""
SCHEME = f"philox4x32-10+chunked-icdf-{SAMPLE_CHUNK}+sc-embed/v4"
"""Name of the step numerics (random streams, sampler, what a step hands the next); printed in stats and bench
metadata. v4 carries the self-conditioning input as its soft embedding [B, C, D]: the step that sampled computes
softmax((logits - max) / T) in float32, casts it to the model dtype and multiplies by the embedding weight (times
embed_scale; `DiffusionGemma.self_conditioning_embedding`), where v3 stored those probabilities [B, C, V] and the
next forward did the product: the same operations on the same values, so v4 gives v3's tokens (checked on the 500
demo test prompts, README), with D instead of V values per position carried between steps. v2 carried the scaled
logits (stored in the model dtype) and the next forward took their softmax. v1 was torch.Generator streams seeded by
SplitMix64 with an unchunked inverse CDF."""


def step_scheme(model) -> str:
    """The numerics a model's steps sample with: `SCHEME`, or under tensor parallel its `vocab_shard.scheme`."""
    return SCHEME if model.vocab_shard is None else model.vocab_shard.scheme


GREEDY_BELOW = torch.finfo(torch.float32).tiny
"""Temperatures below float32's smallest normal (zero and denormals included) mean greedy decoding."""


@dataclass(frozen=True)
class StepNoise:
    """The random inputs of one denoise step for a batch.

    uniform: float32 [B, C] in [0, 1), one per position, for inverse-CDF sampling.
    renoise: int64 [B, C], fresh uniform tokens for positions that are not accepted.
    """

    uniform: torch.Tensor
    renoise: torch.Tensor


def temperature(step: int, max_steps: int, t_min: float, t_max: float) -> float:
    """T = t_min + (t_max - t_min) * n / N at step n (counting down N..1), in float64."""
    return t_min + (t_max - t_min) * (step / max_steps)


def temperature_table(schedules: Sequence[tuple[float, float, int]], width: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row temperature tables for (t_min, t_max, N) per row: (T float32 [B, width], greedy bool [B, width]).

    Entry [b, k] is the temperature of row b's (k+1)-th denoise step, n = N - k, computed in float64 by
    `temperature` and stored as float32; entries with T < `GREEDY_BELOW` (or k >= N, never used) are flagged greedy
    and hold 1.0, so no step divides by zero.
    """
    T = torch.ones(len(schedules), width, dtype=torch.float64)
    for b, (t_min, t_max, N) in enumerate(schedules):
        if N > width:
            raise ValueError(f"max_denoising_steps: {N} exceeds the temperature table's width {width}")
        for k in range(N):
            T[b, k] = temperature(N - k, N, t_min, t_max)
    greedy = T < GREEDY_BELOW
    for b, (_, _, N) in enumerate(schedules):
        greedy[b, N:] = True
    return torch.where(greedy, 1.0, T).float(), greedy


def entropy(logits_BCV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, float32 [B, C]; computed as torch.distributions.Categorical does."""
    logits = logits_BCV.float()
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    return -(log_p * log_p.exp()).sum(-1)


def _entropy(scaled_BCV: torch.Tensor, total_BC1: torch.Tensor) -> torch.Tensor:
    """`entropy` of float32 logits whose max is exactly 0, given total = sum(exp(logits)) [B, C, 1]: logsumexp is
    then log(total) + 0, so this is `entropy`'s value bit for bit without its max and exp passes."""
    log_p = (scaled_BCV - total_BC1.log()).clamp(min=torch.finfo(scaled_BCV.dtype).min)
    return -(log_p * log_p.exp()).sum(-1)


def entropy_bound_accept(entropy_BC: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """bool [B, C]: sort entropies ascending and accept position j while (cumulative entropy up to and including
    j) - entropy_j <= bound. The lowest-entropy position is always accepted (arXiv 2505.24857)."""
    sorted_e, order = torch.sort(entropy_BC, dim=-1)
    accept_sorted = (torch.cumsum(sorted_e, dim=-1) - sorted_e) <= bound
    return torch.zeros_like(accept_sorted).scatter(-1, order, accept_sorted)


def sample_inverse_cdf(logits_BCV: torch.Tensor, uniform_BC: torch.Tensor) -> torch.Tensor:
    """One token per position from softmax(logits) by an unchunked inverse CDF (the first id whose cumulative
    probability exceeds u * total): the plain reference `sample_chunked_icdf` is tested against."""
    cdf = torch.cumsum(torch.softmax(logits_BCV.float(), dim=-1), dim=-1)
    target = (uniform_BC * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp(max=logits_BCV.shape[-1] - 1)


def _last_positive(mass_XK: torch.Tensor) -> torch.Tensor:
    """Index of the last entry > 0 along the last dim (0 if none)."""
    K = mass_XK.shape[-1]
    return (K - 1 - torch.flip(mass_XK > 0, dims=(-1,)).int().argmax(dim=-1)).long()


def sample_chunked_icdf(logits_BCV: torch.Tensor, uniform: torch.Tensor, chunk: int = SAMPLE_CHUNK) -> torch.Tensor:
    """Tokens from softmax(logits), exactly in distribution, one uniform per draw.

    Two levels of inverse CDF: the vocabulary is cut into chunks of `chunk` ids (the last one padded with -inf);
    m = max logit, s_k = sum over chunk k of exp(logit - m); the target u * sum(s) picks the first chunk whose
    cumulative mass exceeds it, and the remainder picks the first id of that chunk whose cumulative exp exceeds it.
    Rounding never selects an id of probability zero: both levels clamp to their last entry of positive mass.

    Args: logits float [B, C, V]; uniform float32 [B, C] (one draw per position) or [B, C, S] (S draws per
    position, for tests). Returns int64 of the uniform's shape.
    """
    x = logits_BCV.float()
    return sample_chunked_icdf_exp(torch.exp(x - x.amax(dim=-1, keepdim=True)), uniform, chunk)


def sample_chunked_icdf_exp(exp_BCV: torch.Tensor, uniform: torch.Tensor, chunk: int = SAMPLE_CHUNK) -> torch.Tensor:
    """`sample_chunked_icdf` from exp(logits - max) (float32 [B, C, V]; the chunks pad with 0, the exp of -inf),
    for a caller that has computed it already (`sample_step`). Same arguments and result otherwise."""
    B, C, V = exp_BCV.shape
    u_BCS = uniform.unsqueeze(-1) if uniform.dim() == 2 else uniform
    S = u_BCS.shape[-1]
    Vc = min(chunk, V)
    K = -(-V // Vc)
    e = exp_BCV
    if K * Vc != V:
        e = torch.nn.functional.pad(e, (0, K * Vc - V), value=0.0)
    e_BCKc = e.view(B, C, K, Vc)
    mass_BCK = e_BCKc.sum(-1)
    cum_BCK = torch.cumsum(mass_BCK, dim=-1)
    target_BCS = u_BCS * cum_BCK[..., -1:]
    k_BCS = torch.minimum(torch.searchsorted(cum_BCK, target_BCS, right=True), _last_positive(mass_BCK)[..., None])
    before_BCS = torch.where(k_BCS > 0, cum_BCK.gather(-1, (k_BCS - 1).clamp(min=0)), 0.0)
    e_BCSc = e_BCKc.gather(2, k_BCS[..., None].expand(B, C, S, Vc))
    j_BCS = torch.minimum(
        torch.searchsorted(torch.cumsum(e_BCSc, dim=-1), (target_BCS - before_BCS).unsqueeze(-1), right=True)[..., 0],
        _last_positive(e_BCSc))
    ids = k_BCS * Vc + j_BCS
    return ids.squeeze(-1) if uniform.dim() == 2 else ids


class StepUpdate(NamedTuple):
    """What one denoise step computes from the decoder's logits (see `denoise_update`).

    canvas, argmax: int64 [B, C]; history: int64 [P, B, C]; finished: bool [B]; sc_probs: float32 [B, C, V], the next
    step's self-conditioning input: softmax((logits - max) / T) (one-hot for greedy rows); accepted: bool [B, C], the
    positions the entropy bound accepted (the others renoised; a frozen row's are meaningless); entropy: float32
    [B, C], the entropy of each position's scaled distribution (0 for greedy rows). The last two are what a live
    canvas frame shows (`frames.py`); nothing else reads them.
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    sc_probs: torch.Tensor
    accepted: torch.Tensor
    entropy: torch.Tensor


def _finite(x: torch.Tensor) -> torch.Tensor:
    big = torch.finfo(x.dtype).max
    return x.clamp(-big, big)


class SampleStep(NamedTuple):
    """What `sample_step` computes per position: argmax, sampled: int64 [B, C]; entropy: float32 [B, C];
    sc_probs: float32 [B, C, V] (see `StepUpdate`)."""

    argmax: torch.Tensor
    sampled: torch.Tensor
    entropy: torch.Tensor
    sc_probs: torch.Tensor


def sample_step(logits_BCV: torch.Tensor, temperature_B: torch.Tensor, greedy_B: torch.Tensor,
                uniform_BC: torch.Tensor, allowed_BW: torch.Tensor | None = None,
                constrained_B: torch.Tensor | None = None) -> SampleStep:
    """The vocabulary-wide part of a denoise step, the region `dgemma::sample_step` fuses: the logits (first-position
    masked for constrained rows: `mask_first`, when `allowed_BW` and `constrained_B` are given) scaled by 1/T
    (shifted by their max first), their argmax, one token per position by `sample_chunked_icdf` with `uniform_BC`,
    the entropy of softmax(scaled), and the self-conditioning input softmax(scaled) (one-hot for greedy rows).

    Args: logits float [B, C, V] (any float dtype, computed in float32); temperature float32 [B]; greedy bool [B]
    (sample = argmax, entropy 0); uniform float32 [B, C] in [0, 1); allowed int32 [B, W] and constrained bool [B]:
    the grammar's next-token bitmask and which rows it applies to (`mask_first`; per-row tensor data, so a grammar is
    never a recompile). Rows are independent: a slice of rows or positions gives the same values as the whole (what a
    chunked implementation relies on; a slice of positions that does not start at position 0 takes no mask).
    """
    greedy_B11 = greedy_B[:, None, None]
    x = logits_BCV.float()
    if allowed_BW is not None:
        x = mask_first(x, allowed_BW, constrained_B)
    # shift by the max before dividing: softmax is unchanged, the max entry is exactly 0, and a tiny T can only
    # push the others towards -inf (clamped), never overflow the max (which would make false ties)
    shifted = x - x.amax(dim=-1, keepdim=True)
    scaled = _finite(shifted / torch.where(greedy_B, 1.0, temperature_B)[:, None, None])
    argmax = scaled.argmax(dim=-1)
    # One exp pass for the sampler, the entropy and the self-conditioning softmax. The max of `scaled` is exactly +0
    # (the max entry of `shifted` is x - x, and 0 / T = 0), so exp(scaled) is what each of them computes after
    # subtracting its own max, and `total` is logsumexp's sum: Inductor made three vocabulary-wide exp passes of it
    # (and two more max passes) where one does. The same bits eagerly, and compiled where V is whole vectors; an id
    # in a vector loop's tail may round its exp differently (tests/step/test_sampler.py; bench/vocabulary_region.py)
    exp_scaled = torch.exp(scaled)
    total = exp_scaled.sum(dim=-1, keepdim=True)
    sampled = torch.where(greedy_B[:, None], argmax, sample_chunked_icdf_exp(exp_scaled, uniform_BC))
    ent = torch.where(greedy_B[:, None], 0.0, _entropy(scaled, total))
    # softmax(scaled): compiled, as Inductor decomposes softmax (exp(x - max) / sum: the same bits from the shared
    # pass); eagerly aten's own kernel, whose bits differ (it multiplies by 1 / sum), so the eager steps keep theirs
    probs = exp_scaled / total if _traced() else torch.softmax(scaled, dim=-1)
    # a greedy row's input is the one-hot of its argmax: what softmax gave its one-hot logits (0 and the float min)
    one_hot = (torch.arange(scaled.shape[-1], device=scaled.device) == argmax[..., None]).float()
    sc_probs = torch.where(greedy_B11, one_hot, probs)
    return SampleStep(argmax=argmax, sampled=sampled, entropy=ent, sc_probs=sc_probs)


MASKED_LOGIT = -1e30
"""What a constrained row's disallowed ids get at the first canvas position (`mask_first`): finite, so every carried
tensor stays finite, and far below any softcapped logit (|logit| <= 30), so their probability is 0."""


def _traced() -> bool:
    """Under Dynamo, or traced by make_fx (Inductor's `fwd_only` traces `sample_step` into the sample_step_fusion
    pattern; torch 2.11's `is_compiling()` is False there, and a data-dependent `bool()` fails that trace)."""
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def mask_first(logits_BCV: torch.Tensor, allowed_BW: torch.Tensor, constrained_B: torch.Tensor,
               first_id: int = 0) -> torch.Tensor:
    """Constrained decoding's device half (docs/constrained.md), a part of `sample_step`: the logits with, for rows
    where `constrained_B` (bool [B]), every id the grammar's next-token bitmask `allowed_BW` (int32 [B, W],
    W = ceil(V / 32), bit v % 32 of word v // 32 allows id v: xgrammar's layout) does not allow set to `MASKED_LOGIT`
    at canvas position 0 (the next token after the committed ones). A new tensor (uncompiled on CPU with no
    constrained row, `logits_BCV` itself); other rows and positions keep their values bit for bit (`torch.where`
    picks the input). Tensor ops only: a grammar is data, never a
    recompile. `first_id`: the vocabulary id of the logits' first column (a tensor-parallel rank's slice,
    `kernels/sample/vocab_parallel.py`; ids past the bitmask, the slice's padding, read its last word)."""
    if logits_BCV.device.type == "cpu" and not _traced() and not bool(constrained_B.any()):
        return logits_BCV  # uncompiled on CPU, no constrained row: the values `where` would keep, without its ops
    C, V = logits_BCV.shape[1], logits_BCV.shape[-1]
    v_V = torch.arange(V, device=logits_BCV.device)
    if first_id:
        v_V = (v_V + first_id).clamp(max=allowed_BW.shape[-1] * 32 - 1)
    bits_BV = (allowed_BW[:, v_V // 32] >> (v_V % 32).to(allowed_BW.dtype)) & 1
    keep_B1V = ((bits_BV != 0) | ~constrained_B[:, None])[:, None, :]
    later_1C1 = (torch.arange(C, device=logits_BCV.device) != 0)[None, :, None]
    return torch.where(keep_B1V | later_1C1, logits_BCV, MASKED_LOGIT)


def pin(step: SampleStep, pinned_BC: torch.Tensor, ids_BC: torch.Tensor) -> SampleStep:
    """Pinned positions (`canvas.py`) hold their tokens: where `pinned_BC` (bool [B, C]), argmax and sample are
    `ids_BC` (int64 [B, C]) and entropy 0 (certain); their self-conditioning input is the token's embedding
    (`DiffusionGemma.self_conditioning_embedding`'s `pinned_BT`, applied by the step at D width). Elsewhere every
    value is the input's bit for bit
    (`torch.where` picks it): a row without pins is unchanged."""
    return step._replace(argmax=torch.where(pinned_BC, ids_BC, step.argmax),
                         sampled=torch.where(pinned_BC, ids_BC, step.sampled),
                         entropy=torch.where(pinned_BC, 0.0, step.entropy))


def push_history(history_PBC: torch.Tensor, argmax_BC: torch.Tensor) -> torch.Tensor:
    """The stability history after a step: the previous P argmax canvases (int64 [P, B, C]) without the oldest,
    then `argmax_BC`; unchanged when P = 0 (`StableAndConfidentStoppingCriteria`'s window)."""
    return torch.cat([history_PBC[1:], argmax_BC[None]], dim=0) if history_PBC.shape[0] else history_PBC


def denoise_update(canvas_BC: torch.Tensor, argmax_BC: torch.Tensor, history_PBC: torch.Tensor,
                   finished_B: torch.Tensor, logits_BCV: torch.Tensor, temperature_B: torch.Tensor,
                   greedy_B: torch.Tensor, noise: StepNoise, *, entropy_bound_B: torch.Tensor,
                   confidence_B: torch.Tensor, stop_early: bool, allowed_BW: torch.Tensor | None = None,
                   constrained_B: torch.Tensor | None = None, vocab_shard=None,
                   pinned_BC: torch.Tensor | None = None, pin_ids_BC: torch.Tensor | None = None) -> StepUpdate:
    """Everything after the decoder in one denoise step, as a pure function of the current per-row state (canvas,
    argmax and history of the previous P argmax canvases, -1 before the first; finished rows) and per-row parameters
    (temperature float32 [B], greedy bool [B], entropy bound and confidence threshold float32 [B]). Rows already
    finished keep canvas and argmax frozen.

    Greedy rows: sample = argmax, entropy 0 (so every position is accepted), one-hot self-conditioning.
    Constrained rows (`allowed_BW` int32 [B, W], `constrained_B` bool [B]): the first position masked inside
    `sample_step` (`mask_first`).
    `vocab_shard`: under tensor parallel, the rank's `kernels.sample.vocab_parallel.VocabShard`: `logits_BCV` is the rank's slice
    [B, C, per] and its `sample_step` replaces `sample_step` (sc_probs the rank's slice too).
    Stopping (`StableAndConfidentStoppingCriteria`): argmax equal to each of the previous P argmax canvases (so never
    on a block's first step when P >= 1) and mean entropy of the scaled logits < the confidence threshold.
    Pinned positions (`pinned_BC` bool [B, C], their tokens `pin_ids_BC` int64 [B, C]; `canvas.py`): `pin`, always
    accepted; a row whose every position is pinned finishes in this step; sc_probs is returned as sampled (the step
    gives pinned positions their token's embedding: `DiffusionGemma.self_conditioning_embedding`). Rows without
    pins: unchanged bit for bit.
    """
    sample = sample_step if vocab_shard is None else vocab_shard.sample_step
    step = sample(logits_BCV, temperature_B, greedy_B, noise.uniform, allowed_BW, constrained_B)
    if pinned_BC is not None:
        step = pin(step, pinned_BC, pin_ids_BC)
    argmax, sampled, ent, sc_probs = step
    accepted = entropy_bound_accept(ent, entropy_bound_B[:, None])
    if pinned_BC is not None:
        accepted = accepted | pinned_BC
    canvas = torch.where(accepted, sampled, noise.renoise)
    frozen = finished_B[:, None]
    argmax = torch.where(frozen, argmax_BC, argmax)
    canvas = torch.where(frozen, canvas_BC, canvas)
    history, finished = history_PBC, finished_B
    if pinned_BC is not None:  # a fully pinned block: nothing to denoise, it finishes in its first step
        finished = finished | pinned_BC.all(dim=-1)
    if stop_early:
        stable = (history == argmax[None]).all(dim=-1).all(dim=0)
        confident = ent.mean(dim=-1) < confidence_B
        finished = finished | (stable & confident)
        history = push_history(history, argmax)
    return StepUpdate(canvas=canvas, argmax=argmax, history=history, finished=finished, sc_probs=sc_probs,
                      accepted=accepted, entropy=ent)
