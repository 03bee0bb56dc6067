"""The compile cache's AOTInductor packages (`compile/aoti.py`): a unit saved as one writes the bits the in-process
Inductor compile writes, in place, and a later factory (or a fresh interpreter) loads it without Dynamo or Inductor."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from dgemma_compile.compile.artifacts import ArtifactStore, ambient_config
from dgemma_compile.compile.options import CompileOptions
from dgemma_compile.compile.units import UnitFactory


class _Toy(torch.nn.Module):
    """A model a unit reads: weights and a buffer, as the backbone's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(32, 32)
        self.register_buffer("scale", torch.tensor(0.5))

    @property
    def device(self) -> torch.device:  # what the compile cache reads of a model (as `DiffusionGemma.device`)
        return self.proj.weight.device


def _step_over(model: _Toy, state: torch.Tensor, counter: torch.Tensor, picks: torch.Tensor):
    """A zero-argument step over static buffers: a GEMM, a reduction, an in-place write of a row subset and a
    counter, as a denoise step writes its canvas and step count."""

    def step() -> None:
        probs = torch.softmax(model.proj(state) * model.scale, dim=-1)
        picks.copy_(probs.argmax(-1).to(picks.dtype))
        state[: state.shape[0] // 2].add_(probs[: state.shape[0] // 2])
        counter.add_(1)

    return step


def _buffers():
    """The step's static buffers at their start: state [8, 32] float32, counter int64 [], picks int32 [8]."""
    return (torch.linspace(-1, 1, 8 * 32).reshape(8, 32).contiguous(), torch.zeros((), dtype=torch.int64),
            torch.zeros(8, dtype=torch.int32))


def _run(factory: UnitFactory, model: _Toy, calls: int = 3):
    state, counter, picks = _buffers()
    unit = factory.unit("toy[B8]", _step_over(model, state, counter, picks), owners=(model, state, counter, picks),
                        structure={"toy": 1})
    for _ in range(calls):
        unit()
    return unit, (state, counter, picks)


def test_a_packaged_unit_writes_the_in_process_compiles_bits_and_loads_without_compiling(tmp_path):
    model = _Toy()
    options = CompileOptions(batch_buckets=(8,))
    with torch.no_grad():
        reference, ref_out = _run(UnitFactory(options, "cpu"), model)  # no store: Inductor in process
        eager_out = _run_eager(model)
        store = ArtifactStore(tmp_path)
        before = ambient_config()
        packaged, pkg_out = _run(UnitFactory(options, "cpu", store=store), model)
        assert ambient_config() == before  # packaging leaves no compiler setting changed (it would change keys)
        loaded, load_out = _run(UnitFactory(options, "cpu", store=ArtifactStore(tmp_path)), model)
    assert (reference.source, packaged.source, loaded.source) == ("compiled", "compiled", "loaded")
    assert store.saves == 1 and [e["kind"] for e in store.entries()] == ["aoti"]
    for ours, theirs in ((pkg_out, ref_out), (load_out, ref_out)):
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(ref_out[1]) == 3  # the writes happened, once per call
    torch.testing.assert_close(ref_out[0], eager_out[0])
    assert torch.equal(ref_out[2], eager_out[2])


def _run_eager(model: _Toy):
    state, counter, picks = _buffers()
    step = _step_over(model, state, counter, picks)
    for _ in range(3):
        step()
    return state, counter, picks


_LOAD = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads({threads})  # the key holds the thread count: the parent's
    sys.path.insert(0, {tests!r})
    from test_aoti import _Toy, _run
    from dgemma_compile.compile.artifacts import ArtifactStore, ambient_config
    from dgemma_compile.compile.options import CompileOptions
    from dgemma_compile.compile.units import UnitFactory
    with torch.no_grad():
        unit, (state, counter, picks) = _run(UnitFactory(CompileOptions(batch_buckets=(8,)), "cpu",
                                                         store=ArtifactStore({root!r})), _Toy())
    print(json.dumps({{"source": unit.source, "state": state.sum().item(), "counter": int(counter),
                      "imported": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}}))
""")


def test_a_fresh_interpreter_loads_a_package_without_importing_the_compiler(tmp_path):
    model = _Toy()
    with torch.no_grad():
        _, (state, _, _) = _run(UnitFactory(CompileOptions(batch_buckets=(8,)), "cpu",
                                            store=ArtifactStore(tmp_path)), model)
    code = _LOAD.format(tests=str(Path(__file__).parent), root=str(tmp_path), threads=torch.get_num_threads())
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"source": "loaded", "state": state.sum().item(), "counter": 3, "imported": []}


def test_a_package_that_cannot_run_is_refused_and_inductors_own_artifact_saved(tmp_path, monkeypatch, caplog):
    """A package that loads but fails on its trial run (as torch 2.13's does for a bfloat16 MoE step on CPU: its C++
    wrapper cannot call the `aten::index_add` fallback) is refused with a warning naming the error, no scratch file
    left; the step is compiled by `standalone_compile` instead and saved as Inductor's own artifact, which a later
    factory loads (imports the compiler, traces nothing); writes equal a factory's without a cache."""
    from dgemma_compile.compile import aoti

    class _CannotRun:
        def __init__(self, path, device):
            self.path = str(path)

        def __call__(self, *inputs):
            raise RuntimeError("Could not find schema for dgemma::not_registered")

    model = _Toy()
    options = CompileOptions(batch_buckets=(8,))
    monkeypatch.setattr(aoti, "load", _CannotRun)
    store = ArtifactStore(tmp_path)
    with torch.no_grad(), caplog.at_level("WARNING", logger="dgemma_compile"):
        unit, out = _run(UnitFactory(options, "cpu", store=store), model)
        _, ref = _run(UnitFactory(options, "cpu"), model)
        later, loaded = _run(UnitFactory(options, "cpu", store=ArtifactStore(tmp_path)), model)
    assert (unit.source, later.source) == ("compiled", "loaded")
    assert store.saves == 1 and [e["kind"] for e in store.entries()] == ["inductor"]
    assert not list((tmp_path / "tmp").iterdir())
    assert "dgemma::not_registered" in caplog.text
    for ours in (out, loaded):
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
