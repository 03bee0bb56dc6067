"""`dgemma::sample_step`: the vocabulary-wide region of a denoise step as one op.

The region is `sampler.sample_step` (the first-position mask of constrained rows, scale by 1/T, argmax, chunked inverse-CDF sample, entropy, self-conditioning
probabilities): every tensor of it that spans the vocabulary ([B, C, V], ~10 of them, 268 MB each in float32 at B=1
and the released vocabulary of 262,144) lives and dies inside it. The model never calls this op: the graph pass
`kernels/sample/fusion.py` recognises the region in a captured step and replaces it with the op, so the eager
generator keeps running `sampler.sample_step` itself (the oracle).

Implementations:
- CPU (and the default for any device without its own kernel): `sampler.sample_step` in plain torch, over slices
  of at most `position_chunk(V)` positions, so the region's transient memory is a slice's, not the whole canvas's.
  Positions are independent (each reduces over its own vocabulary row), so slicing changes no value.
- CUDA: the Triton kernel of `kernels/sample/triton_kernel.py` (`triton_sample_step`; imported at the first CUDA call,
  so triton is needed only there: without it the call raises, never falls back). The kernel reads the logits in
  their own dtype; a softcap is applied in torch per slice of positions first (in-kernel softcap: not yet).
  Unverified on a GPU so far (no device run); its kernel is tested on the CPU under TRITON_INTERPRET=1.

Legend: B rows, C canvas positions, V vocabulary.
"""

from __future__ import annotations

import torch

from ...step import sampler

CHUNK_BYTES = 16 * 2**20
"""Float32 logits bytes per slice of the CPU implementation: at V = 262,144 a slice is 16 positions. The reference
keeps ~8 slice-sized temporaries alive at once, so a slice costs ~128 MB of transient memory: 6% of the float32
logits at B = 8 (bench/passes.py memory)."""


