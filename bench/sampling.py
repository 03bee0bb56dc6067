"""Sampler cost at the released vocabulary: why `sampler.SCHEME` is a chunked inverse CDF and not Gumbel-max.

    OMP_NUM_THREADS=1 python -m bench.sampling [--vocab 262144] [--canvas 256] [--repeats 5]

Times, side by side in one run (median of `--repeats` after one warm-up, each function `torch.compile`d), on
float32 logits [1, C, V] scaled by 1/T:
- entropy + argmax alone (what every scheme needs),
- the unchunked inverse CDF (softmax + cumsum over V + searchsorted),
- the chunked inverse CDF of `sampler.sample_chunked_icdf` (one uniform per position from `rng.step_noise`),
- Gumbel-max with Philox noise per vocabulary entry (`rng.philox4x32` on C*V/4 counters, 4 words each).
Prints a markdown table with each time and its ratio to entropy + argmax.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dgemma_compile.step import rng, sampler


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--canvas", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    C, V = args.canvas, args.vocab
    logits = torch.randn(1, C, V) * 4 / 0.6
    seeds = rng.seed_tensor([0])
    block, step = torch.tensor(0), torch.tensor(5)

    def base():
        return sampler.entropy(logits), logits.argmax(-1)

    def unchunked():
        u, _ = rng.step_noise(seeds, block, step, C, V)
        return sampler.entropy(logits), sampler.sample_inverse_cdf(logits, u)

    def chunked():
        u, _ = rng.step_noise(seeds, block, step, C, V)
        return sampler.entropy(logits), sampler.sample_chunked_icdf(logits, u)

    def gumbel():
        pos = torch.arange(C)[:, None]
        lane = rng.LANE_VOCAB_BASE + torch.arange(V // 4)[None, :]
        counter = torch.stack(torch.broadcast_tensors(block, step, pos, lane), dim=-1)
        key = torch.stack((seeds & 0xFFFFFFFF, seeds >> 32), dim=-1)
        u = rng.to_uniform(rng.philox4x32(counter, key).reshape(1, C, V)).clamp(min=2**-25)
        return sampler.entropy(logits), (logits - torch.log(-torch.log(u))).argmax(-1)

    rows = []
    for name, fn in (("entropy + argmax", base), ("inverse CDF, unchunked", unchunked),
                     (f"inverse CDF, chunked {sampler.SAMPLE_CHUNK} (SCHEME)", chunked),
                     ("Gumbel-max, Philox per entry", gumbel)):
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        rows.append((name, _time(compiled, args.repeats)))
    ref = rows[0][1]
    md = [f"Sampler cost, [1, {C}, {V}] float32, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"compiled, median of {args.repeats}", "", "| sampler | ms | x entropy+argmax |", "|---|---:|---:|"]
    md += [f"| {name} | {s * 1e3:.1f} | {s / ref:.2f} |" for name, s in rows]
    out = "\n".join(md)
    print(out)
    return out


if __name__ == "__main__":
    main()
