"""`python -m bench.half_gemm`: the bf16 cliff of CPUs without native bf16 matmul, and what `compute_dtype` does
about it, side by side in one run.

    python -m bench.half_gemm                      # GEMM table + the demo model cast to bf16, three dtype modes
    python -m bench.half_gemm --prompts 16 --out bench/results/half_gemm_cpu_$(date +%F).md

1. GEMM: one-thread GFLOP/s of [256, 1024] x [1024, 4096] and of `compute_dtype.PROBE_SHAPE` in float32 and bf16, on
   this host's own paths and on an AVX2-only CPU's (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`: ATen's and
   oneDNN's switches to the paths such a CPU runs), each in a subprocess; plus what `compute_dtype.probe` decides.
2. End to end: the shipped demo checkpoint cast to bf16 (written once to a scratch directory), `dgemma generate
   --compile never --prompts-file` over `--prompts` held-out demo prompts, on the AVX2-only paths, with the default
   dtype (the probe decides), `--dtype float32` and `--dtype bfloat16` (the cliff the default avoids); wall time to
   exit, the stats line's dtype, exact-match accuracy. The ratio of interest: default / float32 (target <= 1.0,
   within noise) and bfloat16 / default. The demo model is small (its GEMMs are a minor part of a step), so:
3. The same three modes on the `scaled` bench model (bench/models.py: ~93M parameters, bf16, DiffusionGemma's
   proportions; the demo's tokenizer beside it), one prompt, `--max-new-tokens 16 --max-denoising-steps 2` (a prefill,
   two denoise steps and a commit: four 256-token forwards), where the GEMMs are most of the time. Random weights:
   the check is that the default's text equals `--dtype float32`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.environment import device_name, git_commit, load_average, publish, today, versions

REPO = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
GEMM_CODE = """
import json, time, torch
from dgemma_compile.model import compute_dtype
torch.set_num_threads(1)
out = {}
for m, k, n in [(256, 1024, 4096), compute_dtype.PROBE_SHAPE]:
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dt), torch.randn(k, n).to(dt)
        a @ b
        best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(2))
        out[f"[{m}, {k}] x [{k}, {n}] {str(dt)[6:]}"] = 2 * m * k * n / best / 1e9
