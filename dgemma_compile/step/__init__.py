"""The one step and what drives it: the row phases (`phases.py`) and per-row device state (`rows.py`), the step
itself (`mixed_step.py`), the denoise-step math (`sampler.py`) and its random streams (`rng.py`), the end rule
(`finish.py`), the row table and its buckets (`row_table.py`), the one host driver (`driver.py`), seeded canvases and
live frames (`canvas.py`, `frames.py`), observation hooks (`observe.py`), and the shared request records and planning
(`requests.py`)."""
