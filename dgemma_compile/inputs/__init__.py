"""What a request brings in: text and chat prompts (`text.py`), constraints (`constraint.py`), images
(`images.py`, `preprocess.py`) and image URLs (`fetch.py`)."""
