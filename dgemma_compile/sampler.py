"""The denoise-step math as pure, batched tensor functions with per-row state.

Sources (transformers `generation_diffusion_gemma.py`): `LinearTemperatureScheduleLogitsProcessor`,
`EntropyBoundSampler.accept_canvas / renoise_canvas`, `StableAndConfidentStoppingCriteria`, and the per-row
freezing of `_denoising_step`. Random draws come in as tensors (see `StepNoise`), so one row's tokens depend only on
its own seed, never on the batch, and the step itself holds no host synchronisation.

Legend: B batch, C canvas, V vocab, P stability_threshold (history depth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, block: int, step: int) -> int:
    """Seed of a request's random stream for (block, step); step 0 is the block's start canvas. Counter-based, so
    a draw never depends on how many draws came before (frozen rows, batch mates, early stops)."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ block) ^ step) & ((1 << 63) - 1)


def _generator(seed: int, block: int, step: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, block, step))


def start_canvas(seed: int, block: int, canvas_length: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A block's starting canvas: int64 [C] uniform over the whole vocabulary [0, V)."""
    g = _generator(seed, block, 0, device)
    return torch.randint(0, vocab_size, (canvas_length,), generator=g, device=device)


@dataclass(frozen=True)
class StepNoise:
    """The random inputs of one denoise step for a batch.

    uniform: float32 [B, C] in [0, 1), one per position, for inverse-CDF sampling.
    renoise: int64 [B, C], fresh uniform tokens for positions that are not accepted.
    """

    uniform: torch.Tensor
    renoise: torch.Tensor


def step_noise(seeds: list[int], block: int, step: int, canvas_length: int, vocab_size: int,
               device: torch.device | str = "cpu") -> StepNoise:
    """Per-row draws for denoise step `step` (N..1) of `block`; row b uses only `seeds[b]`."""
    us, rs = [], []
    for s in seeds:
        g = _generator(s, block, step, device)
        us.append(torch.rand(canvas_length, generator=g, device=device))
        rs.append(torch.randint(0, vocab_size, (canvas_length,), generator=g, device=device))
    return StepNoise(uniform=torch.stack(us), renoise=torch.stack(rs))


def temperature(step: int, max_steps: int, t_min: float, t_max: float) -> float:
    """T = t_min + (t_max - t_min) * n / N at step n (counting down N..1)."""
    return t_min + (t_max - t_min) * (step / max_steps)


def entropy(logits_BCV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, float32 [B, C]; computed as torch.distributions.Categorical does."""
    logits = logits_BCV.float()
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    log_p = log_p.clamp(min=torch.finfo(log_p.dtype).min)
    return -(log_p * log_p.exp()).sum(-1)


def entropy_bound_accept(entropy_BC: torch.Tensor, bound: float | torch.Tensor) -> torch.Tensor:
    """bool [B, C]: sort entropies ascending and accept position j while (cumulative entropy up to and including
    j) - entropy_j <= bound. The lowest-entropy position is always accepted (arXiv 2505.24857)."""
    sorted_e, order = torch.sort(entropy_BC, dim=-1)
    accept_sorted = (torch.cumsum(sorted_e, dim=-1) - sorted_e) <= bound
    return torch.zeros_like(accept_sorted).scatter(-1, order, accept_sorted)


def sample_inverse_cdf(logits_BCV: torch.Tensor, uniform_BC: torch.Tensor) -> torch.Tensor:
    """One token per position from softmax(logits) by inverse CDF: the first id whose cumulative probability
    exceeds u * total. Exact categorical sampling with one uniform per position (Gumbel-max would need V)."""
    cdf = torch.cumsum(torch.softmax(logits_BCV.float(), dim=-1), dim=-1)
    target = (uniform_BC * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp(max=logits_BCV.shape[-1] - 1)


class StepUpdate(NamedTuple):
    """What one denoise step computes from the decoder's logits (see `denoise_update`).

    canvas, argmax: int64 [B, C]; history: int64 [P, B, C]; finished: bool [B]; scaled: float32 [B, C, V], the
    temperature-scaled logits (the next step's self-conditioning input).
    """

    canvas: torch.Tensor
    argmax: torch.Tensor
    history: torch.Tensor
    finished: torch.Tensor
    scaled: torch.Tensor


def denoise_update(canvas_BC: torch.Tensor, argmax_BC: torch.Tensor, history_PBC: torch.Tensor,
                   finished_B: torch.Tensor, logits_BCV: torch.Tensor, temperature_: float | torch.Tensor,
                   noise: StepNoise, *, entropy_bound: float | torch.Tensor,
                   confidence_threshold: float | torch.Tensor, stop_early: bool) -> StepUpdate:
    """Everything after the decoder in one denoise step, as a pure function of the current per-row state (canvas,
    argmax and history of the previous P argmax canvases, -1 before the first; finished rows). Rows already finished
    keep canvas and argmax frozen.

    Stopping (`StableAndConfidentStoppingCriteria`): argmax equal to each of the previous P argmax canvases (so never
    on a block's first step when P >= 1) and mean entropy of the scaled logits < confidence_threshold.
    """
    scaled = logits_BCV / temperature_
    sampled = sample_inverse_cdf(scaled, noise.uniform)
    argmax = scaled.argmax(dim=-1)
    ent = entropy(scaled)
    accepted = entropy_bound_accept(ent, entropy_bound)
    canvas = torch.where(accepted, sampled, noise.renoise)
    frozen = finished_B[:, None]
    argmax = torch.where(frozen, argmax_BC, argmax)
    canvas = torch.where(frozen, canvas_BC, canvas)
    history, finished = history_PBC, finished_B
    if stop_early:
        stable = (history == argmax[None]).all(dim=-1).all(dim=0)
        confident = ent.mean(dim=-1) < confidence_threshold
        finished = finished | (stable & confident)
        if history.shape[0]:
            history = torch.cat([history[1:], argmax[None]], dim=0)
    return StepUpdate(canvas=canvas, argmax=argmax, history=history, finished=finished, scaled=scaled)
