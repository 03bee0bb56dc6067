import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# tests/ mirrors the package's folders (tests/model/, tests/step/, ...); the shared helpers (helpers.py,
# triton_support.py) and the test modules other tests import from (test_serve's server thread, test_text's byte BPE)
# are importable by name from any of them, whichever worker collected what
TESTS = Path(__file__).resolve().parent
ROOMS = sorted(d for d in TESTS.iterdir() if d.is_dir() and d.name not in ("fixtures", "__pycache__")
               and not d.name.startswith("."))
sys.path[:0] = [str(TESTS)] + [str(d) for d in ROOMS]
if str(TESTS.parent) not in sys.path:  # the repository root (`bench` the package, not tests/bench/): bare `pytest FILE`
    sys.path.append(str(TESTS.parent))
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("ci")
# Tiny models gain nothing from intra-op threads, and spinning OpenMP workers cost 10-100x under contention.
torch.set_num_threads(1)


TORCH_2_13 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """torch 2.11 (the GPU machine's version, proved here by bench/gpu_versions_check.sh): its CPU `_scaled_mm` takes
    per-tensor scales only, so our per-row FP8 runs on CUDA there but not on a CPU. A test that reaches that limit
    is skipped with the reason, on torch < 2.13 only; every other failure stays a failure."""
    try:
        return (yield)
    except Exception as e:  # triton's InterpreterError is no RuntimeError
        if not TORCH_2_13 and "only supports per-tensor scaling for CPU backend" in str(e):
            pytest.skip(f"torch {torch.__version__}: CPU _scaled_mm is per-tensor only (per-row FP8 needs CUDA or "
                        "torch >= 2.13)")
        if "only 0-dimensional arrays can be converted to Python scalars" in str(e) and _old_triton():
            # the same versions' other gap, on a CPU only: triton 3.6's interpreter (TRITON_INTERPRET=1) turns a
            # runtime scalar used as an index (`range(E)`) into a Python int with int(1-element array), which
            # numpy >= 2.5 refuses; triton 3.7's interpreter does not. Compiled kernels (CUDA) are not concerned.
            pytest.skip("triton < 3.7's interpreter with numpy >= 2.5: int() of a 1-element array (CPU only)")
        raise


def _old_triton() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny random checkpoint with a tokenizer, shared by tests that only read it."""
    from helpers import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny"), tokenizer=True, vocab_size=48,
                            layer_types=("sliding_attention", "sliding_attention", "full_attention"))


@pytest.fixture(scope="session")
def tiny_compiled(tiny_dir):
    """(model, compiled generator) on the tiny checkpoint, shared by every test that compiles it: two buckets keep
    compile time down (1-2 requests run in the first, 3-4 in the second, more in groups)."""
    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions, build

    model = dg.load(tiny_dir)
    # max_seq_len 256 = what `dgemma generate` rounds a short request to, so its bucket-2 graphs are Inductor cache
    # hits for the CLI tests (and the other way round)
    return model, build(model, CompileOptions(batch_buckets=(2, 4), max_seq_len=256))


@pytest.fixture(scope="session")
def demo():
    """(model, tokenizer) of the built-in demo model."""
    import dgemma_compile as dg
    from dgemma_compile.demo import DEMO_MODEL

    return dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)


@pytest.fixture(scope="session")
def demo_gen(demo):
    """The demo model's compiled generator, one bucket of 2 rows (each bucket costs a compile): 256 slots as
    `dgemma generate` uses for a short request."""
    from dgemma_compile.compile import CompileOptions, build

    return build(demo[0], CompileOptions(batch_buckets=(2,), max_seq_len=256))


@pytest.fixture(scope="session", autouse=True)
def _cpp_builds_through_the_compile_cache():
    """Every Inductor C++ build in the suite's processes goes through the user-level compile cache's C++ store
    (`compile.cpp_store`, keyed without the venv's paths), as the generator's own compiles do: a fresh clone's new
    venv (what `.ci/run` makes) rebuilds none of what an earlier run built, also for the tests' plain
    `torch.compile` calls (docs/testing.md). Nothing when the cache is off (`DGEMMA_CACHE=off`); a test's own store
    (a temporary cache) nests inside and takes its builds."""
    from dgemma_compile.compile.artifacts import ArtifactStore
    from dgemma_compile.compile.cpp_store import building_from

    store = ArtifactStore.default()
    with building_from(store.cpp if store is not None else None):
        yield


@pytest.fixture(scope="session")
def shared_compile_cache(tmp_path_factory):
    """The user-level compile cache every process of the suite shares (`artifacts.cache_root()`, docs/testing.md), for
    tests whose subject is not the cold compile itself: a suite that ran before loads their steps instead of
    compiling them again. A temporary directory when the cache is turned off (`DGEMMA_CACHE=off`)."""
    from dgemma_compile.compile.artifacts import cache_root

    root = cache_root()
    return root if root is not None else tmp_path_factory.mktemp("dgemma-cache")
