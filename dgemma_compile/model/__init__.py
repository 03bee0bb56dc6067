"""The model: its configs, the Gemma4 backbone (`backbone.py`) and vision tower, the attention masks, the KV
cache, the per-row forward plan, the checkpoint loader, and the uniform reference forwards (`forwards.py`)."""
