"""`python -m bench.batch_invariance`: what batch-invariant rows need on this CPU, and what they cost.

    OMP_NUM_THREADS=1 python -m bench.batch_invariance [--models demo,scaled] [--reps 5]

1. GEMM rows (`gemm`): per projection shape of the demo (float32, T = 16) and of the released width (bfloat16,
   T = 256), a GEMM over M = B x T rows against each row block alone (M = T), B = 1..16; then, per shape, the row
   counts M in 1..64 (and a few above) at which a row's bits differ from the same row in an M = 512 call. The rows
   of a CPU GEMM change with M only below a dtype's switch (`compile.options.GEMM_ROW_SWITCH`); the model's GEMMs all
   have M = B x T above it. Also `torch._grouped_mm` (the bfloat16 experts): a token alone in its expert's group vs
   in groups of up to 256.
2. Cost (`cost`): `CompileOptions(batch_invariant=True)` against `False` on the demo and the scaled model, one bucket
   of 1 and one of 16 rows: p50 latency of one request (bucket 1) and throughput of 16 requests (bucket 16, generated
   tokens / s), interleaved on/off repetitions, medians and ratios. Warm-up (compiles) excluded. The demo runs its
   held-out task prompts with its checkpoint's config; the scaled model (random weights) random prompts, one block of
   4 denoise steps per request.

Writes bench/results/batch_invariance_cpu_<date>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import environment

RESULTS = Path(__file__).resolve().parent / "results"
DEMO = {"q_proj sliding": (128, 128), "k/v_proj sliding": (128, 64), "q_proj full": (128, 256),
        "o_proj full": (256, 128), "mlp gate/up": (128, 256), "mlp down": (256, 128), "router": (128, 8),
        "lm_head (V 27)": (128, 27), "self-conditioning product": (27, 128)}
RELEASED = {"q_proj sliding": (2816, 4096), "k/v_proj sliding": (2816, 2048), "q_proj full": (2816, 8192),
            "k_proj full": (2816, 1024), "o_proj sliding": (4096, 2816), "o_proj full": (8192, 2816),
            "mlp gate/up": (2816, 2112), "mlp down": (2112, 2816), "router (E 128)": (2816, 128),
            "expert gate/up": (2816, 1408), "expert down": (704, 2816),
            "lm_head (V slice 32768)": (2816, 32768), "self-conditioning product (V slice 32768)": (32768, 2816)}
SMALL_M = list(range(1, 65)) + [96, 128, 256]


def gemm_rows(dtype: torch.dtype, shapes: dict, T: int, batches: tuple[int, ...]) -> list[str]:
    """Markdown rows: per shape, the batch sizes whose row blocks differ from their solo GEMM, and the small M that
    differ from an M = 512 call."""
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (K, N) in shapes.items():
        W = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
        x = torch.randn(max(max(batches) * T, 512), K, generator=g).to(dtype)
        solo = [F.linear(x[b * T:(b + 1) * T], W) for b in range(max(batches))]
        bad_b = []
        for B in batches:
            y = F.linear(x[:B * T], W)
            if not all(torch.equal(y[b * T:(b + 1) * T], solo[b]) for b in range(B)):
                bad_b.append(B)
        big = F.linear(x[:512], W)
        bad_m = [M for M in SMALL_M if not torch.equal(F.linear(x[:M], W), big[:M])]
        out.append(f"| {name} | {K} | {N} | {', '.join(map(str, bad_b)) or 'none'} | "
                   f"{', '.join(map(str, bad_m)) or 'none'} |")
    return out


def grouped_rows() -> str:
    """Whether a token's `torch._grouped_mm` output (bfloat16, 2816 -> 1408) depends on its group's size."""
    g = torch.Generator().manual_seed(0)
    E, D, N = 8, 2816, 1408
    w = (torch.randn(E, D, N, generator=g) * D ** -0.5).to(torch.bfloat16)
    x = torch.randn(256, D, generator=g).to(torch.bfloat16)
    one = torch._grouped_mm(x[:1], w, offs=torch.tensor([1] * E, dtype=torch.int32))
    sizes = [n for n in (2, 5, 17, 33, 100, 256)
             if not torch.equal(torch._grouped_mm(x[:n], w, offs=torch.tensor([n] * E, dtype=torch.int32))[:1], one)]
    return f"`torch._grouped_mm` (bfloat16, 2816 -> 1408): a token's row differs between a group of 1 and groups of " \
           f"{sizes or 'none of 2, 5, 17, 33, 100, 256'}."


def cost(model_name: str, reps: int) -> list[str]:
    """p50 latency (bucket 1) and throughput (bucket 16) with batch_invariant on and off, interleaved."""
    import dgemma_compile as dg
    from dgemma_compile.compile import CompileOptions

    from .models import load_ours, resolve

    model = load_ours(resolve(model_name), torch.device("cpu"), None)
    cfg = model.generation_config
    if model_name != "demo":  # random weights: one block of 4 denoise steps (no early stop), fixed work per request
        cfg = cfg.replace(max_new_tokens=model.config.canvas_length, max_denoising_steps=4, confidence_threshold=1e9)
    V, C = model.config.vocab_size, model.config.canvas_length
    if model_name == "demo":  # held-out task prompts (as bench/serve.py)
        from dgemma_compile.demo import DEMO_MODEL, tasks
        from dgemma_compile.inputs.text import encode_prompt

        tok = dg.load_tokenizer(DEMO_MODEL)
        prompts = [encode_prompt(tok, q, bos_token_id=model.config.bos_token_id)
                   for _, q, _ in tasks.make_split("heldout", 16, seed=0)]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [[2] + torch.randint(3, V, (20 + 3 * i,), generator=g).tolist() for i in range(16)]
    gens, setup = {}, {}
    for on in (True, False):
        t0 = time.perf_counter()
        gen = dg.build(model, CompileOptions(batch_buckets=(1, 16), max_seq_len=512 if C > 64 else 256,
                                             batch_invariant=on))
        gen.warmup(1, cfg)
        gen.warmup(16, cfg)
        gens[on], setup[on] = gen, time.perf_counter() - t0
    lat, tput = {True: [], False: []}, {True: [], False: []}
    for _ in range(reps):
        for on in (True, False):
            t0 = time.perf_counter()
            gens[on].generate(prompts[:1], cfg, seed=0)
            lat[on].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = gens[on].generate(prompts, cfg, seed=list(range(16)))
            tput[on].append(sum(s.num_tokens for s in out.stats) / (time.perf_counter() - t0))
    same = gens[True].generate(prompts, cfg, seed=list(range(16))).sequences == \
        gens[False].generate(prompts, cfg, seed=list(range(16))).sequences
    l_on, l_off = statistics.median(lat[True]), statistics.median(lat[False])
    t_on, t_off = statistics.median(tput[True]), statistics.median(tput[False])
    return [f"| {model_name} | {gens[True].moe_impl} / {gens[False].moe_impl} | {l_on * 1e3:.0f} | {l_off * 1e3:.0f} | "
            f"{100 * (l_on / l_off - 1):+.1f}% | {t_on:.0f} | {t_off:.0f} | {100 * (1 - t_on / t_off):+.1f}% | "
            f"{'yes' if same else 'NO'} | {setup[True]:.0f} / {setup[False]:.0f} |"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_invariance", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,scaled", help="models of the cost table (empty: skip it)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lines = [f"# Batch-invariant rows: what they need and cost, CPU ({environment.today()})", "",
             f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python -m bench.batch_invariance "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"- device: {environment.device_name('cpu')}; threads {torch.get_num_threads()}; load average (1/5/15 "
             f"min) at the start: {environment.load_average()}",
             f"- versions: {environment.versions()}; commit {environment.git_commit()}", ""]
    if not args.skip_gemm:
        header = ["| shape | K | N | B (of 1, 2, 3, 4, 8, 16 demo; up to 8 released) whose row blocks differ from "
                  "solo | M (1-64, 96, 128, 256) whose rows differ from M = 512's |", "|---|---|---|---|---|"]
        lines += ["## GEMM rows: demo, float32, T = 16", ""] + header + \
            gemm_rows(torch.float32, DEMO, 16, (1, 2, 3, 4, 8, 16)) + ["", "## GEMM rows: released width, bfloat16, "
                                                                       "T = 256", ""] + header + \
            gemm_rows(torch.bfloat16, RELEASED, 256, (1, 2, 3, 4, 8)) + ["", grouped_rows(), ""]
        print("\n".join(lines), flush=True)
    models = [m for m in args.models.split(",") if m]
    if models:
        lines += ["## Cost: batch_invariant on vs off (buckets 1 and 16)", "",
                  "| model | moe on / off | p50 latency B=1 on ms | off ms | cost | 16 requests tok/s on | off | cost "
                  "| same tokens | setup s on / off |", "|---|---|---|---|---|---|---|---|---|---|"]
        for m in models:
            lines += cost(m, args.reps)
            print(lines[-1], flush=True)
        lines += ["", f"Load average at the end: {environment.load_average()}.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"batch_invariance_cpu_{environment.today()}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
