"""Triton kernels of `dgemma::sample_step` (the CUDA implementation) and of the Philox streams it may draw from.

`sample_step_triton` computes what `sampler.sample_step` computes (the oracle; formulas and their sources are there),
one program per (row, position), reading the vocabulary in tiles of BLOCK_V ids:

1. max pass: m = max of the logits (float32);
2. main pass: the scaled logits s = clamp((x - m) / T) with a correctly rounded division, so s is bit-identical to
   the oracle's (`sampler._finite`); argmax = first id with s == 0 (the oracle's s has max exactly 0, so this is
   torch.argmax of s, exact ties and -0.0 included); per-chunk masses M_k = sum over chunk k of exp(s) (SAMPLE_CHUNK
   ids per chunk, `sampler.sample_chunked_icdf`), Z = sum M_k and A = sum exp(s) * s;
3. entropy H = log Z - A / Z: the same quantity as `sampler.entropy` (-sum p log p with log p = s - log Z), rearranged
   so it needs no further pass; both terms are >= 0 (s <= 0), so nothing cancels;
4. chunked inverse CDF: target = u * cum[K-1], chunk k = number of cumulative masses <= target, clamped to the last
   chunk of positive mass; a read of only that chunk finds the id the same way within it (clamped to its last id
   of positive mass); greedy rows: sampled = argmax, entropy 0;
5. write pass: the self-conditioning probabilities softmax(s) = exp(s) / Z (one-hot for greedy rows).

So the logits are read three times plus one chunk. An online max and sum (one read for 1-3) would save one read but
give up exactness: the terms would be exp((x - m_running) / T) rescaled, not the oracle's exp(s), and the argmax would
be taken on x, not on s. Keeping s exact makes argmax bit-identical and every mass the oracle's sum of the oracle's
terms in another order.

Exactness: argmax is bit-identical to the oracle; masses, cumulative sums, the entropy and the probabilities differ
in float32 rounding (summation order, and exp: numpy's in the interpreter, ex2.approx via tl.exp on a GPU), so
`sampled` can differ only where u * total lies within rounding of a cumulative boundary. The uniforms
(`philox_uniform`, or drawn in-kernel) are bit-identical to `rng.step_noise`'s.

Legend: B batch, C canvas, V vocab, K vocabulary chunks, N counters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...step import rng, sampler

MASKED_LOGIT: tl.constexpr = tl.constexpr(sampler.MASKED_LOGIT)

_FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
_M0 = tl.constexpr(rng.PHILOX_M[0])
_M1 = tl.constexpr(rng.PHILOX_M[1])
_W0 = tl.constexpr(rng.PHILOX_W[0])
_W1 = tl.constexpr(rng.PHILOX_W[1])
_LANE_SAMPLE = tl.constexpr(rng.LANE_SAMPLE)
SC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- Philox4x32-10 -------------------------------------------------------------------------------------------------

@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr = 10):
    """Philox4x32-ROUNDS on uint32 words (tensors or scalars, broadcasting): the round function of `rng.philox4x32`
    with native 32-bit wrap-around and tl.umulhi for the high word. Returns the output words (w0, w1, w2, w3)."""
    for _ in tl.static_range(ROUNDS):
        hi0, lo0 = tl.umulhi(c0, _M0), c0 * _M0
        hi1, lo1 = tl.umulhi(c2, _M1), c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + _W0, k1 + _W1  # the bump after the last round is never used
    return c0, c1, c2, c3


@triton.jit
def _u32(x):
    """Low 32 bits of an int64 as uint32 (`rng`'s `& _MASK32`)."""
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def sample_uniform(seed, block, step, pos):
    """`rng.step_noise`'s uniform: to_uniform(w0) of counter (block, step, pos, LANE_SAMPLE) under key (seed low,
    seed high). seed, block, step, pos: int64 (scalars or tensors). Returns float32 in [0, 1)."""
    u32pos = _u32(pos)
    w0, _, _, _ = philox4x32(_u32(block) + u32pos * 0, _u32(step) + u32pos * 0, u32pos, u32pos * 0 + _LANE_SAMPLE,
                             _u32(seed), _u32(seed >> 32))
    return (w0 >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24, `rng.to_uniform`


@triton.jit
def _philox_words_kernel(ctr_ptr, key_ptr, out_ptr, N, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    i64 = i.to(tl.int64)
    c0 = _u32(tl.load(ctr_ptr + 4 * i64, mask=ok, other=0))
    c1 = _u32(tl.load(ctr_ptr + 4 * i64 + 1, mask=ok, other=0))
    c2 = _u32(tl.load(ctr_ptr + 4 * i64 + 2, mask=ok, other=0))
    c3 = _u32(tl.load(ctr_ptr + 4 * i64 + 3, mask=ok, other=0))
    k0 = _u32(tl.load(key_ptr + 2 * i64, mask=ok, other=0))
    k1 = _u32(tl.load(key_ptr + 2 * i64 + 1, mask=ok, other=0))
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS)
    tl.store(out_ptr + 4 * i64, w0.to(tl.int64), mask=ok)
    tl.store(out_ptr + 4 * i64 + 1, w1.to(tl.int64), mask=ok)
    tl.store(out_ptr + 4 * i64 + 2, w2.to(tl.int64), mask=ok)
    tl.store(out_ptr + 4 * i64 + 3, w3.to(tl.int64), mask=ok)


@triton.jit
def _philox_uniform_kernel(seed_ptr, block_ptr, step_ptr, block_stride, step_stride, out_ptr, C,
                           BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    u = sample_uniform(tl.load(seed_ptr + row), tl.load(block_ptr + row * block_stride),
                       tl.load(step_ptr + row * step_stride), pos.to(tl.int64))
    tl.store(out_ptr + row.to(tl.int64) * C + pos, u, mask=pos < C)


def _check(x: object, name: str, dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int | None, ...], ...],
           device: torch.device | None = None) -> torch.Tensor:
    """x itself, or ValueError naming `name`; a None in `shapes` matches any size."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if not any(x.dim() == len(s) and all(n in (None, m) for n, m in zip(s, x.shape)) for s in shapes):
        want = " or ".join(str(list("?" if n is None else n for n in s)) for s in shapes)
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    return x


def philox4x32_triton(counter: torch.Tensor, key: torch.Tensor, rounds: int = rng.PHILOX_ROUNDS) -> torch.Tensor:
    """The `philox4x32` device function over N counters: int64 [N, 4] counters and [N, 2] keys (each word taken
    modulo 2**32, as `rng.philox4x32`) -> int64 [N, 4] words in [0, 2**32), bit-identical to `rng.philox4x32`.
    Raises ValueError for a wrong dtype, shape or device, or rounds < 1."""
    counter = _check(counter, "counter", (torch.int64,), ((None, 4),))
    key = _check(key, "key", (torch.int64,), ((counter.shape[0], 2),), counter.device)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    n = counter.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=counter.device)
    if n:
        _philox_words_kernel[(triton.cdiv(n, 128),)](counter.contiguous(), key.contiguous(), out, n, ROUNDS=rounds,
                                                     BLOCK=128)
    return out


def _check_noise_index(seeds: object, block: object, step: object, device: torch.device | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seeds = _check(seeds, "seeds", (torch.int64,), ((None,),), device)
    batch = seeds.shape[0]
    block = _check(block, "block", (torch.int64,), ((), (batch,)), seeds.device)
    step = _check(step, "step", (torch.int64,), ((), (batch,)), seeds.device)
    return seeds.contiguous(), block.reshape(-1).contiguous(), step.reshape(-1).contiguous()


def philox_uniform(seeds_B: torch.Tensor, block: torch.Tensor, step: torch.Tensor, canvas_length: int
                   ) -> torch.Tensor:
    """`rng.step_noise`'s uniforms computed on the device: float32 [B, C] in [0, 1), bit-identical.

    seeds_B: int64 [B] (`rng.seed_tensor`); block, step: int64 0-d or [B]; canvas_length C >= 1. Raises ValueError
    naming the argument for a wrong type, dtype, shape or device.
    """
    seeds_B, block, step = _check_noise_index(seeds_B, block, step)
    if not isinstance(canvas_length, int) or canvas_length < 1:
        raise ValueError(f"canvas_length: expected an int >= 1, got {canvas_length!r}")
    B, C = seeds_B.shape[0], canvas_length
    out = torch.empty(B, C, dtype=torch.float32, device=seeds_B.device)
    block_c = min(triton.next_power_of_2(C), 1024)
    if B:
        _philox_uniform_kernel[(B, triton.cdiv(C, block_c))](seeds_B, block, step, int(block.numel() > 1),
                                                            int(step.numel() > 1), out, C, BLOCK_C=block_c)
    return out


# --- sample_step ---------------------------------------------------------------------------------------------------

@triton.jit
def _scaled(x, m, t):
    """`sampler.sample_step`'s scaled logits: clamp((x - m) / t) to float32's finite range, division rounded to
    nearest as torch's."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x - m, t), -_FP32_MAX), _FP32_MAX)


@triton.jit
def _to_out(p, out_ptr, OUT_BF16: tl.constexpr):
    """Float32 values in [0, 1] -> out_ptr's dtype, rounded to nearest even. For bfloat16 the rounding is spelled out
    on the bits (x + 0x7FFF + lsb, keep the high half; exact for finite values) because Triton's interpreter truncates
    a float32 -> bfloat16 cast, while torch and the GPU round to nearest."""
    if OUT_BF16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return p.to(out_ptr.dtype.element_ty)


@triton.jit
def _load_x(x_ptr, v, ok, words_ptr, masked, HAS_MASK: tl.constexpr):
    """Logits v of one position as float32 (-inf where not `ok`); with the first-position mask (`masked`: a
    constrained row's position 0), MASKED_LOGIT where its bitmask word's bit v % 32 is clear (`sampler.mask_first`)."""
    x = tl.load(x_ptr + v, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        word = tl.load(words_ptr + v // 32, mask=ok & masked, other=-1)
        x = tl.where(ok & masked & (((word >> (v % 32)) & 1) == 0), MASKED_LOGIT, x)
    return x


@triton.jit
def _sample_step_kernel(logits_ptr, stride_b, stride_c, t_ptr, greedy_ptr, u_ptr,
                        seed_ptr, block_ptr, step_ptr, block_stride, step_stride,
                        allowed_ptr, W, constrained_ptr,
                        argmax_ptr, sampled_ptr, entropy_ptr, probs_ptr, C, V, CHUNK, K,
                        K_PAD: tl.constexpr, BLOCK_V: tl.constexpr, PHILOX: tl.constexpr, OUT_BF16: tl.constexpr,
                        HAS_MASK: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.program_id(1)
    x_ptr = logits_ptr + row.to(tl.int64) * stride_b + pos.to(tl.int64) * stride_c
    out_ptr = probs_ptr + (row.to(tl.int64) * C + pos) * V
    lanes = tl.arange(0, BLOCK_V)
    greedy = tl.load(greedy_ptr + row) != 0
    t = tl.where(greedy, 1.0, tl.load(t_ptr + row))
    words_ptr = allowed_ptr + row.to(tl.int64) * W
    masked = False
    if HAS_MASK:
        masked = (tl.load(constrained_ptr + row) != 0) & (pos == 0)

    # 1. the max
    m = tl.full([], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = _load_x(x_ptr, v0 + lanes, v0 + lanes < V, words_ptr, masked, HAS_MASK)
        m = tl.maximum(m, tl.max(x, 0))

    # 2. scaled logits s, argmax, per-chunk masses, sum of exp(s) * s
    kid = tl.arange(0, K_PAD)
    mass_K = tl.zeros([K_PAD], tl.float32)
    sum_es = tl.zeros([], tl.float32)
    argmax = tl.zeros([], tl.int32) + V
    for k in range(K):
        mass = tl.zeros([], tl.float32)
        for j0 in range(0, CHUNK, BLOCK_V):
            j = j0 + lanes
            v = k * CHUNK + j
            ok = (j < CHUNK) & (v < V)
            s = _scaled(_load_x(x_ptr, v, ok, words_ptr, masked, HAS_MASK), m, t)
            e = tl.where(ok, tl.exp(s), 0.0)
            mass += tl.sum(e, 0)
            sum_es += tl.sum(e * s, 0)
            argmax = tl.minimum(argmax, tl.min(tl.where(ok & (s == 0.0), v, V), 0))
        mass_K = tl.where(kid == k, mass, mass_K)

    # 3. entropy
    total = tl.sum(mass_K, 0)
    ent = tl.log(total) - sum_es / total

    # 4. chunked inverse CDF: the chunk from the cumulative masses, then the id within it (a second read of one chunk)

    if PHILOX:
        u = sample_uniform(tl.load(seed_ptr + row), tl.load(block_ptr + row * block_stride),
                           tl.load(step_ptr + row * step_stride), pos.to(tl.int64))
    else:
        u = tl.load(u_ptr + row * C + pos)
    cum_K = tl.cumsum(mass_K, 0)
    target = u * tl.sum(tl.where(kid == K - 1, cum_K, 0.0), 0)
    kc = tl.sum(((cum_K <= target) & (kid < K)).to(tl.int32), 0)
    kc = tl.minimum(kc, tl.max(tl.where(mass_K > 0.0, kid, 0), 0))
    rest = target - tl.sum(tl.where(kid == kc - 1, cum_K, 0.0), 0)

    below = tl.zeros([], tl.int32)  # ids of chunk kc whose cumulative exp is <= rest
    last = tl.zeros([], tl.int32)  # last id of chunk kc with positive mass (0 if none)
    acc = tl.zeros([], tl.float32)
    for j0 in range(0, CHUNK, BLOCK_V):
        j = j0 + lanes
        v = kc * CHUNK + j
        ok = (j < CHUNK) & (v < V)
        e = tl.where(ok, tl.exp(_scaled(_load_x(x_ptr, v, ok, words_ptr, masked, HAS_MASK), m, t)), 0.0)
        below += tl.sum((ok & (acc + tl.cumsum(e, 0) <= rest)).to(tl.int32), 0)
        last = tl.maximum(last, tl.max(tl.where(e > 0.0, j, 0), 0))
        acc += tl.sum(e, 0)
    sampled = kc * CHUNK + tl.minimum(below, last)

    out = row * C + pos
    tl.store(argmax_ptr + out, argmax.to(tl.int64))
    tl.store(sampled_ptr + out, tl.where(greedy, argmax, sampled).to(tl.int64))
    tl.store(entropy_ptr + out, tl.where(greedy, 0.0, ent))

    # 5. self-conditioning probabilities exp(s) / Z (one-hot for greedy rows)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + lanes
        ok = v < V
        s = _scaled(_load_x(x_ptr, v, ok & ~greedy, words_ptr, masked, HAS_MASK), m, t)
        p = tl.where(greedy, tl.where(v == argmax, 1.0, 0.0), tl.math.div_rn(tl.exp(s), total))
        tl.store(out_ptr + v, _to_out(p, out_ptr, OUT_BF16), mask=ok)


def sample_step_triton(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                       uniform: torch.Tensor | None = None, *, seeds: torch.Tensor | None = None,
                       block: torch.Tensor | None = None, step: torch.Tensor | None = None,
                       sc_dtype: torch.dtype = torch.float32, block_v: int = 1024,
                       allowed: torch.Tensor | None = None, constrained: torch.Tensor | None = None
                       ) -> sampler.SampleStep:
    """`sampler.sample_step` as one Triton kernel launch: argmax, sampled int64 [B, C]; entropy float32 [B, C];
    sc_probs `sc_dtype` [B, C, V] (softmax of the scaled logits; one-hot for greedy rows).

    Args: logits float32/bfloat16/float16 [B, C, V] with unit stride along V; temperature float32 [B]; greedy bool
    [B]; and either uniform float32 [B, C] in [0, 1) or the stream index to draw it in-kernel, bit-identical to
    `rng.step_noise`: seeds int64 [B], block and step int64 0-d or [B]. sc_dtype: float32 (the oracle's) or
    bfloat16/float16 (the float32 probabilities rounded to nearest even). block_v: vocabulary tile, a power of two in
    [16, 4096]. allowed int32 [B, ceil(V / 32)] and constrained bool [B] (both or neither): the first-position mask
    of constrained rows (`sampler.mask_first`), read in-kernel per row (no [B, V] expansion; rows without the flag
    read no bitmask word).

    Raises ValueError naming the argument for a wrong type, dtype, shape or device, for both or neither of `uniform`
    and `seeds`, or for V > 2**30 (int32 ids). The module docstring says what is exact and what rounds differently.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits: expected a [B, C, V] tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    B, C, V = logits.shape
    dev = logits.device
    _check(logits, "logits", LOGIT_DTYPES, ((B, C, V),))
    if V < 1 or V > 2**30 or (logits.stride(-1) != 1 and V > 1):
        raise ValueError(f"logits: expected 1 <= V <= 2**30 and unit stride along V, got shape {list(logits.shape)} "
                         f"and strides {logits.stride()}")
    temperature = _check(temperature, "temperature", (torch.float32,), ((B,),), dev).contiguous()
    greedy = _check(greedy, "greedy", (torch.bool,), ((B,),), dev).contiguous()
    if (uniform is None) == (seeds is None):
        raise ValueError("uniform: pass either uniform or (seeds, block, step), not both and not neither")
    philox = seeds is not None
    if not philox:
        if block is not None or step is not None:
            raise ValueError("block/step: only with seeds")
        uniform = _check(uniform, "uniform", (torch.float32,), ((B, C),), dev).contiguous()
        seeds = block = step = torch.zeros(1, dtype=torch.int64, device=dev)
    else:
        seeds, block, step = _check_noise_index(seeds, block, step, dev)
        if seeds.shape[0] != B:
            raise ValueError(f"seeds: expected shape [{B}], got {list(seeds.shape)}")
        uniform = torch.zeros(1, dtype=torch.float32, device=dev)
    if sc_dtype not in SC_DTYPES:
        raise ValueError(f"sc_dtype: expected one of {SC_DTYPES}, got {sc_dtype}")
    if not isinstance(block_v, int) or block_v < 16 or block_v > 4096 or block_v & (block_v - 1):
        raise ValueError(f"block_v: expected a power of two in [16, 4096], got {block_v!r}")
    if (allowed is None) != (constrained is None):
        raise ValueError("allowed/constrained: pass both (the first-position mask) or neither")
    has_mask = allowed is not None
    W = -(-V // 32)
    if has_mask:
        allowed = _check(allowed, "allowed", (torch.int32,), ((B, W),), dev).contiguous()
        constrained = _check(constrained, "constrained", (torch.bool,), ((B,),), dev).contiguous()
    else:
        allowed = torch.zeros(1, dtype=torch.int32, device=dev)
        constrained = torch.zeros(1, dtype=torch.bool, device=dev)

    chunk = min(sampler.SAMPLE_CHUNK, V)
    K = -(-V // chunk)
    argmax = torch.empty(B, C, dtype=torch.int64, device=dev)
    sampled = torch.empty_like(argmax)
    entropy = torch.empty(B, C, dtype=torch.float32, device=dev)
    sc_probs = torch.empty(B, C, V, dtype=sc_dtype, device=dev)
    if B * C:
        _sample_step_kernel[(B, C)](
            logits, logits.stride(0), logits.stride(1), temperature, greedy, uniform,
            seeds, block, step, int(block.numel() > 1), int(step.numel() > 1),
            allowed, W, constrained,
            argmax, sampled, entropy, sc_probs, C, V, chunk, K,
            K_PAD=triton.next_power_of_2(K), BLOCK_V=min(block_v, triton.next_power_of_2(chunk)),
            PHILOX=philox,
            OUT_BF16=sc_dtype == torch.bfloat16, HAS_MASK=has_mask)
    return sampler.SampleStep(argmax, sampled, entropy, sc_probs)
