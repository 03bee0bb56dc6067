"""Benchmarks of dgemma_compile against its eager reference, transformers and an autoregressive baseline.

Entry point: `python -m bench --help` (`__main__.py`). One job per file: `models.py` (what is benchmarked),
`workloads.py` (fixed / adaptive), `systems.py` (how each system runs and is timed), `ar.py` (the AR baseline),
`session.py` (one system prepared once, timed repeat by repeat), `timing.py` (clocks, marks, the `Observer` that
feeds them, peak memory), `roofline.py` (bytes/FLOPs floors), `report.py` (spreads, ratios, markdown/CSV),
`environment.py` (versions, device, load), `runner.py` + `worker.py` (a long-lived worker per system, timed repeats
round-robin). bench/ uses dgemma_compile's public API only (tests/bench/test_bench.py checks).
`h200.sh` is the one-command GPU run; `gpu_check.py` the GPU correctness/latency check.
"""
