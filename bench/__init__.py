"""Benchmarks of dgemma_compile against its eager reference, transformers and an autoregressive baseline.

Entry point: `python -m bench --help` (`__main__.py`). One job per file: `models.py` (what is benchmarked),
`workloads.py` (fixed / adaptive), `systems.py` (how each system runs and is timed), `ar.py` (the AR baseline),
`timing.py` (clocks, marks, peak memory), `roofline.py` (bytes/FLOPs floors), `report.py` (medians, ratios,
markdown/CSV), `environment.py` (versions, device, load), `runner.py` + `worker.py` (one process per system).
`h200.sh` is the one-command GPU run; `gpu_check.py` the GPU correctness/latency check.
"""
