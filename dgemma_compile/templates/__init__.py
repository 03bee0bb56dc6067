"""Triton kernels, each tested against its CPU oracle under TRITON_INTERPRET=1 (`tests/test_triton_*.py`).

- `sample_step.py`: the CUDA implementation of `dgemma::sample_step` (`sample_step_triton`, oracle
  `sampler.sample_step`) and Philox4x32-10 as a Triton device function (`philox4x32_triton`, `philox_uniform`,
  oracle `rng.philox4x32` / `rng.step_noise`).

The grouped-GEMM MoE kernels and their lowering, which no default path reaches, are in `dgemma_compile/experimental/`.

Importing this package imports no submodule, so it works without triton (only in the `test` extra); import a kernel
module explicitly, e.g. `from dgemma_compile.templates import sample_step`, where triton is installed.
"""
