"""The dtype a checkpoint computes in on this host: the dtype it is stored in, unless this host's GEMM in that dtype is
far slower than in float32.

Why: a CPU without native bfloat16/float16 matrix instructions (no AVX512_BF16 / AMX / AVX512_FP16, e.g. an AVX2-only
host) runs a half-precision GEMM through a slow reference path. Measured with torch 2.13.0 on one thread, a
[256, 1024] x [1024, 4096] bf16 GEMM ran at 0.2-0.3 GFLOP/s against 36-79 GFLOP/s in float32 (180-234x slower;
bench/results/half_gemm_cpu_2026-12-06.md), so a bf16 checkpoint (the released one is bf16) waits minutes per block.
On such a host the weights are upcast to float32 once, at load: twice the memory, and float32 numerics (different
tokens from a bf16 run, as any dtype change gives).

The decision is measured, not guessed from CPU flags (oneDNN's paths, ATen's dispatch and `ONEDNN_MAX_CPU_ISA` /
`ATEN_CPU_CAPABILITY` overrides decide the speed, not /proc/cpuinfo): `probe` times one small GEMM in both dtypes,
once per process and dtype. CUDA devices and float32 checkpoints are never probed. Overrides: an
explicit dtype (`load(..., dtype=...)`, `dgemma --dtype`) is always kept.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

SLOW_RATIO = 8.0
"""A half-precision GEMM more than this many times slower than float32's counts as slow. Native paths are faster than
float32 (AMX bf16: ~7x faster); the reference path is ~200x slower; 8x leaves room for timer noise on a busy host."""

PROBE_SHAPE = (32, 256, 256)
"""[M, K] x [K, N] of the probe: 4 MFLOP; on one thread ~6 ms on the slow path (31x float32's time at this size),
~0.05 ms on a native one."""


@dataclass(frozen=True)
class HalfGemmProbe:
    """One measurement: seconds of the probe GEMM in `dtype` and in float32 (best of `repeats`) on the CPU."""

    dtype: torch.dtype
    half_s: float
    float32_s: float

    @property
    def ratio(self) -> float:
        """half-precision time / float32 time (> 1: the half GEMM is slower)."""
        return self.half_s / max(self.float32_s, 1e-9)

    @property
    def slow(self) -> bool:
        return self.ratio > SLOW_RATIO

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return f"a {name} GEMM takes {self.ratio:.1f}x float32's time on this CPU"


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache
def _probe(dtype: torch.dtype, repeats: int) -> HalfGemmProbe:
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    a, b = a32.to(dtype), b32.to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's paths: a multi-threaded GEMM this small times the thread pool, not the ISA
    try:
        with torch.inference_mode():
            torch.mm(a32, b32), torch.mm(a, b)  # first calls pick oneDNN primitives: not timed
            f32 = _best_of(lambda: torch.mm(a32, b32), repeats)
            half = _best_of(lambda: torch.mm(a, b), repeats)
    finally:
        torch.set_num_threads(threads)
    return HalfGemmProbe(dtype, half, f32)


def probe(dtype: torch.dtype, repeats: int = 5) -> HalfGemmProbe:
    """This CPU's half-precision GEMM speed against float32's on one thread (best of `repeats`), measured once per
    process and dtype (~1 ms on a host with native half matmul, ~40 ms without).

    Raises:
        ValueError: `dtype` is not torch.bfloat16 or torch.float16.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: probe measures torch.bfloat16 or torch.float16, got {dtype!r}")
    return _adopted.get(dtype) or _probe(dtype, repeats)


def adopt(probes: dict[torch.dtype, HalfGemmProbe]) -> None:
    """Use these measurements instead of measuring (each dtype's `probe`): a tensor-parallel group measures once, on
    rank 0, so that every rank loads the same dtype (ranks probing apart under contention could disagree)."""
    for p in probes.values():
        _adopted[p.dtype] = p


_adopted: dict[torch.dtype, HalfGemmProbe] = {}


def for_host(stored: torch.dtype, device: torch.device) -> tuple[torch.dtype, HalfGemmProbe | None]:
    """The dtype to compute a checkpoint stored in `stored` on `device`, and the probe that decided an upcast (None
    when the stored dtype is kept): float32 on a CPU whose `stored` GEMM is slow (`HalfGemmProbe.slow`), else
    `stored`."""
    if device.type != "cpu" or stored not in (torch.bfloat16, torch.float16):
        return stored, None
    p = probe(stored)
    return (torch.float32, p) if p.slow else (stored, None)