p = compute_dtype.probe(torch.bfloat16)
out["probe"] = f"{p.ratio:.1f}x float32's time: {'slow -> float32' if p.slow else 'native -> bf16 kept'}"
print(json.dumps(out))
"""


def gemm_table(env_extra: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", GEMM_CODE], env={**os.environ, **env_extra}, capture_output=True,
                       text=True, check=True, timeout=600)
    return json.loads(p.stdout)


def bf16_demo(directory: Path) -> Path:
    """The shipped demo checkpoint with every float tensor cast to bf16 (tokenizer and configs copied)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from dgemma_compile.demo import DEMO_MODEL

    if not (directory / "model.safetensors").exists():
        directory.mkdir(parents=True, exist_ok=True)
        for f in Path(DEMO_MODEL).iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, directory / f.name)
        state = load_file(str(Path(DEMO_MODEL) / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def scaled_with_tokenizer(directory: Path) -> Path:
    """The `scaled` bench checkpoint's files linked into `directory` beside the demo's tokenizer (ids < 16384)."""
    from bench.models import resolve
    from dgemma_compile.demo import DEMO_MODEL

    directory.mkdir(parents=True, exist_ok=True)
    for f in Path(resolve("scaled").checkpoint).iterdir():
        (directory / f.name).symlink_to(f)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (directory / name).symlink_to(Path(DEMO_MODEL) / name)
    return directory


def generate(model: Path, inputs: list[str], flags: list[str], env_extra: dict) -> dict:
    cmd = [sys.executable, "-m", "dgemma_compile.cli", "generate", "--model", str(model), "--compile", "never",
           *inputs, *flags]
    start = time.perf_counter()
    p = subprocess.run(cmd, env={**os.environ, **env_extra}, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    stats = p.stderr.strip().splitlines()[-1]
    dtype = next((f.split("=", 1)[1] for f in stats.split() if f.startswith("dtype=")), "?")
    return {"wall_s": wall, "dtype": dtype, "answers": p.stdout.splitlines()}


MODES = [("default (probe decides)", []), ("--dtype float32", ["--dtype", "float32"]),
         ("--dtype bfloat16", ["--dtype", "bfloat16"])]


def rounds(repeats: int, run) -> dict[str, dict]:
    """`run(flags)` for every mode, `repeats` rounds round-robin (mode 1, 2, 3, then again); the median wall time."""
    import statistics

    results: dict[str, list[dict]] = {name: [] for name, _ in MODES}
    for _ in range(repeats):
        for name, flags in MODES:
            results[name].append(run(flags))
    return {name: {**rs[0], "wall_s": statistics.median(r["wall_s"] for r in rs)} for name, rs in results.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="held-out demo prompts of the end-to-end rows")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the end-to-end rows (medians reported)")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    ap.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    args = ap.parse_args(argv)

    from dgemma_compile.demo.tasks import check, make_split

    lines = [f"# bf16 on a CPU without native bf16 matmul: the cliff and compute_dtype ({today()})", "",
             f"`python -m bench.half_gemm --prompts {args.prompts} --repeats {args.repeats}`", "",
             f"- device: {device_name('cpu')}; load average at the start: {load_average()}",
             f"- versions: {versions()}; commit {git_commit()}"]
    if args.note:
        lines.append(f"- {args.note}")
    native, avx2 = gemm_table({}), gemm_table(AVX2_ONLY)
    lines += ["", "## GEMM, one thread (GFLOP/s)", "", "| GEMM | this host's paths | AVX2-only paths |", "|---|---|---|"]
    for k in native:
        fmt = (lambda v: f"{v:.2f}") if k != "probe" else str
        lines.append(f"| {k} | {fmt(native[k])} | {fmt(avx2[k])} |")

    tasks = [p for _, p, _ in make_split("heldout", args.prompts, seed=0)]
    with tempfile.TemporaryDirectory() as tmp:
        model = bf16_demo(Path(tmp) / "demo-bf16")
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in tasks))
        rows = rounds(args.repeats, lambda flags: generate(model, ["--prompts-file", str(prompts)], flags, AVX2_ONLY))
        scaled = scaled_with_tokenizer(Path(tmp) / "scaled")
        budget = ["--max-new-tokens", "16", "--max-denoising-steps", "2"]
        scaled_rows = rounds(args.repeats, lambda flags: generate(scaled, ["sort 3 1 2="], budget + flags, AVX2_ONLY))
    base = rows["default (probe decides)"]["wall_s"]
    lines += ["", f"## `dgemma generate --compile never --prompts-file` ({args.prompts} held-out demo prompts, the demo "
              "checkpoint cast to bf16), AVX2-only paths", "",
              "| dtype flag | dtype ran | wall s (median) | / default | exact match |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        right = sum(check(t, json.loads(a)["text"]) for a, t in zip(r["answers"], tasks))
        lines.append(f"| {name} | {r['dtype']} | {r['wall_s']:.1f} | {r['wall_s'] / base:.2f}x | "
                     f"{right}/{len(tasks)} |")
    base = scaled_rows["default (probe decides)"]
    lines += ["", "## `dgemma generate --compile never --max-new-tokens 16 --max-denoising-steps 2` on the scaled "
              "model (bf16 checkpoint), AVX2-only paths", "",
              "| dtype flag | dtype ran | wall s (median) | / default | text equals the default's |", "|---|---|---|---|---|"]
    for name, r in scaled_rows.items():
        lines.append(f"| {name} | {r['dtype']} | {r['wall_s']:.1f} | {r['wall_s'] / base['wall_s']:.2f}x | "
                     f"{r['answers'] == base['answers']} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
