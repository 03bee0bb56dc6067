#!/usr/bin/env python
"""The demo model with and without a constraint that admits its answers (docs/constrained.md, "Quality and cost").

Usage: ``python tools/eval_constrained.py [--n 100] [--offset 0] [--seed 0] [--eager]``

Runs the held-out prompts ``tasks.make_split("heldout", n, offset=offset)`` twice through one generator (compiled by
default, a bucket of 8 rows; ``--eager``: the eager oracle), once free and once under the regex of each task's
answer format (lists: ``[0-9]( [0-9])*``, add: ``[0-9]{4}``), and prints a markdown table: exact match per task and
overall, tokens per forward, mean denoise steps per block, wall seconds per block (the whole run's wall time over
its blocks) and, constrained, the grammar's host milliseconds per block (`RequestStats.grammar_s`). ``--dump FILE``
writes both runs' ids (JSON) to compare token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

import dgemma_compile as dg
from dgemma_compile.inputs.constraint import Constraint
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.demo import tasks as T
from dgemma_compile.inputs.text import encode_prompt

FORMATS = {"sort": r"[0-9]( [0-9])*", "rev": r"[0-9]( [0-9])*", "dedup": r"[0-9]( [0-9])*", "add": r"[0-9]{4}"}


def run(generate, tok, examples, seed: int, constrained: bool) -> dict:
    ids = [encode_prompt(tok, p, bos_token_id=2) for _, p, _ in examples]
    cons = [Constraint.regex(FORMATS[t]) for t, _, _ in examples] if constrained else None
    start = time.perf_counter()
    out = generate(ids, seed=seed, constraint=cons, tokenizer=tok)
    wall = time.perf_counter() - start
    right, total = defaultdict(int), defaultdict(int)
    for (task, prompt, _), seq in zip(examples, out.sequences):
        total[task] += 1
        right[task] += T.check(prompt, tok.decode(seq, skip_special_tokens=True))
    st = out.stats
    blocks, passes = sum(s.blocks for s in st), sum(s.decoder_passes for s in st)
    return dict(right=right, total=total, tpf=sum(s.num_tokens for s in st) / passes, steps=passes / blocks,
                wall_per_block=wall / blocks, grammar_ms=1e3 * sum(s.grammar_s for s in st) / blocks,
                blocks=blocks, sequences=out.sequences)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--dump", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    examples = T.make_split("heldout", args.n, offset=args.offset)
    if args.eager:
        def generate(ids, **kw):
            return dg.generate(model, ids, moe_impl="dense", max_seq_len=256, **kw)
    else:
        gen = dg.build(model, dg.CompileOptions(batch_buckets=(8,), max_seq_len=256))
        gen.warmup(8)
        generate = gen.generate
    free, cons = run(generate, tok, examples, args.seed, False), run(generate, tok, examples, args.seed, True)
    print(f"{'eager' if args.eager else 'compiled (bucket 8)'}, {args.n} held-out prompts from {args.offset}, "
          f"seed {args.seed}, torch {torch.__version__}, {torch.get_num_threads()} thread\n")
    print("| run | " + " | ".join(T.TASKS) + " | all | tokens/forward | steps/block | wall s/block | grammar ms/block |")
    print("|---" * (len(T.TASKS) + 6) + "|")
    for name, r in (("free", free), ("regex of the answer format", cons)):
        cells = [f"{r['right'][t]}/{r['total'][t]}" for t in T.TASKS]
        all_ = f"{sum(r['right'].values())}/{sum(r['total'].values())}"
        grammar = f"{r['grammar_ms']:.3f}" if name != "free" else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {all_} | {r['tpf']:.2f} | {r['steps']:.2f} | "
              f"{r['wall_per_block']:.4f} | {grammar} |")
    same = sum(a == b for a, b in zip(free["sequences"], cons["sequences"]))
    print(f"\nidentical token sequences with and without the constraint: {same}/{args.n}")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({"free": free["sequences"], "constrained": cons["sequences"]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
