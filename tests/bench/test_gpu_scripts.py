"""The GPU run's scripts (issue 37; bench/gpu_*.sh, docs/testing.md "The GPU run"): cheap checks only. The scripts
themselves are proved by bench/gpu_versions_check.sh and bench/gpu_rehearse.sh (minutes, network for the first)."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["gpu_prepare.sh", "gpu_install.sh", "gpu_run.sh", "gpu_versions_check.sh", "gpu_rehearse.sh"]
IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "tokenizers": "0.23.2",
         "safetensors": "0.8.0"}
"""The GPU image's versions (read 2026-11), which bench/gpu_versions_check.sh proves our code on."""


def _pins() -> dict[str, str]:
    text = (ROOT / "bench/gpu_requirements.txt").read_text()
    lines = [re.sub(r"#.*", "", line).strip() for line in text.splitlines()]
    return dict(line.split("==") for line in lines if line)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_parses(script):
    subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], check=True)


def test_the_carried_pins_are_exact_and_replace_nothing_of_the_image():
    pins = _pins()
    assert pins and all(re.fullmatch(r"[\w.+-]+", v) for v in pins.values())
    refused = re.compile(r"(torch|triton|nvidia[-_].*|cuda[-_].*|torchvision|torchaudio)")
    assert not [n for n in pins if refused.fullmatch(n.lower())]


def test_pyproject_ranges_hold_the_image_and_the_carried_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    want = {**IMAGE, **{n: v for n, v in _pins().items() if n in ("torchao", "xgrammar")}}
    for name, version in want.items():
        ranges = [r for r in reqs if r.name == name]
        assert ranges, name
        assert all(r.specifier.contains(version) for r in ranges), (name, version, [str(r) for r in ranges])


def test_gpu_prepare_refuses_a_pin_of_torch_before_fetching_anything(tmp_path):
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("xgrammar==0.2.9\ntorch==2.11.0  # would replace the image's\n")
    env = {**os.environ, "GPU_REQUIREMENTS": str(reqs), "GPU_CARRY": str(tmp_path / "carry"),
           "GPU_PREPARE_INDEX": "http://127.0.0.1:9/simple"}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu_prepare.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "refusing torch==2.11.0" in done.stderr
    assert not (tmp_path / "carry").exists()
