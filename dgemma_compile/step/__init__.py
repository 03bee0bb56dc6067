"""The one step of a bucket and what drives it: the row phases and per-row device state, the step itself
(`mixed_step.py`), the denoise-step math (`sampler.py`) and its random streams (`rng.py`), the end rule (`finish.py`),
the row table with its batch sizes (`row_table.py`), the host driver (`driver.py`), and the shared request records
(`requests.py`)."""
