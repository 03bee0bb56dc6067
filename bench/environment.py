"""What the results were measured on: versions, device, threads, machine load, and a bandwidth estimate."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} logical CPUs, {torch.backends.cpu.get_cpu_capability()})"
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_tag(device: str) -> str:
    """Short name for result files: cpu, h200, h100, ... (the GPU name's last word) or cuda."""
    if not device.startswith("cuda"):
        return "cpu"
    words = [w for w in torch.cuda.get_device_name(torch.device(device)).lower().replace("-", " ").split() if w != "nvidia"]
    return words[0] if words else "cuda"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # the full-size GPU run needs no transformers
        tf = "not installed"
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": tf,
            "dgemma_compile": git_commit(), "cuda": torch.version.cuda or "-"}


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def cpu_copy_bandwidth(mb: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large single-threaded tensor copy (read + write counted): a rough CPU memory bandwidth."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(mb * 2**20 // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def cpu_matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of a few single-threaded n x n x n matmuls in `dtype`: a rough CPU compute peak."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(threads)


def checkpoint_id(directory: str | None) -> str:
    """`path (weights sha256 prefix, modified time)` of a checkpoint directory, or a note for direct builds."""
    import hashlib

    if directory is None:
        return "none: random weights built directly on the device (seed 0)"
    h = hashlib.sha256()
    files = sorted(Path(directory).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    stamp = max((f.stat().st_mtime for f in files), default=0)
    when = datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{directory} (weights sha256 {h.hexdigest()[:12]}, written {when})"


def publish(lines: list[str], out: Path | None) -> str:
    """A report's markdown lines joined, printed, and written to `out` when given; returns the text."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out:
        out.write_text(report)
    return report
