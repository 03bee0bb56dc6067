"""What every generator shares about a batch of requests: the records a generation returns (`RequestStats`,
`GenerationOutput`), the host callbacks it calls (`BlockCallback`, `StopHook`), and the planning of a request batch
(`plan_requests`: configs, prompts, seeds and the committed slots a row needs), used by the oracle (`oracle.py`), the
compiled generator (`compile/generator.py`) and the serving engine (`dgemma_runtime.engine`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..model.backbone import DiffusionGemma
from ..model.config import CONTEXT_LENGTH, ConfigError, GenerationConfig
from .sampler import SCHEME


@dataclass
class RequestStats:
    """Per-request statistics. num_tokens counts generated tokens other than pad (eos included), as transformers'
    `_compute_tokens_per_forward` does; tokens_per_forward = num_tokens / decoder passes."""

    num_tokens: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos", "length" or "stop" (the stop hook ended the request)
    grammar_s: float = 0.0
    """A constrained request's host seconds in its grammar matcher (accepting blocks, next-token bitmasks); 0 else."""

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
    """sequences: generated token ids per request (prompt excluded, up to and including the first eos; nothing after
    it). Pad ids the model itself emitted before that are kept, and not counted in `RequestStats.num_tokens`."""

    sequences: list[list[int]]
    stats: list[RequestStats]
    forwards_per_block: list[int] = field(default_factory=list)
    """Denoise forwards the batch ran per block index (one forward serves every row; summed over the groups a
    compiled call is split into)."""
    wasted_forwards: list[int] = field(default_factory=list)
    """Per block: forwards run after every row had finished (frozen-only; see `stop_check.StopCheck`)."""
    commits: int = 0
    """Blocks committed by an encoder pass of their own (counted per request)."""
    fused_commits: int = 0
    """Blocks committed inside the next block's first denoise step (commit fusion; counted per request)."""
    fuse_commit: bool = False
    """Whether the generator fuses commits (`generate(fuse_commit=...)`, `CompileOptions.fuse_commit`): part of the
    numerics, with `moe_impl` and `scheme` (fused and separate commits differ by float reduction order)."""
    moe_impl: str = ""
    """The routed experts' implementation that ran (`kernels.moe.op.resolve_moe_impl`)."""
    scheme: str = SCHEME
    """The sampling numerics (`sampler.step_scheme`: `sampler.SCHEME`, or a tensor-parallel split's)."""


BlockCallback = Callable[[int, list[list[int]]], None]
"""on_block(block, new_tokens): after block `block` (0-based, counted per request) is final; new_tokens[i] holds the
token ids request i gained from it (empty for requests already done). i is the request's index in the call."""

StopHook = Callable[[int, list[list[int]]], Iterable[int]]
"""stop(block, new_tokens) -> indices of requests to end now, called right after `on_block` with the same arguments
(e.g. a stop string seen in the request's text). An ended request gets finish_reason "stop"; its sequence ends with
the block that triggered it (the caller trims text it does not want) and no further block is denoised for it.
The hook's verdict wins over eos or the budget ending the request in the same block; it applies only to requests
that finished block `block` in this call (others' indices are ignored: done earlier, or -- in the compiled
generator, where requests progress independently -- still running another block); an index outside the call
raises ValueError."""


