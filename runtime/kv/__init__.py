"""The server's KV memory: the page pool (`pool.py`), the prefix cache over it (`prefix_cache.py`), image pages
(`image_pages.py`) and the admission arithmetic that ties them to requests (`memory.py`)."""
