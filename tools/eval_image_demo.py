#!/usr/bin/env python
"""Evaluate the image demo checkpoint on held-out image prompts: the demo tasks with their operands drawn in an image.

Usage: ``python tools/eval_image_demo.py DIR [--n 200] [--offset 0] [--generator dgemma|dgemma-eager|transformers]
[--batch 8] [--attention dense] [--dump FILE]``

Prompts: ``dgemma_compile.demo.image_tasks.make_split("heldout", n, offset=offset)`` (offset 0: the test set of the
table in docs/demo.md; ``--offset 500``: the validation prompts the training run logs). Each goes through the user
path: the image through transformers' Gemma4 image processor (`preprocess.preprocess`, the checkpoint's
preprocessor_config.json), its placeholders through `text.ImageSlots` + `text.encode_prompt` (``sort <image>=``).
``dgemma`` runs `dgemma_compile.build(model)` (batches of ``--batch``; rows are batch-invariant on CPU),
``dgemma-eager`` the eager generator, ``transformers`` `DiffusionGemmaForBlockDiffusion.generate` with
``pixel_values`` at batch 1. Prints a markdown table: exact match per task and overall, mean denoise steps per
block, tokens per forward, the share of blocks stopped before the step limit. ``--dump`` writes the generated ids.
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

from dgemma_compile.demo import image_tasks as IT
from dgemma_compile.demo import tasks as T


def encode(model, tok, examples):
    """(prompt ids, [images.Image]) per example, through the processor and the prompt assembly."""
    from dgemma_compile.inputs.preprocess import num_soft_tokens, preprocess
    from dgemma_compile.inputs.text import ImageSlots, encode_prompt

    out = []
    for ex, im in examples:
        imgs = preprocess(model, [im])
        slots = ImageSlots.for_model(tok, model, [num_soft_tokens(model, x) for x in imgs])
        out.append((encode_prompt(tok, ex.prompt, bos_token_id=model.config.bos_token_id, images=slots), imgs))
    return out


def run_dgemma(model, encoded, cfg, batch: int, eager: bool):
    """Generated ids and steps per block per prompt (seed 0)."""
    import dgemma_compile as dg

    gen = None if eager else dg.build(model)
    seqs, steps = [], []
    for i in range(0, len(encoded), batch):
        part = encoded[i:i + batch]
        prompts, imgs = [p for p, _ in part], [x for _, x in part]
        out = (dg.generate(model, prompts, cfg, seed=0, images=imgs) if eager
               else gen.generate(prompts, cfg, seed=0, images=imgs))
        seqs += out.sequences
        steps += [s.steps_per_block for s in out.stats]
    return seqs, steps


def run_transformers(directory, encoded):
    """transformers' own generate with pixel_values, batch 1; decoder passes per block counted with forward hooks
    (every encoder call opens a block, as `eval_demo_model.transformers_generate`)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(directory).eval()
    seqs, steps = [], []
    blocks: list[int] = []
    h1 = ref.model.encoder.register_forward_hook(lambda *_: blocks.append(0))
    h2 = ref.model.decoder.register_forward_hook(lambda *_: blocks.__setitem__(-1, blocks[-1] + 1))
    try:
        with torch.no_grad():
            for ids, imgs in encoded:
                blocks.clear()
                im = imgs[0]
                out = ref.generate(torch.tensor([ids]), pixel_values=im.pixel_values[None],
                                   image_position_ids=im.position_ids[None], generation_config=ref.generation_config)
                seq = out.sequences if hasattr(out, "sequences") else out
                seqs.append(seq[0, len(ids):].tolist())
                steps.append([b for b in blocks if b > 0])
    finally:
        h1.remove()
        h2.remove()
    return seqs, steps


def score(tok, examples, seqs, steps, limit: int) -> dict:
    per = defaultdict(lambda: [0, 0])
    tokens = passes = early = blocks = 0
    samples = []
    for (ex, _), ids, st in zip(examples, seqs, steps):
        n_tok = sum(1 for t in ids if t != tok.pad_token_id)
        if tok.eos_token_id in ids:
            ids = ids[:ids.index(tok.eos_token_id)]
        text = tok.decode(ids, skip_special_tokens=True)
        ok = T.check(ex.text_prompt, text)
        per[ex.task][0] += ok
        per[ex.task][1] += 1
        tokens += n_tok
        passes += sum(st)
        blocks += len(st)
        early += sum(1 for s in st if s < limit)
        if not ok and len(samples) < 8:
            samples.append((ex.prompt, ex.shown, text))
    n = sum(v[1] for v in per.values())
    return {"exact": {t: v[0] / v[1] for t, v in per.items()}, "overall": sum(v[0] for v in per.values()) / max(n, 1),
            "n": n, "steps_per_block": passes / max(blocks, 1), "tokens_per_forward": tokens / max(passes, 1),
            "early_stop_share": early / max(blocks, 1), "blocks": blocks, "failures": samples}


def table(m: dict, offset: int) -> str:
    rows = ["| metric | value |", "|---|---|"]
    rows += [f"| exact match `{t}` | {100 * m['exact'][t]:.1f}% |" for t in T.TASKS if t in m["exact"]]
    rows += [f"| exact match overall (n={m['n']}, held-out {offset}-{offset + m['n'] - 1}) | {100 * m['overall']:.1f}% |",
             f"| mean denoise steps per block | {m['steps_per_block']:.2f} |",
             f"| tokens per forward | {m['tokens_per_forward']:.2f} |",
             f"| blocks stopped before step limit | {100 * m['early_stop_share']:.1f}% ({m['blocks']} blocks) |"]
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--generator", default="dgemma", choices=["dgemma", "dgemma-eager", "transformers"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention", default=None, help="dg.load's attention (e.g. dense: the reference, fast eagerly)")
    ap.add_argument("--dump")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import dgemma_compile as dg

    model = dg.load(args.dir) if args.attention is None else dg.load(args.dir, attention=args.attention)
    tok = dg.load_tokenizer(args.dir)
    cfg = model.generation_config
    examples = IT.make_split("heldout", args.n, offset=args.offset)
    t0 = time.time()
    encoded = encode(model, tok, examples)
    if args.generator == "transformers":
        seqs, steps = run_transformers(args.dir, encoded)
    else:
        seqs, steps = run_dgemma(model, encoded, cfg, args.batch, eager=args.generator == "dgemma-eager")
    m = score(tok, examples, seqs, steps, cfg.max_denoising_steps)
    print(table(m, args.offset))
    print(f"\n({time.time() - t0:.0f}s, generator={args.generator}, attention={args.attention or 'default'})")
    for p, shown, got in m["failures"]:
        print(f"BAD {p!r} image {shown!r} -> {got!r}")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(seqs, f)


if __name__ == "__main__":
    main()
