"""`dgemma::sample_step`: the denoise step's vocabulary-wide region as one op (`op.py`), its Triton kernel
(`triton.py`), the Inductor pass that puts it in a compiled step (`fusion.py`) and its vocabulary-parallel twin
(`vocab_parallel.py`), beside the oracle math in `step/sampler.py`."""
