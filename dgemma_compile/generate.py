"""The eager reference block-diffusion generator: the oracle every compiled path is tested against.

The loop of transformers' `DiffusionGemmaGenerationMixin.generate` (REFERENCE.md, "The block-diffusion loop"):
prefill; per block: a uniform random canvas, denoise steps n = N..1 (temperature schedule, sampling, entropy-bound
acceptance, renoise, stable-and-confident stop with per-row frozen state), commit of the argmax canvas with an
encoder pass, eos -> pad. Two deliberate differences, each tested:
- `max_new_tokens` is exact (the block that crosses it is truncated); the reference rounds up to whole canvases.
- each request draws from its own counter-based random stream (`sampler.stream_seed`) and sampling uses one
  uniform per position (inverse CDF) instead of `torch.multinomial`, so a request's tokens depend only on its
  prompt and seed, never on its batch mates. Rows that finished are frozen instead of denoised further.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .config import ConfigError, GenerationConfig
from .model import DiffusionGemma
from .sampler import BlockState, denoise_update, start_canvas, step_noise, temperature


@dataclass
class RequestStats:
    """Per-request statistics. tokens_per_forward = generated tokens (eos included, pad excluded) / decoder passes."""

    num_tokens: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" or "length"

    @property
    def blocks(self) -> int:
        return len(self.steps_per_block)

    @property
    def decoder_passes(self) -> int:
        return sum(self.steps_per_block)

    @property
    def tokens_per_forward(self) -> float:
        return self.num_tokens / max(self.decoder_passes, 1)


@dataclass
class GenerationOutput:
    """sequences: generated token ids per request (prompt excluded, up to and including the first eos, no pad)."""

    sequences: list[list[int]]
    stats: list[RequestStats]


BlockCallback = Callable[[int, list[list[int]]], None]


def validate_prompts(model: DiffusionGemma, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Check and normalise prompts. Raises `ConfigError` naming the prompt and the problem."""
    cfg = model.config
    if len(prompts) == 0:
        raise ConfigError("prompts: no prompt given")
    out = []
    for i, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ConfigError(f"prompts[{i}]: empty prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= cfg.vocab_size for t in ids):
            raise ConfigError(f"prompts[{i}]: token ids must be integers in [0, {cfg.vocab_size})")
        if len(ids) >= cfg.max_position_embeddings:
            raise ConfigError(f"prompts[{i}]: {len(ids)} tokens, longer than the model's context "
                              f"({cfg.max_position_embeddings})")
        if len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise ConfigError(f"max_new_tokens: prompts[{i}] ({len(ids)} tokens) + {max_new_tokens} new tokens exceed "
                              f"the model's context ({cfg.max_position_embeddings})")
        out.append(ids)
    return out


def _seeds(seed: int | Sequence[int], n: int) -> list[int]:
    seeds = [seed] * n if isinstance(seed, int) and not isinstance(seed, bool) else list(seed)
    if len(seeds) != n or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds):
        raise ConfigError(f"seed: give one non-negative integer, or one per prompt ({n}), got {seed!r}")
    return seeds


@torch.no_grad()
def generate(model: DiffusionGemma, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None, *,
             seed: int | Sequence[int] = 0, on_block: BlockCallback | None = None) -> GenerationOutput:
    """Generate continuations of `prompts` (lists of token ids) by block diffusion, eagerly.

    Args:
        model: a loaded `DiffusionGemma`.
        prompts: B token-id sequences of any lengths (>= 1).
        config: generation parameters; default `model.generation_config` (or the reference defaults).
        seed: one seed for every request, or one per request. A request's output depends only on its prompt, its
            seed and the config.
        on_block: called after each committed block with (block index, per-request newly final token ids).
    Returns:
        `GenerationOutput` with sequences and per-request statistics.
    Raises:
        ConfigError: invalid config, seed or prompts (empty, ids outside the vocabulary, longer than the context).
    """
    cfg = (config or getattr(model, "generation_config", None) or GenerationConfig()).resolved(model.config)
    prompts = validate_prompts(model, prompts, cfg.max_new_tokens)
    seeds = _seeds(seed, len(prompts))
    dev, V, C = model.device, model.config.vocab_size, model.config.canvas_length
    B, N = len(prompts), cfg.max_denoising_steps
    num_blocks = math.ceil(cfg.max_new_tokens / C)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    T = int(lengths.max())
    cache = model.new_cache(B, T + (num_blocks - 1) * C)
    input_ids = torch.full((B, T), cfg.pad_token_id, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        input_ids[b, :len(p)] = torch.tensor(p, device=dev)
    model.encode(input_ids, cache, lengths)

    eos = torch.tensor(cfg.eos_token_ids, device=dev)
    sequences: list[list[int]] = [[] for _ in range(B)]
    stats = [RequestStats() for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    for block in range(num_blocks):
        canvas = torch.stack([start_canvas(s, block, C, V, dev) for s in seeds])
        state = BlockState.start(canvas, done, cfg.stability_threshold)
        steps = torch.zeros(B, dtype=torch.long, device=dev)
        sc_logits = None
        for n in range(N, 0, -1):
            steps += ~state.finished
            logits = model.denoise(state.canvas, cache, sc_logits)
            noise = step_noise(seeds, block, n, C, V, dev)
            state, scaled = denoise_update(state, logits, temperature(n, N, cfg.t_min, cfg.t_max), noise,
                                           entropy_bound=cfg.entropy_bound,
                                           confidence_threshold=cfg.confidence_threshold, stop_early=cfg.stop_early)
            sc_logits = scaled.to(model.dtype)
            if bool(state.finished.all()):
                break
        new_tokens = _finalize_block(state.argmax, done, eos, cfg, sequences, stats, steps)
        if on_block is not None:
            on_block(block, new_tokens)
        if bool(done.all()) or block == num_blocks - 1:
            break
        model.encode(state.argmax, cache, torch.where(done, 0, C))
    return GenerationOutput(sequences=sequences, stats=stats)


def _finalize_block(argmax_BC: torch.Tensor, done_B: torch.Tensor, eos: torch.Tensor, cfg: GenerationConfig,
                    sequences: list[list[int]], stats: list[RequestStats], steps_B: torch.Tensor) -> list[list[int]]:
    """Append each live row's block up to its first eos and its token budget; mark rows done (in place)."""
    new_tokens: list[list[int]] = []
    is_eos = torch.isin(argmax_BC, eos)
    for b in range(argmax_BC.shape[0]):
        if bool(done_B[b]):
            new_tokens.append([])
            continue
        row = argmax_BC[b].tolist()
        st = stats[b]
        st.steps_per_block.append(int(steps_B[b]))
        eos_at = int(is_eos[b].float().argmax()) if bool(is_eos[b].any()) else None
        keep = row[:eos_at + 1] if eos_at is not None else row
        room = cfg.max_new_tokens - st.num_tokens
        keep = keep[:room]
        sequences[b].extend(keep)
        st.num_tokens += len(keep)
        if eos_at is not None and eos_at < room:
            st.finish_reason, done_B[b] = "eos", True
        elif st.num_tokens >= cfg.max_new_tokens:
            st.finish_reason, done_B[b] = "length", True
        new_tokens.append(keep)
    return new_tokens
