"""The model: its configs (`config.py`), the checkpoint loader (`loader.py`), the Gemma4 backbone (`backbone.py`) and
vision tower (`vision.py`), the forward modes (`modes.py`), the per-row forward plan (`plan.py`) with its attention
masks (`masks.py`), the KV cache (`kv_cache.py`), and the uniform reference forwards `encode` / `denoise`
(`forwards.py`)."""
