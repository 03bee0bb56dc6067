"""The compute dtype on a CPU without a fast half-precision GEMM (compute_dtype): the probe tells a slow path from a
native one, the loader upcasts a bf16 checkpoint to float32 only where the probe says slow, an explicit dtype is kept,
and the CLI's stats line says which dtype ran."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.model import compute_dtype
from helpers import hf_model, write_checkpoint

# ATen's and oneDNN's own switches to the code paths of an AVX2-only CPU: on any x86 host they run a bf16 GEMM through
# the reference path (0.2 GFLOP/s here, against 36 GFLOP/s float32), as a CPU without AVX512_BF16/AMX does
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _slow(dtype):
    return compute_dtype.HalfGemmProbe(dtype, half_s=1.0, float32_s=0.01)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    model = hf_model(vocab_size=48, layer_types=("sliding_attention", "full_attention")).to(torch.bfloat16)
    return write_checkpoint(tmp_path_factory.mktemp("bf16"), model, tokenizer=True)


@pytest.mark.slow
def test_the_probe_finds_the_avx2_paths_bf16_gemm_slow_and_float32_unaffected():
    code = ("import torch; from dgemma_compile.model import compute_dtype as c; p = c.probe(torch.bfloat16); "
            "print(p.ratio, p.slow)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2_ONLY}, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    assert float(out[0]) > compute_dtype.SLOW_RATIO and out[1] == "True", out


def test_a_native_probe_keeps_the_stored_dtype_and_only_half_cpu_checkpoints_are_probed(monkeypatch):
    calls = []

    def fake(dtype, repeats=5):
        calls.append(dtype)
        return compute_dtype.HalfGemmProbe(dtype, half_s=0.001, float32_s=0.004)  # 4x faster: AMX-like

    monkeypatch.setattr(compute_dtype, "probe", fake)
    assert compute_dtype.for_host(torch.bfloat16, torch.device("cpu")) == (torch.bfloat16, None)
    assert compute_dtype.for_host(torch.float32, torch.device("cpu")) == (torch.float32, None)
    assert compute_dtype.for_host(torch.bfloat16, torch.device("meta")) == (torch.bfloat16, None)
    assert calls == [torch.bfloat16]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="dtype: probe measures"):
        compute_dtype.probe(torch.float32)


def test_a_slow_probe_loads_a_bf16_checkpoint_as_float32_with_a_log_line_and_an_explicit_dtype_is_kept(
        bf16_dir, monkeypatch, caplog):
    monkeypatch.setattr(compute_dtype, "probe", _slow)
    with caplog.at_level(logging.INFO, logger="dgemma_compile"):
        upcast = dg.load(bf16_dir)
    assert upcast.dtype == torch.float32
    assert any("computing in float32, not the checkpoint's bfloat16" in r.getMessage() for r in caplog.records)
    assert dg.load(bf16_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    # the same weights as an explicit float32 load (bf16 values are exact in float32): same tokens
    ref = dg.load(bf16_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(upcast.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_dgemma_generate_on_an_avx2_only_cpu_computes_a_bf16_checkpoint_in_float32_as_dtype_float32_does(bf16_dir):
    def run(*flags):
        p = subprocess.run([sys.executable, "-m", "dgemma_compile.cli", "generate", "--model", str(bf16_dir),
                            "--compile", "never", "--max-new-tokens", "8", *flags, "ab="],
                           env={**os.environ, **AVX2_ONLY}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr

    auto_out, auto_err = run()
    f32_out, f32_err = run("--dtype", "float32")
    kept_out, kept_err = run("--dtype", "bfloat16")
    assert "computing in float32" in auto_err and "dtype=float32" in auto_err.splitlines()[-1]
    assert auto_out == f32_out and "dtype=float32" in f32_err.splitlines()[-1]
    assert "computing in float32" not in kept_err and "dtype=bfloat16" in kept_err.splitlines()[-1]


def test_adopted_measurements_decide_instead_of_measuring(monkeypatch):
    """A tensor-parallel group's ranks adopt rank 0's probes (cli.run._load), so they cannot load different dtypes."""
    monkeypatch.setattr(compute_dtype, "_adopted", {})
    monkeypatch.setattr(compute_dtype, "_probe", lambda *a: pytest.fail("measured although adopted"))
    compute_dtype.adopt({torch.bfloat16: _slow(torch.bfloat16)})
    assert compute_dtype.for_host(torch.bfloat16, torch.device("cpu")) == (torch.float32, _slow(torch.bfloat16))
