"""Counter-based random streams (Philox4x32-10) in plain torch integer ops.

Every random number of a generation is a pure function of (seed, block, step, position, lane): a denoise step
draws all its noise from device tensors (no torch.Generator, no host work per step), and a row's draws never
depend on its batch mates. Only integer tensor ops, so the results are bit-identical wherever the step runs, and
this is the oracle that a future Triton kernel must reproduce bit for bit.

Algorithm: Philox4x32-10 from J. K. Salmon, M. A. Moraes, R. O. Dror, D. E. Shaw, "Parallel random numbers:
as easy as 1, 2, 3", SC'11, checked against the known-answer vectors of the Random123 library
(`tests/kat_vectors`). CPU torch has no uint32 add/shift/mulhi, so 32-bit words live in int64 tensors with
values in [0, 2**32), and each 32x32->64-bit product is split into two 32x16-bit products (< 2**48), so no
int64 ever overflows (signed overflow is undefined behaviour in C and C++ code generated from these ops).

Stream layout (THE table; one Philox4x32-10 call per counter, output words w0..w3):

| Philox input | value                                                                             |
|--------------|-----------------------------------------------------------------------------------|
| key[0]       | low 32 bits of the request's 64-bit seed                                          |
| key[1]       | high 32 bits of the seed                                                          |
| counter[0]   | block index within the request (mod 2**32)                                        |
| counter[1]   | step: 0 = the block's start canvas; n = N, N-1, ..., 1 = denoise step n (mod 2**32) |
| counter[2]   | canvas position 0 .. C-1                                                          |
| counter[3]   | lane, naming the stream (below)                                                   |

| lane                          | step   | stream                                         | value                           |
|-------------------------------|--------|------------------------------------------------|---------------------------------|
| LANE_START_CANVAS = 0         | 0      | token id of the start canvas                   | to_token(w0, V)                 |
| LANE_SAMPLE = 1               | N .. 1 | uniform used to sample a position              | to_uniform(w0)                  |
| LANE_RENOISE = 2              | N .. 1 | fresh token id for a rejected position         | to_token(w0, V)                 |
| 3 .. 15                       |        | reserved, unused                               |                                 |
| LANE_VOCAB_BASE + (v >> 2)    | N .. 1 | reserved for a chunked sampler: the uniform of | to_uniform(w[v & 3])            |
|   (LANE_VOCAB_BASE = 16)      |        | vocabulary id v at this position (4 ids/call)  |                                 |

`step_streams` draws the start canvas and a step's two lanes in one Philox call (what `mixed_step.mixed_step` draws;
uncompiled on CPU from NumPy's exact uint64 products, the same words).
Words w1..w3 of lanes 0..15 are unused. The vocabulary lanes give every (position, vocabulary id) its own word
whatever chunk size a kernel tiles the vocabulary with: a chunk [v0, v0 + K) with 4 | v0 and 4 | K reads
lanes LANE_VOCAB_BASE + v0/4 .. LANE_VOCAB_BASE + (v0 + K)/4 - 1. No function here draws them yet.

Seeds are an int64 [B] tensor holding each 64-bit seed (in [0, 2**64)) as its two's-complement bit pattern
(`seed_tensor` builds it from Python ints). Block and step are int64 tensors, 0-d or [B], never Python ints,
so their values are data, never constants baked into the step. Tensor legend: _B batch rows, _C canvas positions, _L lanes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import torch

from ..model.config import ConfigError

LANE_START_CANVAS = 0
LANE_SAMPLE = 1
LANE_RENOISE = 2
LANE_VOCAB_BASE = 16

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Weyl key increments
PHILOX_ROUNDS = 10
MAX_VOCAB = 2**31  # (2**32 - 1) * 2**31 < 2**63: the multiply-shift never overflows int64

_MASK32 = 0xFFFFFFFF


def _check_int64(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
        raise ValueError(f"{name}: expected an int64 tensor, got {type(x).__name__}"
                         + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    return x


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = PHILOX_ROUNDS) -> torch.Tensor:
    """Philox4x32-`rounds` (Salmon et al., SC'11; Random123) on int64 tensors emulating uint32 words.

    counter: int64 [..., 4], key: int64 [..., 2]; each word is taken modulo 2**32. Leading dims broadcast.
    Returns int64 [broadcast(...), 4] with values in [0, 2**32), bit-identical to Random123's
    `philox4x32_R(rounds, ctr, key)` (word i of the tensor = element i of the r123array).
    Raises ValueError for a non-int64 tensor, a wrong last dim or rounds < 1.
    """
    _check_int64(counter, "counter")
    _check_int64(key, "key")
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError(f"counter/key: expected last dims 4 and 2, got {tuple(counter.shape)}, {tuple(key.shape)}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an int >= 1, got {rounds!r}")
    even, odd = _rounds(counter, key, rounds)
    return torch.stack(torch.broadcast_tensors(even[..., 0], odd[..., 0], even[..., 1], odd[..., 1]), dim=-1)


def _rounds(counter: torch.Tensor, key: torch.Tensor, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`philox4x32`'s rounds on checked inputs: its output words as (w0, w2) and (w1, w3), [..., 2] each."""
    dev = counter.device
    c = counter & _MASK32
    # the two words each round multiplies, as (c2, c0), and the other two, as (c1, c3): one tensor op then serves
    # both halves of the round (a few dozen tensor ops per call instead of a few hundred: what an eager step pays)
    mul = c.flip(-1)[..., 1::2]
    odd = c[..., 1::2]
    m = torch.tensor((PHILOX_M[1], PHILOX_M[0]), dtype=torch.int64, device=dev)
    m_hi, m_lo = m >> 16, m & 0xFFFF  # each product as two 32x16-bit products (< 2**48): no int64 overflows
    bumps = torch.arange(rounds, dtype=torch.int64, device=dev)[:, None] * torch.tensor(PHILOX_W, device=dev)
    keys = (((key & _MASK32).unsqueeze(-2) + bumps) & _MASK32).unbind(-2)  # per round, (k0, k1) [..., 2]
    for r in range(rounds):
        if r:
            mul = even.flip(-1)
        hi_part, lo_part = mul * m_hi, mul * m_lo  # mul * m = hi_part * 2**16 + lo_part
        t = ((hi_part & 0xFFFF) << 16) + lo_part  # < 2**49; mul * m = (hi_part >> 16) * 2**32 + t
        even = ((hi_part >> 16) + (t >> 32)) ^ odd ^ keys[r]  # (hi(c2) ^ c1 ^ k0, hi(c0) ^ c3 ^ k1): c0', c2'
        odd = t & _MASK32  # (lo(c2), lo(c0)): c1', c3'
    return even, odd


def to_uniform(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (int64, values in [0, 2**32)) -> float32 uniforms in [0, 1), same shape.

    u = (w >> 8) * 2**-24: the top 24 bits, so every value k * 2**-24 (k = 0 .. 2**24 - 1) is exactly
    representable and has probability exactly 2**-24; u is never 1.0 (max 1 - 2**-24) and is 0.0 with
    probability 2**-24 (use 1 - u where a strictly positive value is needed). Bias: none on that grid; the
    CDF differs from the continuous U[0, 1) by at most 2**-24 and the mean is 1/2 - 2**-25.
    """
    return ((words & _MASK32) >> 8).to(torch.float32) * (2.0**-24)


def to_token(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit words (int64, values in [0, 2**32)) -> token ids in [0, vocab_size), int64, same shape.

    Multiply-shift (D. Lemire, "Fast random integer generation in an interval", 2019, without the rejection
    step): id = (w * V) >> 32. Id k receives floor(2**32 / V) or ceil(2**32 / V) of the 2**32 words, so
    |P(k) - 1/V| < 2**-32 (relative error < V / 2**32, e.g. 2.3e-7 at V = 1000); exact when V is a power of
    two (V = 262144 = 2**18 included). Supported V: 1 .. MAX_VOCAB = 2**31, where w * V < 2**63 fits int64.
    Raises ValueError for V outside that range or not an int.
    """
    _check_vocab(vocab_size)
    return ((words & _MASK32) * vocab_size) >> 32


def _check_vocab(vocab_size: object) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size: expected an int in [1, {MAX_VOCAB}], got {vocab_size!r}")


def seed_tensor(seeds: Iterable[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Python int seeds in [0, 2**64) -> int64 [B] tensor of their two's-complement bit patterns.

    Raises ConfigError naming `seed` for a non-iterable, a non-integer or bool element, or a value outside
    [0, 2**64).
    """
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Iterable):
        raise ConfigError("seed", f"expected a sequence of ints, got {type(seeds).__name__}")
    bits = []
    for s in seeds:
        if not isinstance(s, numbers.Integral) or isinstance(s, bool):
            raise ConfigError("seed", f"expected an int, got {type(s).__name__} {s!r}")
        s = int(s)
        if not 0 <= s < 2**64:
            raise ConfigError("seed", f"must be in [0, 2**64), got {s}")
        bits.append(s - 2**64 if s >= 2**63 else s)
    return torch.tensor(bits, dtype=torch.int64, device=device)


def _check_index(x: object, batch: int, name: str) -> torch.Tensor:
    x = _check_int64(x, name)
    if x.dim() == 0:
        return x.reshape(1, 1, 1)
    if x.shape != (batch,):
        raise ValueError(f"{name}: expected shape [] or [{batch}], got {list(x.shape)}")
    return x.reshape(batch, 1, 1)


def stream_words(seeds_B: torch.Tensor, block: torch.Tensor, step: torch.Tensor, canvas_length: int,
                 lanes: Sequence[int]) -> torch.Tensor:
    """The raw Philox output of the layout table: int64 [B, C, L, 4] with values in [0, 2**32).

    out[b, c, l, i] = word i of philox4x32(counter=(block[b], step[b], c, lanes[l]),
    key=(seed[b] low word, seed[b] high word)). seeds_B: int64 [B] (see `seed_tensor`); block, step: int64
    0-d or [B]; canvas_length C >= 1 and lanes (ints in [0, 2**32)) are static. Raises ValueError otherwise.
    """
    seeds_B = _check_int64(seeds_B, "seeds")
    if seeds_B.dim() != 1:
        raise ValueError(f"seeds: expected shape [B], got {list(seeds_B.shape)}")
    if not isinstance(canvas_length, int) or canvas_length < 1:
        raise ValueError(f"canvas_length: expected an int >= 1, got {canvas_length!r}")
    if not lanes or any(not isinstance(l, int) or not 0 <= l <= _MASK32 for l in lanes):
        raise ValueError(f"lanes: expected a non-empty sequence of ints in [0, 2**32), got {lanes!r}")
    batch = seeds_B.shape[0]
    lane_11L = torch.tensor(list(lanes), dtype=torch.int64, device=seeds_B.device).reshape(1, 1, -1)
    return _words(seeds_B, _check_index(block, batch, "block"), _check_index(step, batch, "step"), canvas_length,
                  lane_11L)


def _words(seeds_B: torch.Tensor, block_B11: torch.Tensor, step_B1L: torch.Tensor, canvas_length: int,
           lane_11L: torch.Tensor, first_only: bool = False) -> torch.Tensor:
    """`stream_words` from checked inputs, the step given per lane ([B or 1, 1, L or 1]): int64 [B, C, L, 4], or
    with `first_only` word w0 alone, [B, C, L]."""
    pos_1C1 = torch.arange(canvas_length, dtype=torch.int64, device=seeds_B.device).reshape(1, -1, 1)
    counter = torch.stack(torch.broadcast_tensors(block_B11, step_B1L, pos_1C1, lane_11L), dim=-1)
    key_B112 = torch.stack((seeds_B & _MASK32, (seeds_B >> 32) & _MASK32), dim=-1).reshape(-1, 1, 1, 2)
    if first_only:
        return _rounds(counter, key_B112, PHILOX_ROUNDS)[0][..., 0]
    return philox4x32(counter, key_B112)


def start_canvas(seeds_B: torch.Tensor, block: torch.Tensor, canvas_length: int, vocab_size: int) -> torch.Tensor:
    """The block's start canvas: int64 [B, C] token ids in [0, vocab_size), from lane LANE_START_CANVAS, step 0.

    seeds_B: int64 [B]; block: int64 0-d or [B]. Raises ValueError for bad shapes/dtypes, canvas_length < 1
    or vocab_size outside [1, MAX_VOCAB].
    """
    step = torch.zeros((), dtype=torch.int64, device=seeds_B.device)
    words_BC = stream_words(seeds_B, block, step, canvas_length, (LANE_START_CANVAS,))[:, :, 0, 0]
    return to_token(words_BC, vocab_size)


def step_noise(seeds_B: torch.Tensor, block: torch.Tensor, step: torch.Tensor, canvas_length: int,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All noise of denoise step `step` (N .. 1) of a block, in one Philox call per (row, position, lane).

    Returns (uniform float32 [B, C] in [0, 1) from LANE_SAMPLE, renoise int64 [B, C] in [0, vocab_size) from
    LANE_RENOISE). seeds_B: int64 [B]; block, step: int64 0-d or [B] (step 0 is the start canvas's counter;
    its lanes differ, so a step-0 call would still not repeat the start canvas). Raises ValueError as
    `start_canvas`.
    """
    words_BC2 = stream_words(seeds_B, block, step, canvas_length, (LANE_SAMPLE, LANE_RENOISE))[..., 0]
    return to_uniform(words_BC2[..., 0]), to_token(words_BC2[..., 1], vocab_size)


def step_streams(seeds_B: torch.Tensor, block: torch.Tensor, step: torch.Tensor, canvas_length: int,
                 vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`start_canvas(seeds_B, block, C, V)` and `step_noise(seeds_B, block, step, C, V)` from one Philox call over
    their three lanes, each lane at its own counter of the layout table (the start canvas at step 0), so the same
    words: (start int64 [B, C], uniform float32 [B, C], renoise int64 [B, C]). What a mixed step draws (a row may
    begin a block and another step a canvas in one iteration); one call instead of two halves the tensor ops an
    eager step pays for its noise; uncompiled on CPU, computed in NumPy's uint64 (`_step_streams_numpy`, the same
    bits). Raises ValueError as `start_canvas`.
    """
    seeds_B = _check_int64(seeds_B, "seeds")
    if seeds_B.dim() != 1:
        raise ValueError(f"seeds: expected shape [B], got {list(seeds_B.shape)}")
    if not isinstance(canvas_length, int) or canvas_length < 1:
        raise ValueError(f"canvas_length: expected an int >= 1, got {canvas_length!r}")
    batch = seeds_B.shape[0]
    block_B11, step_B11 = _check_index(block, batch, "block"), _check_index(step, batch, "step")
    _check_vocab(vocab_size)
    if seeds_B.device.type == "cpu" and not torch.compiler.is_compiling():
        return _step_streams_numpy(seeds_B, block_B11, step_B11, canvas_length, vocab_size)
    lane_11L = torch.tensor((LANE_START_CANVAS, LANE_SAMPLE, LANE_RENOISE), dtype=torch.int64,
                            device=seeds_B.device).reshape(1, 1, 3)
    step_B1L = torch.where(lane_11L == LANE_START_CANVAS, 0, step_B11)
    words_BC3 = _words(seeds_B, block_B11, step_B1L, canvas_length, lane_11L, True)
    return (to_token(words_BC3[..., 0], vocab_size), to_uniform(words_BC3[..., 1]),
            to_token(words_BC3[..., 2], vocab_size))


def _step_streams_numpy(seeds_B: torch.Tensor, block_B11: torch.Tensor, step_B11: torch.Tensor, canvas_length: int,
                        vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`step_streams` on CPU, uncompiled: the same words from NumPy's uint64 arithmetic, where a 32 x 32-bit product
    is exact and unsigned wrap-around is defined, so each round is five array operations (the int64 tensor version
    needs a dozen tensor ops a round: ~0.4 ms of an eager step at the demo's sizes, ~0.1 ms here). Checked bit for
    bit against the tensor version (tests/step/test_eager_step.py)."""
    import numpy as np

    u64, mask = np.uint64, np.uint64(_MASK32)
    B, C = seeds_B.shape[0], canvas_length
    seeds = seeds_B.numpy().view(u64)
    lanes = np.array((LANE_START_CANVAS, LANE_SAMPLE, LANE_RENOISE), dtype=u64)
    block = np.broadcast_to(block_B11.numpy().astype(u64) & mask, (B, C, 3))
    step = np.broadcast_to(np.where(lanes == LANE_START_CANVAS, u64(0), step_B11.numpy().astype(u64) & mask),
                           (B, C, 3))
    pos = np.broadcast_to(np.arange(C, dtype=u64)[None, :, None], (B, C, 3))
    lane = np.broadcast_to(lanes, (B, C, 3))
    # as `_rounds`: the words each round multiplies, (c2, c0), and the others, (c1, c3), each pair one array
    mul, odd = np.stack((pos, block)), np.stack((step, lane))
    m = np.array((PHILOX_M[1], PHILOX_M[0]), dtype=u64).reshape(2, 1, 1, 1)
    key = np.stack((seeds & mask, seeds >> u64(32))).reshape(2, B, 1, 1)
    bump = np.array(PHILOX_W, dtype=u64).reshape(2, 1, 1, 1)
    for r in range(PHILOX_ROUNDS):
        if r:
            key = (key + bump) & mask
            mul = even[::-1]
        product = mul * m  # < 2**64: exact in uint64
        even = (product >> u64(32)) ^ odd ^ key  # c0', c2'
        odd = product & mask  # c1', c3'
    w0 = even[0]  # [B, C, 3]: word w0 of each lane
    tokens = (w0 * u64(vocab_size)) >> u64(32)  # w0 * V < 2**63
    uniform = ((w0[..., 1] >> u64(8)).astype(np.float32) * np.float32(2.0**-24))
    return (torch.from_numpy(tokens[..., 0].astype(np.int64)), torch.from_numpy(uniform),
            torch.from_numpy(tokens[..., 2].astype(np.int64)))