def position_chunk(vocab_size: int) -> int:
    """Positions per slice of the CPU implementation: as many float32 vocabulary rows as fit in `CHUNK_BYTES`
    (at least one)."""
    return max(1, CHUNK_BYTES // (4 * max(vocab_size, 1)))


def _check(logits, temperature, greedy, uniform, allowed=None, constrained=None) -> None:
    if logits.dim() != 3 or not logits.dtype.is_floating_point:
        raise ValueError(f"dgemma::sample_step: logits must be a float [B, C, V] tensor, got {logits.dtype} "
                         f"{list(logits.shape)}")
    B, C, _ = logits.shape
    for name, t, shape, dtype in (("temperature", temperature, (B,), torch.float32),
                                  ("greedy", greedy, (B,), torch.bool), ("uniform", uniform, (B, C), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"dgemma::sample_step: {name} must be {dtype} {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")
    if (allowed is None) != (constrained is None):
        raise ValueError("dgemma::sample_step: allowed and constrained come together (the first-position mask)")
    if allowed is not None:
        W = -(-logits.shape[-1] // 32)
        for name, t, shape, dtype in (("allowed", allowed, (B, W), torch.int32),
                                      ("constrained", constrained, (B,), torch.bool)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"dgemma::sample_step: {name} must be {dtype} {list(shape)}, got {t.dtype} "
                                 f"{list(t.shape)}")


def _prologue(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits as the region reads them: float32, soft-capped (`DiffusionGemma.logits`) when `softcap` is given."""
    x = logits.float()
    return x if softcap is None else torch.tanh(x / softcap) * softcap


@torch.library.custom_op("dgemma::sample_step", mutates_args=())
def sample_step(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor,
                softcap: float | None = None, sc_dtype: torch.dtype | None = None,
                allowed: torch.Tensor | None = None, constrained: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sampler.sample_step` as one op: (argmax int64 [B, C], sampled int64 [B, C], entropy float32 [B, C],
    sc_probs [B, C, V] in `sc_dtype`, default float32).

    Args: logits float [B, C, V] (any float dtype; taken as float32, then soft-capped cap * tanh(x / cap) when
    `softcap` is given, as `DiffusionGemma.logits` does: the pass folds the model's own cast and softcap in, so the
    float32 logits never exist whole); temperature float32 [B]; greedy bool [B]; uniform float32 [B, C]; sc_dtype:
    the dtype the self-conditioning probabilities are written in (the pass folds the step's cast to the model dtype
    in); allowed int32 [B, ceil(V / 32)] and constrained bool [B] (both or neither): the first-position mask of
    constrained rows (`sampler.mask_first`, applied after the softcap, as the step does), per-row tensor data.
    Raises: ValueError naming the tensor whose dtype or shape is wrong.
    """
    _check(logits, temperature, greedy, uniform, allowed, constrained)
    sc_dtype = sc_dtype or torch.float32
    if constrained is not None and not bool(constrained.any()):  # the CPU's own sync: no row to mask, no mask work
        allowed = constrained = None

    def reference(x, T, g, u, words=None, first=None):
        out = sampler.sample_step(x, T, g, u, words, first)
        return out.argmax, out.sampled, out.entropy, out.sc_probs.to(sc_dtype)

    return in_slices(reference, logits, temperature, greedy, uniform, softcap, sc_dtype, allowed, constrained)


def in_slices(step, logits, temperature, greedy, uniform, softcap, sc_dtype, allowed=None, constrained=None):
    """The op over slices of `position_chunk(V)` positions: each slice's logits as [P, 1, V] rows (one per position,
    its row's temperature, greedy flag and uniform repeated), taken through `_prologue`, given to `step(x, T, g, u)`
    (the four outputs of a [P, 1, V] call, probabilities in `sc_dtype`), written into preallocated outputs; with a
    mask, `step(x, T, g, u, words, first)`: each position's row's bitmask and whether it is a constrained row's
    position 0 (the only position of a [P, 1, V] row, so `mask_first` masks exactly those). Returns them as
    [B, C] / [B, C, V]."""
    B, C, V = logits.shape
    dev = logits.device
    outs = (torch.empty(B * C, dtype=torch.int64, device=dev), torch.empty(B * C, dtype=torch.int64, device=dev),
            torch.empty(B * C, dtype=torch.float32, device=dev), torch.empty(B * C, 1, V, dtype=sc_dtype, device=dev))
    rows = logits.reshape(B * C, 1, V)
    T, g, u = temperature.repeat_interleave(C), greedy.repeat_interleave(C), uniform.reshape(B * C, 1)
    P = position_chunk(V)
    mask = ()
    if allowed is not None:
        first = (constrained[:, None] & (torch.arange(C, device=dev) == 0)[None, :]).reshape(B * C)
        mask = (allowed.repeat_interleave(C, dim=0), first)
    for s in range(0, B * C, P):
        part = step(_prologue(rows[s:s + P], softcap), T[s:s + P], g[s:s + P], u[s:s + P],
                    *(m[s:s + P] for m in mask))
        for out, piece in zip(outs, part):
            out[s:s + P] = piece.reshape(out[s:s + P].shape)
    return outs[0].view(B, C), outs[1].view(B, C), outs[2].view(B, C), outs[3].view(B, C, V)


def triton_sample_step(launch, logits, temperature, greedy, uniform, softcap=None, sc_dtype=None, allowed=None,
                       constrained=None):
    """The op through a Triton launcher `launch` (`kernels.sample.triton_kernel.sample_step_triton`'s signature): one launch
    over the whole [B, C, V] logits, or with `softcap`, one launch per slice (`in_slices`) over the slice's
    soft-capped float32 logits (so those never exist whole); the mask as the kernel's `allowed` / `constrained`
    (read in-kernel: no host sync, no [B, V] expansion). Returns the op's 4 outputs."""
    sc_dtype = sc_dtype or torch.float32
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernel reads rows with unit stride
    if softcap is None:
        return tuple(launch(logits, temperature, greedy, uniform, sc_dtype=sc_dtype, allowed=allowed,
                            constrained=constrained))
    return in_slices(lambda x, T, g, u, w=None, f=None: launch(x, T, g, u, sc_dtype=sc_dtype, allowed=w,
                                                              constrained=f),
                     logits, temperature, greedy, uniform, softcap, sc_dtype, allowed, constrained)


@sample_step.register_kernel("cuda")
def _(logits, temperature, greedy, uniform, softcap=None, sc_dtype=None, allowed=None, constrained=None):
    _check(logits, temperature, greedy, uniform, allowed, constrained)
    from .triton_kernel import sample_step_triton  # needs triton: an ImportError here is the message

    return triton_sample_step(sample_step_triton, logits, temperature, greedy, uniform, softcap, sc_dtype, allowed,
                              constrained)


@sample_step.register_fake
def _(logits, temperature, greedy, uniform, softcap=None, sc_dtype=None, allowed=None, constrained=None):
    _check(logits, temperature, greedy, uniform, allowed, constrained)
    B, C, V = logits.shape
    return (logits.new_empty(B, C, dtype=torch.int64), logits.new_empty(B, C, dtype=torch.int64),
            logits.new_empty(B, C, dtype=torch.float32), logits.new_empty(B, C, V, dtype=sc_dtype or torch.float32))