def validate_prompts(model: DiffusionGemma, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int | Sequence[int]) -> list[list[int]]:
    """Check and normalise prompts (`max_new_tokens`: one budget, or one per prompt). Raises `ConfigError` naming the
    prompt and the problem."""
    cfg = model.config
    if len(prompts) == 0:
        raise ConfigError("prompts", "no prompt given")
    out = []
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for i, p in enumerate(prompts):
        max_new_tokens = budgets[i]
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ConfigError(f"prompts[{i}]", "empty prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= cfg.vocab_size for t in ids):
            raise ConfigError(f"prompts[{i}]", f"token ids must be integers in [0, {cfg.vocab_size})")
        if len(ids) >= cfg.max_position_embeddings:
            raise ConfigError(f"prompts[{i}]", f"{len(ids)} tokens, longer than the model's context "
                              f"({cfg.max_position_embeddings})", code=CONTEXT_LENGTH)
        if len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise ConfigError("max_new_tokens", f"prompts[{i}] ({len(ids)} tokens) + {max_new_tokens} new tokens exceed "
                              f"the model's context ({cfg.max_position_embeddings})", code=CONTEXT_LENGTH)
        out.append(ids)
    return out


def _seeds(seed: int | Sequence[int], n: int) -> list[int]:
    is_int = lambda s: isinstance(s, int) and not isinstance(s, bool)  # noqa: E731
    seeds = [seed] * n if is_int(seed) else list(seed) if isinstance(seed, (list, tuple)) else None
    if seeds is None or len(seeds) != n or any(not is_int(s) or not 0 <= s < 2**64 for s in seeds):
        raise ConfigError("seed", f"give one integer in [0, 2**64), or one per prompt ({n}), got {seed!r}")
    return seeds


STRUCTURAL = ("stability_threshold", "stop_early", "eos_token_ids", "pad_token_id")
"""GenerationConfig fields every request of one call must share (they shape the compiled step or the block loop);
the others (budgets, steps, temperatures, bounds) may differ per request."""


def resolve_configs(model: DiffusionGemma, config: GenerationConfig | Sequence[GenerationConfig] | None,
                    n: int) -> list[GenerationConfig]:
    """One resolved config per request: `config` is one for all, one per request, or None (the model's).

    Raises:
        ConfigError: a list of the wrong length, or requests that differ in a `STRUCTURAL` field.
    """
    default = model.generation_config
    if config is None or isinstance(config, GenerationConfig):
        return [(config or default).resolved(model.config)] * n
    cfgs = [(c or default).resolved(model.config) for c in config]
    if len(cfgs) != n:
        raise ConfigError("config", f"give one GenerationConfig, or one per prompt ({n}), got {len(cfgs)}")
    for name in STRUCTURAL:
        values = {getattr(c, name) for c in cfgs}
        if len(values) > 1:
            raise ConfigError("config", f"{name} must be the same for every request of a call, got {sorted(values)}")
    return cfgs


def plan_requests(model: DiffusionGemma, prompts: Sequence[Sequence[int]],
                  config: GenerationConfig | Sequence[GenerationConfig] | None, seed: int | Sequence[int]
                  ) -> tuple[list[GenerationConfig], list[list[int]], list[int], int]:
    """Resolve and validate a request batch: (one config per request, prompts as lists, seeds, committed slots
    needed per row: the longest prompt + max_new_tokens rounded up to whole canvases, the last block uncommitted).

    `config` is one config for every request, one per request, or None (the model's). `seed` is one seed (every request
    gets it) or one per request. The generators and the serving engine (`dgemma_runtime.engine`) validate
    with it.

    Raises:
        ConfigError: an empty prompt, ids outside the vocabulary, prompt + max_new_tokens beyond the model's
            context, a config list of the wrong length, a bad seed."""
    n = len(prompts) if hasattr(prompts, "__len__") else 0
    cfgs = resolve_configs(model, config, n)
    prompts = validate_prompts(model, prompts, [c.max_new_tokens for c in cfgs])
    seeds = _seeds(seed, len(prompts))
    C = model.config.canvas_length
    # the last block is never committed
    max_seq_len = max(len(p) + (math.ceil(c.max_new_tokens / C) - 1) * C for p, c in zip(prompts, cfgs))
    return cfgs, prompts, seeds, max_seq_len


def constrained_slots(prompts: Sequence[Sequence[int]], cfgs: Sequence[GenerationConfig], grammars: Sequence) -> int:
    """Committed slots a row needs at most for the constrained requests among these (0 if none): the prompt and every
    token but the last, since a constrained block commits only its kept prefix (any length up to C)."""
    return max([len(p) + c.max_new_tokens - 1 for p, c, g in zip(prompts, cfgs, grammars) if g is not None],
               default=0)


def check_slots(needed: int, max_seq_len: int, name: str) -> None:
    """Raise `ConfigError` (naming `name`) unless `max_seq_len` is a positive integer >= `needed` committed slots."""
    if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len <= 0:
        raise ConfigError("max_seq_len", f"must be a positive integer, got {max_seq_len!r}")
    if needed > max_seq_len:
        raise ConfigError("max_seq_len", f"these requests need {needed} committed slots per row, more than "
                          f"{name}={max_seq_len}", code=CONTEXT_LENGTH)
