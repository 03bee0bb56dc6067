"""Code no default path reaches and no GPU has verified (docs/compiler.md, "Experimental"): kept with its tests until
a GPU run decides whether it joins a default path or goes.

- `moe_grouped_gemm.py`: grouped-GEMM Triton kernels of `dgemma::moe_experts` (`moe_experts_triton`, oracle
  `kernels.moe.op.moe_experts_loop`), tested under TRITON_INTERPRET=1 (tests/kernels/test_triton_moe.py);
- `moe_lowering.py`: their Inductor lowering, registered explicitly (`register_moe_lowering()`, CUDA only).

Importing this package imports no submodule (triton is only in the `test` extra).
"""
