"""`python -m bench.vocabulary_region`: the vocabulary-wide region of a denoise step (the softcap, then
`sampler.sample_step`), compiled alone, as it was composed up to 9f18d7c and as it is now, side by side in one run.

    python -m bench.vocabulary_region                        # the scaled model's shape: [1, 256, 16384] bf16 logits
    python -m bench.vocabulary_region --batch 8 --vocab 27   # the demo model's shape at batch 8
    python -m bench.vocabulary_region --out bench/results/vocabulary_region_cpu_$(date +%F).md

Issue 39 item 3. Up to 9f18d7c, `sample_step` took the softmax, the logsumexp of the entropy and the sampler's
chunk masses each after subtracting its own max, so Inductor made three vocabulary-wide exp passes and two more max
passes over the scaled logits (its kernel in the scaled model's step: seven loops over the [256, 16384] float32
logits, five after). The max of the scaled logits is exactly +0, so one exp pass serves all three; `sample_step` now computes it
once (`sampler.sample_step`'s comments). `before` below is the old composition, kept here as the fixture; `after`
is the package's. Both compiled with `torch.compile(fullgraph=True)` on this host's default Inductor settings (one
thread), each output compared bit for bit (the claim: the same bits), then timed in interleaved rounds (median of
`--calls` calls per round, then the median over rounds; and the median of the per-round ratios, which cancels a
slow spell of this shared machine).

Writes the markdown report to `--out` when given and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.environment import device_name, git_commit, load_average, publish, today, versions
from dgemma_compile.step import sampler

SOFTCAP = 30.0  # the released checkpoint's final_logit_softcapping


def sample_step_before(logits_BCV, temperature_B, greedy_B, uniform_BC, allowed_BW=None, constrained_B=None):
    """`sampler.sample_step` as composed up to 9f18d7c: softmax, logsumexp and the chunk masses each subtract
    their own max (the reference the shared exp pass is checked against, bit for bit)."""
    greedy_B11 = greedy_B[:, None, None]
    x = logits_BCV.float()
    if allowed_BW is not None:
        x = sampler.mask_first(x, allowed_BW, constrained_B)
    shifted = x - x.amax(dim=-1, keepdim=True)
    big = torch.finfo(shifted.dtype).max  # `sampler`'s finite clamp
    scaled = (shifted / torch.where(greedy_B, 1.0, temperature_B)[:, None, None]).clamp(-big, big)
    argmax = scaled.argmax(dim=-1)
    sampled = torch.where(greedy_B[:, None], argmax, sampler.sample_chunked_icdf(scaled, uniform_BC))
    ent = torch.where(greedy_B[:, None], 0.0, sampler.entropy(scaled))
    one_hot = torch.where(torch.arange(scaled.shape[-1], device=scaled.device) == argmax[..., None], 0.0,
                          torch.finfo(scaled.dtype).min)
    sc_probs = torch.softmax(torch.where(greedy_B11, one_hot, scaled), dim=-1)
    return sampler.SampleStep(argmax=argmax, sampled=sampled, entropy=ent, sc_probs=sc_probs)


def region(sample_step):
    """The step's vocabulary region around `sample_step`: the lm_head's output (in the model dtype) to float32,
    soft-capped (`DiffusionGemma.logits`), then the sample step."""
    def run(head_BCV, temperature_B, greedy_B, uniform_BC, allowed_BW, constrained_B):
        logits = torch.tanh(head_BCV.float() / SOFTCAP) * SOFTCAP
        return sample_step(logits, temperature_B, greedy_B, uniform_BC, allowed_BW, constrained_B)
    return run


def inputs(batch: int, canvas: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """Random head outputs (spread like trained logits) and per-row parameters: row 1 greedy and row 2 constrained
    (a grammar allowing every other id) when the batch has them."""
    g = torch.Generator().manual_seed(seed)
    head = (torch.randn(batch, canvas, vocab, generator=g) * 8).to(dtype)
    temperature = torch.full((batch,), 0.7)
    greedy = torch.zeros(batch, dtype=torch.bool)
    greedy[1:2] = True
    allowed = torch.full((batch, -(-vocab // 32)), -1, dtype=torch.int32)
    constrained = torch.zeros(batch, dtype=torch.bool)
    if batch > 2:
        allowed[2] = 0x55555555
        constrained[2] = True
    return head, temperature, greedy, torch.rand(batch, canvas, generator=g), allowed, constrained


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=16384, help="16384: the scaled bench model's; 27: the demo's")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the lm_head's output dtype")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per variant per round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    args_in = inputs(args.batch, args.canvas, args.vocab, getattr(torch, args.dtype))
    variants = {"before (9f18d7c)": torch.compile(region(sample_step_before), fullgraph=True),
                "after": torch.compile(region(sampler.sample_step), fullgraph=True)}
    compile_s, outs = {}, {}
    with torch.no_grad():
        for name, fn in variants.items():
            t = time.perf_counter()
            outs[name] = fn(*args_in)
            compile_s[name] = time.perf_counter() - t
        same = {field: torch.equal(a, b) for field, a, b in zip(sampler.SampleStep.__annotations__, *outs.values())}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                calls = []
                for _ in range(args.calls):
                    t = time.perf_counter()
                    variants[name](*args_in)
                    calls.append(time.perf_counter() - t)
                times[name].append(statistics.median(calls))
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    best = {name: 1e3 * min(ts) for name, ts in times.items()}
    paired = statistics.median(b / a for b, a in zip(*times.values()))  # per round: cancels a slow spell
    before, after = ms.values()
    shape = f"[{args.batch}, {args.canvas}, {args.vocab}] {args.dtype}"
    lines = [f"# The vocabulary region of a denoise step, compiled alone: before and after the shared exp pass "
             f"({today()})", "",
             f"`python -m bench.vocabulary_region --batch {args.batch} --canvas {args.canvas} --vocab {args.vocab} "
             f"--dtype {args.dtype} --rounds {args.rounds} --calls {args.calls}`", "",
             f"- device: {device_name('cpu')}, one thread; load average at the end: {load_average()}",
             f"- versions: {versions()}; commit {git_commit()}",
             f"- logits {shape}; row 1 greedy, row 2 constrained where the batch has them", "",
             "| variant | median ms per call | min ms | compile + first call s |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {ms[name]:.2f} | {best[name]:.2f} | {compile_s[name]:.1f} |" for name in variants]
    lines += ["", f"- before / after: **{before / after:.2f}x** of the medians, {paired:.2f}x paired (the median "
              f"over rounds of each round's ratio)",
              "- outputs equal bit for bit: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items())]
    publish(lines, args.out)
    if not all(same.values()):
        raise SystemExit("the two compositions gave different bits")


if __name__ == "__main__":
    main()
