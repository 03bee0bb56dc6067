"""Imports cost only what is used: `dgemma --help` (any command's) imports no torch, `import dgemma_compile` imports
no torch, and `load` + `build` import neither Dynamo nor Inductor (about 2 s) until something compiles. Each check
runs in a fresh interpreter (`sys.executable`), as a user's command would; the CLI's torch-free copies of torch-side
names (its `choices=`, a default) are checked equal to their sources here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPILER = ("torch._dynamo", "torch._inductor")


def _run(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter from the repository root; it prints one JSON object last."""
    out = subprocess.run([sys.executable, *args, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["explain"], ["cache"]],
                         ids=["dgemma", "generate", "serve", "explain", "cache"])
def test_help_imports_no_torch(command):
    r = _run(f"""
import json, sys
from dgemma_compile.cli import main
code = main({[*command, "--help"]!r})  # argparse's status, returned
print(json.dumps({{"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}}))
""")
    assert r["code"] == 0
    assert r["torch"] == [], r["torch"][:10]


def test_python_m_cli_help_imports_no_torch():
    """`python -m dgemma_compile.cli` (the console script's module) runs, and its --help imports no torch:
    `-X importtime` lists every module imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "dgemma_compile.cli", "generate", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: dgemma generate" in out.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "dgemma_compile.cli" in imported or "dgemma_compile" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


def test_package_import_is_lazy():
    r = _run("""
import json, sys
import dgemma_compile as dg
before = "torch" in sys.modules
names = sorted(dg.__all__)
missing = [n for n in names if n not in dir(dg)]
print(json.dumps({"torch": before, "missing": missing}))
""")
    assert r == {"torch": False, "missing": []}


def test_load_and_build_import_no_dynamo_or_inductor():
    """Compared with what plain `import torch` imports (none of them, torch 2.11 to 2.13): `load` builds the model on
    the meta device without meta arithmetic (torch's decompositions import Dynamo), `build` compiles nothing."""
    r = _run(f"""
import json, sys
import torch
base = {{m for m in sys.modules if m.startswith({COMPILER!r})}}
import dgemma_compile as dg
from dgemma_compile.demo import DEMO_MODEL
model = dg.load(DEMO_MODEL)
gen = dg.build(model)
dg.CompileOptions, dg.generate, dg.CompiledGenerator
import dgemma_compile.compile, dgemma_compile.compile.passes
added = sorted(m for m in sys.modules if m.startswith({COMPILER!r}) and m not in base)
print(json.dumps({{"added": added, "gen": type(gen).__name__}}))
""")
    assert r["gen"] == "CompiledGenerator"
    assert r["added"] == [], r["added"][:10]


def test_public_names_resolve_to_their_objects():
    import importlib

    import dgemma_compile as dg

    sources = {"Canvas": "step.canvas", "CompiledGenerator": "compile", "CompileOptions": "compile",
               "build": "compile", "ConfigError": "model.config", "GenerationConfig": "model.config",
               "ModelConfig": "model.config", "GenerationOutput": "step.requests", "RequestStats": "step.requests",
               "generate": "oracle", "CacheFullError": "model.kv_cache", "KVCache": "model.kv_cache",
               "CheckpointError": "model.loader", "load": "model.loader", "load_tokenizer": "model.loader",
               "DiffusionGemma": "model.backbone", "Observer": "step.observe", "QuantReport": "quant",
               "quantize": "quant", "encode": "model.forwards", "denoise": "model.forwards"}
    assert set(sources) == set(dg.__all__)
    for name, sub in sources.items():
        assert getattr(dg, name) is getattr(importlib.import_module(f"dgemma_compile.{sub}"), name), name
    assert set(dg.__all__) <= set(dir(dg))
    ns: dict = {}
    exec("from dgemma_compile import *", ns)
    assert set(dg.__all__) <= set(ns)
    with pytest.raises(AttributeError):
        dg.no_such_name  # noqa: B018


def test_cli_choices_match_their_sources():
    import torch

    from dgemma_compile import cli
    from dgemma_compile.model.config import FLOAT32_MAX
    from dgemma_compile.model.loader import FLOAT_DTYPES
    from dgemma_compile.cli.ranks import DEFAULT_GROUP_TIMEOUT_S
    from dgemma_compile.quant.schemes import SCHEMES

    assert cli.QUANT_SCHEMES == SCHEMES
    assert cli.DEFAULT_GROUP_TIMEOUT_S == DEFAULT_GROUP_TIMEOUT_S
    assert cli.FLOAT32_MAX == FLOAT32_MAX
    assert {getattr(torch, name) for name in cli.DTYPES} == set(FLOAT_DTYPES.values())


@pytest.mark.slow  # a CLI answer in a fresh interpreter: ~10 s
def test_an_eager_answer_imports_no_compiler(tmp_path):
    """`dgemma generate PROMPT` answered by the eager step (no compile) never imports Dynamo or Inductor (seconds of
    a start: FlexAttention's `create_block_mask` would import Dynamo, `masks.make_block_mask` does not): a unit's
    backend imports them when a graph compiles.
    An empty compile cache: with the step cached, `--compile auto` loads it instead (an AOTInductor package, which
    imports no compiler either: tests/compile/test_aoti.py)."""
    r = _run("""
import contextlib, io, json, os, sys
os.environ["DGEMMA_CACHE_DIR"] = EMPTY_CACHE
from dgemma_compile.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["generate", "--compile", "auto", "sort 3 1 2 9 5="])
print(json.dumps({"code": code, "answer": out.getvalue().strip(),
                  "compiler": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)}))
""".replace("EMPTY_CACHE", repr(str(tmp_path / "empty-cache"))))
    assert (r["code"], r["answer"]) == (0, "1 2 3 5 9")
    assert r["compiler"] == []
