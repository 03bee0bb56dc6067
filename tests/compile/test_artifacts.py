"""The compile cache (`compile/artifacts.py`, `compile/cpp_store.py`): what its keys hold and do not hold, damaged and
concurrent entries, and end to end: a step compiled once is loaded by a later process at another venv path with an
empty Inductor cache, with no compile and no g++ build, and gives the same tokens."""

import ast
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.compile import artifacts as A
from dgemma_compile.compile import cpp_store as S
from dgemma_compile.compile.options import CompileOptions

PACKAGE = Path(A.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return dg.load(tiny_dir)


def _parts(model, options=None, unit="step[B1_x]", structure=None, tensors=None):
    return A.step_key_parts(options=options or CompileOptions(), model=model, unit=unit,
                            structure=structure or {"bucket": [1, True]}, tensors=tensors or [torch.zeros(2, 3)])


def test_the_key_changes_with_what_the_step_depends_on(tiny_model, tmp_path):
    """Each input of the key, changed alone, changes it; the same inputs give the same key."""
    base = A.step_key(_parts(tiny_model))
    assert A.step_key(_parts(tiny_model)) == base
    changed = {
        "options": _parts(tiny_model, CompileOptions(max_seq_len=768)),
        "disabled pass": _parts(tiny_model, CompileOptions(disabled_passes=("sample_step_fusion",))),
        "unit": _parts(tiny_model, unit="step[B2_x]"),
        "structure": _parts(tiny_model, structure={"bucket": [0, False]}),
        "buffers": _parts(tiny_model, tensors=[torch.zeros(2, 4)]),
        "dtype": _parts(dg.load(tiny_model.checkpoint.directory, dtype=torch.bfloat16)),
    }
    for what, parts in changed.items():
        assert A.step_key(parts) != base, what
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert A.step_key(_parts(tiny_model)) != base, "threads"
    finally:
        torch.set_num_threads(threads)


def test_the_model_key_holds_the_expert_format_by_value_and_no_address(tiny_model):
    """An expert projection's format (a frozen `ExpertFormat`) is part of the model's structure, by value; other
    attributes whose repr holds an address (a frozen dataclass holding a process group, as `parallel.TensorParallel`
    and `VocabShard` do) are not, so a sharded model's key is the same in every process (review of issue 41 item 3:
    it was not)."""
    import copy
    import dataclasses

    from dgemma_compile.kernels.moe import formats as expert_formats

    @dataclasses.dataclass(frozen=True)
    class HoldsAGroup:
        group: object

    base = A.model_structure(tiny_model)
    other = copy.deepcopy(tiny_model)
    other.tensor_parallel_like = HoldsAGroup(object())  # repr: "<object object at 0x...>"
    assert A.model_structure(other) == base
    proj = other.layers[0].experts.down_proj
    assert proj.format is expert_formats.NONE
    proj.format = expert_formats.FP8  # as set_quantized sets it (the stored tensors aside)
    changed = [e for e, b in zip(A.model_structure(other), base) if e != b]
    assert changed == [["attribute", "layers.0.experts.down_proj.format", repr(expert_formats.FP8)]]


def _sources_only(folder: str, names: list[str]) -> list[str]:
    """`shutil.copytree`'s ignore: bytecode caches and the demo checkpoint's weights (`demo/model/`)."""
    return [n for n in names if n == "__pycache__" or (Path(folder).name == "demo" and n == "model")]


def test_a_changed_source_file_is_a_miss(tmp_path):
    """The sources digest covers every .py file of the package a step can trace, per room: one changed byte in a copy
    changes its room's hash and no other (mutation)."""
    digest = A.sources_digest.__wrapped__  # uncached: the copy is read again after the edit
    copy = tmp_path / "pkg"
    shutil.copytree(PACKAGE, copy, ignore=_sources_only)
    assert digest(str(copy)) == digest(str(PACKAGE))
    target = copy / "compile" / "passes.py"
    target.write_text(target.read_text() + "\n# edited\n")
    edited, base = digest(str(copy)), digest(str(PACKAGE))
    assert edited != base
    # per room: the edited file's folder alone differs (what a miss's reason names), every room is in the key
    assert [r for r in base if edited[r] != base[r]] == ["compile"]
    assert {"model", "step", "inputs", "compile", "kernels/moe", "kernels/sample", "oracle.py"} <= set(base)


def test_an_edit_the_steps_cannot_trace_is_no_miss(tmp_path):
    """`cli/` and `demo/` (`artifacts.UNTRACED`) are outside the digest: editing the command line keeps every step's
    key (mutation), and no module a step can trace imports them (an AST scan of every other module)."""
    digest = A.sources_digest.__wrapped__
    copy = tmp_path / "pkg"
    shutil.copytree(PACKAGE, copy, ignore=_sources_only)
    for folder in A.UNTRACED:
        target = next((copy / folder).glob("*.py"))
        target.write_text(target.read_text() + "\n# edited\n")
    assert digest(str(copy)) == digest(str(PACKAGE))
    seen = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in A.UNTRACED:
            continue
        package = rel.parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: from the module's package upwards
                base = (*package[:len(package) - node.level + 1], *(node.module.split(".") if node.module else ()))
                targets = [(*base, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("dgemma_compile."):
                targets = [tuple(node.module.split(".")[1:])]
            elif isinstance(node, ast.Import):
                targets = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("dgemma_compile.")]
            else:
                continue
            seen |= {(str(rel), t[0]) for t in targets if t and t[0] in A.UNTRACED}
    assert not seen, f"a module a step can trace imports an untraced folder: {seen}"


def test_the_key_names_no_install_path(tiny_model):
    """Nothing of this venv's location reaches the key: a venv elsewhere computes the same key."""
    text = json.dumps(_parts(tiny_model))
    for path in (sys.prefix, os.path.dirname(torch.__file__), str(PACKAGE)):
        assert path not in text


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DGEMMA_CACHE_DIR", raising=False)
    monkeypatch.delenv("DGEMMA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert A.cache_root() == tmp_path / "xdg" / "dgemma_compile"
    monkeypatch.setenv("DGEMMA_CACHE_DIR", str(tmp_path / "mine"))
    assert A.cache_root() == tmp_path / "mine"
    monkeypatch.setenv("DGEMMA_CACHE", "off")
    assert A.cache_root() is None and A.ArtifactStore.default() is None


class _Builder:
    """What `CppStore.key` reads of a `CppBuilder`."""

    def __init__(self, command: str, sources: list[str], out: str, target: str, compiler: str = "g++"):
        self._command, self._sources_args, self._output_dir, self._compiler = command, " ".join(sources), out, compiler
        self._target = target

    def get_command_line(self) -> str:
        return self._command

    def get_target_file_path(self) -> str:
        return self._target


def test_the_cpp_key_ignores_install_paths_but_not_flags_or_sources(tmp_path, monkeypatch):
    """Two venvs: the same command line but for torch's -I/-L paths and the build directories -> one key. Another
    flag, or another source byte -> another key."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "k.cpp").write_text("int f() { return 1; }")
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))

    def builder(d: str, venv_torch: str, flags: str = "-O3") -> _Builder:
        (tmp_path / d / f"{d}-key.cpp").write_text((tmp_path / d / "k.cpp").read_text())
        src = str(tmp_path / d / f"{d}-key.cpp")  # Inductor names files by keys that differ between venvs
        return _Builder(f"g++ {src} {flags} -I{venv_torch}/include -o {tmp_path / d}/{d}-key.so -L{venv_torch}/lib",
                        [src], str(tmp_path / d), target=f"{tmp_path / d}/{d}-key.so")

    store = S.CppStore(tmp_path / "store")
    here = store.key(builder("a", torch_dir))
    other_venv = "/elsewhere/venv/lib/python3.11/site-packages/torch"
    monkeypatch.setattr(S, "install_paths", lambda: [(other_venv, "<torch>")])
    assert store.key(builder("b", other_venv)) == here
    assert store.key(builder("b", other_venv, "-O2")) != here
    (tmp_path / "b" / "k.cpp").write_text("int f() { return 2; }")  # builder() copies it to the keyed name
    assert store.key(builder("b", other_venv)) != here


def test_a_damaged_cpp_entry_is_removed_and_never_served(tmp_path):
    store = S.CppStore(tmp_path / "store")
    built = tmp_path / "k.so"
    built.write_bytes(b"\x7fELF good bytes")
    store.put("ab" * 32, str(built))
    assert store.fetch("ab" * 32, str(tmp_path / "copy.so")) and (tmp_path / "copy.so").read_bytes() == built.read_bytes()
    blob, _ = store._entry("ab" * 32)
    blob.write_bytes(b"\x7fELF truncat")
    assert not store.fetch("ab" * 32, str(tmp_path / "again.so"))
    assert store.corrupt == 1 and not blob.exists() and not (tmp_path / "again.so").exists()


def test_isa_probes_are_recorded_by_compiler_cpu_torch_and_flags(tmp_path, monkeypatch):
    """Inside `building_from`, Inductor's ISA probe (`VecISA.check_build`) runs once per (ISA flags, code) and store;
    a later process (a new `CppStore` on the same root) gets the recorded answer without probing; other flags or
    code probe again. Outside the block the original probe is back."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setattr(S, "_active", [])  # this test's blocks are the outermost (the suite's own is set aside)
    calls = []

    def fake_probe(isa, code):
        calls.append((type(isa).__name__, code))
        return type(isa).__name__ == "VecAVX2"  # one ISA builds, the other is refused

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", fake_probe)
    avx2, avx512 = cpu_vec_isa.VecAVX2(), cpu_vec_isa.VecAVX512()
    first = S.CppStore(tmp_path / "store")
    with S.building_from(first):
        assert [avx2.check_build("c"), avx512.check_build("c")] == [True, False]
    assert len(calls) == 2 and first.probes_recorded == 0
    later = S.CppStore(tmp_path / "store")
    with S.building_from(later):
        assert [avx2.check_build("c"), avx512.check_build("c")] == [True, False]
        assert avx2.check_build("other code") is True
    assert later.probes_recorded == 2 and calls[2:] == [("VecAVX2", "other code")]
    assert cpu_vec_isa.VecISA.check_build is fake_probe


def _save_many(root: str, key: str, payload: bytes, n: int) -> None:
    store = A.ArtifactStore(Path(root))
    for _ in range(n):
        store.save(key, {"unit": "u"}, _write(Path(root) / f"{os.getpid()}.pt2", payload), ["bucket:0"],
                   [torch.zeros(3)])
        S.CppStore(Path(root) / "cpp").put(key, _write(Path(root) / f"{os.getpid()}.so", payload))


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.slow  # two fresh interpreters importing torch: ~10 s
def test_two_processes_filling_one_entry_leave_one_whole_entry(tmp_path):
    """Concurrent writers of the same step and C++ entries: whatever interleaving, every entry's bytes match its
    recorded sha256 (one writer's whole entry, never a mix)."""
    key = "cd" * 32
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_save_many, args=(str(tmp_path), key, bytes([i]) * 200_000, 20)) for i in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entry = tmp_path / "steps" / key[:2] / key
    meta = json.loads((entry / A.META).read_text())
    assert hashlib.sha256((entry / A.ARTIFACT).read_bytes() + (entry / A.INPUTS).read_bytes()).hexdigest() == \
        meta["sha256"]
    assert not list(entry.parent.glob(".*"))  # no temporary directory left behind
    store = S.CppStore(tmp_path / "cpp")
    assert store.fetch(key, str(tmp_path / "out.so")) and store.corrupt == 0


@pytest.mark.parametrize("damage", ["artifact", "inputs swapped", "meta", "not a package"])
def test_a_damaged_step_entry_is_removed_and_reported_as_a_miss(tmp_path, tiny_model, damage):
    """Any file of an entry changed after it was written, or an entry written whole whose package torch cannot load:
    never called, removed, counted, logged."""
    store = A.ArtifactStore(tmp_path)
    key = "ef" * 32
    tensors = [torch.zeros(3), torch.ones(3)]
    store.save(key, {"unit": "u"}, _write(tmp_path / "package.pt2", b"not an artifact"), ["bucket:0", "bucket:1"],
               tensors)
    assert store.has(key)
    d = store._dir(key)
    if damage == "artifact":
        (d / A.ARTIFACT).write_bytes(b"changed")
    elif damage == "inputs swapped":  # same dtypes and shapes: only the recorded sha256 can tell
        recorded = json.loads((d / A.INPUTS).read_text())
        recorded["names"].reverse()
        (d / A.INPUTS).write_text(json.dumps(recorded))
    elif damage == "meta":
        (d / A.META).write_text("{not json")
    assert store.load(key, {"unit": "u"}, tiny_model, tensors) is None
    assert store.corrupt == 1 and not store.has(key)


def test_inputs_resolve_only_to_tensors_of_the_recorded_layout(tiny_model):
    name, param = next(iter(tiny_model.named_parameters()))
    tensors = [torch.zeros(2, 3)]
    meta = [A.tensor_meta(param), A.tensor_meta(tensors[0])]
    assert A.resolve_inputs([f"param:{name}", "bucket:0"], meta, tiny_model, tensors) == [param, tensors[0]]
    for names, recorded, message in (
            ([f"param:{name}", "bucket:1"], meta, "denotes no tensor"),
            ([f"param:{name}", "param:nope"], meta, "denotes no tensor"),
            ([f"param:{name}", "bucket:0"], [meta[0], A.tensor_meta(torch.zeros(3, 2))], "recorded"),
            ([f"param:{name}"], meta, "recorded inputs")):
        with pytest.raises(ValueError, match=message):
            A.resolve_inputs(names, recorded, tiny_model, tensors)


def test_changed_compiler_settings_are_a_miss_and_calling_options_are_not(tiny_model, monkeypatch, tmp_path):
    """A caller's Inductor setting or TORCHINDUCTOR_ variable changes the key; how a step is called (direct calls,
    guards, recompile limit) or built (compile workers, precompiled headers: what `cpp_store.building_from` sets, so
    that a step keyed inside such a block is the one keyed outside) does not."""
    import torch._inductor.config as inductor_config

    base = A.step_key(_parts(tiny_model))
    with inductor_config.patch(fallback_random=True):
        assert A.step_key(_parts(tiny_model)) != base
    with inductor_config.patch(compile_threads=7, cpp_cache_precompile_headers=False):
        assert A.step_key(_parts(tiny_model)) == base
    with S.building_from(S.CppStore(tmp_path / "cpp")):
        assert A.step_key(_parts(tiny_model)) == base
    monkeypatch.setenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "1")
    assert A.step_key(_parts(tiny_model)) != base
    monkeypatch.delenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # where Inductor caches, not what it makes
    assert A.step_key(_parts(tiny_model)) == base
    for calling in (dict(direct_calls=False), dict(skip_guards=False), dict(recompile_limit=64)):
        assert A.step_key(_parts(tiny_model, CompileOptions(**calling))) == base, calling


def test_an_unusable_cache_directory_turns_the_cache_off_with_a_warning(tmp_path, monkeypatch, caplog):
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("DGEMMA_CACHE_DIR", str(afile))
    with caplog.at_level("WARNING", logger="dgemma_compile"):
        assert A.ArtifactStore.default() is None
    assert str(afile) in caplog.text


_RUN = textwrap.dedent("""
    import json, logging, sys, torch
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.demo import DEMO_MODEL
    model = dg.load(DEMO_MODEL)
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=256))
    out = gen.generate([[2, 10, 11, 12], [2, 13]], seed=[3, 4])
    store = gen.units.store
    print(json.dumps({"sequences": out.sequences, "compiles": sum(gen.compiles.values()),
                      "loads": sum(gen.loads.values()), "source": gen.step_source,
                      "cpp_builds": store.cpp.builds, "cpp_hits": store.cpp.hits,
                      "probes_recorded": store.cpp.probes_recorded,
                      "compiler_imported": [m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules]}))
""")


@pytest.mark.slow
def test_a_second_venv_at_another_path_loads_the_step_and_compiles_nothing(tmp_path, shared_compile_cache):
    """Process 1 (this venv, an empty Inductor cache) runs the demo's step from the suite's compile cache: compiled
    and saved on the suite's first run, loaded on later ones (the cold compile and save of a fresh cache are
    `test_a_damaged_step_entry_...`'s and the CLI tests' subject, on cheaper models). Process 2 runs from a copy of
    this venv at another path (so torch's include paths differ, as in a new clone's .venv) with an EMPTY Inductor
    cache and the same compile cache: it loads the step -- no Dynamo trace, no Inductor compile, no g++ build, no
    import of Dynamo or Inductor -- and gives the same tokens."""
    venv2 = tmp_path / "venv-elsewhere"
    shutil.copytree(sys.prefix, venv2, symlinks=True, copy_function=os.link)  # hard links: seconds, no space
    python2 = venv2 / "bin" / "python"
    cache = shared_compile_cache
    runs = []
    for python, inductor in ((sys.executable, tmp_path / "inductor-1"), (str(python2), tmp_path / "inductor-2")):
        env = {**os.environ, "DGEMMA_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
               "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        env.pop("DGEMMA_CACHE", None)
        done = subprocess.run([python, "-c", _RUN], env=env, capture_output=True, text=True, timeout=900,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        runs[-1]["log"] = [ln for ln in done.stderr.splitlines() if "compile cache" in ln]
    first, second = runs
    check = subprocess.run([str(python2), "-c", "import torch; print(torch.__file__)"], capture_output=True,
                           text=True, check=True)
    assert check.stdout.startswith(str(venv2))  # the second process's torch really is elsewhere
    assert first["compiles"] + first["loads"] == 1 and first["source"] in ("compiled", "loaded")
    assert (second["compiles"], second["loads"], second["source"]) == (0, 1, "loaded"), second["log"]
    assert (second["cpp_builds"], second["cpp_hits"], second["probes_recorded"]) == (0, 0, 0)  # no C++ at all
    assert second["compiler_imported"] == []  # the package loads through libtorch: neither Dynamo nor Inductor
    assert second["sequences"] == first["sequences"]


def test_a_miss_names_the_key_parts_and_the_source_rooms_that_differ(tmp_path):
    """A miss's logged reason compares the key parts with the newest entry of the same unit: the parts that differ,
    and for the sources the rooms (folders) whose files changed."""
    store = A.ArtifactStore(tmp_path)
    cached = {"unit": "step[B1_x]", "options": {"a": 1}, "sources": {"model": "m", "step": "s", "oracle.py": "o"}}
    entry = tmp_path / "steps" / "ab" / "abcd"
    entry.mkdir(parents=True)
    (entry / A.META).write_text(json.dumps({"parts": cached, "created": 1.0}))
    store.load("ef01", {**cached, "options": {"a": 2}, "sources": {**cached["sources"], "step": "s2"}}, None, [])
    assert store.miss_reasons == [("step[B1_x]", "differs from a cached entry of the same unit in: options, "
                                                 "sources (step)")]
    store.load("ef02", {**cached, "unit": "step[B2_x]"}, None, [])
    assert store.miss_reasons[-1] == ("step[B2_x]", "no entry")
