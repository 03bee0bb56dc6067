import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("ci")
# Tiny models gain nothing from intra-op threads, and spinning OpenMP workers cost 10-100x under contention.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny random checkpoint with a tokenizer, shared by tests that only read it."""
    from helpers import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer=True, vocab_size=48,
                            layer_types=("sliding_attention", "sliding_attention", "full_attention"))
