"""Tensor parallelism over torch.distributed (docs/parallel.md): the process group (`group.py`), a local launcher
(`launch.py`), a weight's per-rank slice and the row-parallel linear (`linear.py`), the sharding of a loaded model
(`shard.py`: attention heads, the dense MLP, the routed experts (`experts.py` by intermediate slice, `expert_parallel.py` by expert) and the vocabulary (`vocab.py`)), read
from the model or straight from the checkpoint's files (`source.py`, `load.py`: `load_sharded`; quantized weights
part by part, `quantized.py`), the host channel
(`channel.py`) and the bytes a step's collectives move (`traffic.py`). The ranks of a CLI command are started by the
command line (`cli/ranks.py`); the vocabulary-parallel sampler is beside the sample kernel
(`kernels/sample/vocab_parallel.py`)."""

from .errors import ParallelError
from .expert_parallel import DEFAULT_EXPERT_SPLIT, EXPERT_SPLITS, ExpertParallelExperts
from .experts import TensorParallelExperts
from .group import RendezvousError, backend_for, destroy, init
from .launch import RankFailed, spawn
from .linear import RowParallelLinear, split
from .load import LoadReport, load_sharded
from .shard import TensorParallel, attention_heads, shard
from .source import FileWeights, ModelWeights
from .vocab import VocabParallelEmbedding, VocabParallelHead, VocabParallelProduct, vocab_range

__all__ = ["DEFAULT_EXPERT_SPLIT", "EXPERT_SPLITS", "ExpertParallelExperts", "FileWeights", "LoadReport", "ModelWeights", "load_sharded", "ParallelError", "RankFailed", "RendezvousError", "RowParallelLinear", "TensorParallel", "TensorParallelExperts",
           "VocabParallelEmbedding", "VocabParallelHead", "VocabParallelProduct", "attention_heads", "backend_for",
           "destroy", "init", "shard", "spawn", "split", "vocab_range"]
