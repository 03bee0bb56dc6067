#!/usr/bin/env python
"""Evaluate a demo DiffusionGemma checkpoint on the held-out task prompts.

Usage: ``python tools/eval_demo_model.py DIR [--n 500] [--offset 0] [--seed 0] [--gen KEY=VALUE ...]``

``DIR`` holds config.json, generation_config.json, model.safetensors and the tokenizer files
(e.g. ``dgemma_compile/demo/model``). Prompts are the held-out examples ``[offset, offset + n)``:
``dgemma_compile.demo.tasks.make_split("heldout", n, seed, offset=offset)`` (offset 0: the test set of the
README's table; ``--offset 500`` = ``tasks.VALIDATION_OFFSET``: the validation prompts that checkpoints and
generation settings are chosen on; both assume the default train split size); each is tokenized with the
checkpoint's tokenizer (``[bos] + chars``) and completed one at a time.

Prints a markdown table: exact match per task and overall, mean denoising steps per block,
tokens per forward (generated non-pad tokens / decoder passes, summed over all prompts) and the
share of blocks that stopped before ``max_denoising_steps``.

The generation itself is one replaceable function (``GENERATORS``): ``dgemma`` (default) runs
``dgemma_compile.build(model)``, ``dgemma-eager`` the eager reference generator, ``transformers`` the
reference ``model.generate``, ``dgemma-fused`` the compiled generator with commit fusion; a backend only has to
return a ``Generation``. ``--dump FILE`` writes every prompt's generated ids, to compare generators token for token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from dgemma_compile.demo import tasks as T


@dataclasses.dataclass
class Generation:
    """What a generator returns for one prompt."""

    new_ids: list[int]  # generated ids after the prompt (pads after eos allowed)
    steps_per_block: list[int]  # decoder passes for each block (canvas) it denoised


def transformers_generate(model, input_ids: torch.Tensor, gen_config) -> Generation:
    """Reference generator: ``transformers``' ``DiffusionGemmaForBlockDiffusion.generate`` at batch 1.

    Counts decoder passes per block with forward hooks: every encoder call (prefill or commit)
    opens a new block.
    """
    blocks: list[int] = []

    def on_encoder(*_):
        blocks.append(0)

    def on_decoder(*_):
        blocks[-1] += 1

    h1 = model.model.encoder.register_forward_hook(on_encoder)
    h2 = model.model.decoder.register_forward_hook(on_decoder)
    try:
        out = model.generate(input_ids, generation_config=gen_config)
    finally:
        h1.remove()
        h2.remove()
    seq = out.sequences if hasattr(out, "sequences") else out
    blocks = [b for b in blocks if b > 0]  # a trailing commit has no block after it
    return Generation(new_ids=seq[0, input_ids.shape[1] :].tolist(), steps_per_block=blocks)


def dgemma_generate(runner, input_ids: torch.Tensor, gen_config) -> Generation:
    """dgemma_compile's generator (compiled `build(model)` or the eager reference) at batch 1, seed 0."""
    out = runner.generate([input_ids[0].tolist()], gen_config, seed=0)
    return Generation(new_ids=out.sequences[0], steps_per_block=out.stats[0].steps_per_block)


class _EagerRunner:
    def __init__(self, model):
        self.model = model

    def generate(self, prompts, config, seed):
        import dgemma_compile as dg

        return dg.generate(self.model, prompts, config, seed=seed)


GENERATORS: dict[str, Callable] = {"transformers": transformers_generate, "dgemma": dgemma_generate,
                                   "dgemma-fused": dgemma_generate, "dgemma-eager": dgemma_generate}


def completion_text(tokenizer, new_ids: list[int]) -> tuple[str, int]:
    """Decode generated ids up to the first eos; also return the non-pad token count."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    n_tokens = sum(1 for t in new_ids if t != pad)
    if eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos)]
    return tokenizer.decode(new_ids, skip_special_tokens=True), n_tokens


def evaluate(model, tokenizer, examples, gen_config, generator: Callable = transformers_generate, log=None):
    """Run ``generator`` on ``examples`` [(task, prompt, answer)] and return a metrics dict."""
    per_task = defaultdict(lambda: [0, 0])
    steps, tokens, passes, early, nblocks = 0, 0, 0, 0, 0
    limit = gen_config.max_denoising_steps
    samples, generated = [], []
    t0 = time.time()
    for i, (task, prompt, _ans) in enumerate(examples):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]], dtype=torch.long)
        g = generator(model, ids, gen_config)
        generated.append(g.new_ids)
        text, n_tok = completion_text(tokenizer, g.new_ids)
        ok = T.check(prompt, text)
        per_task[task][0] += ok
        per_task[task][1] += 1
        tokens += n_tok
        passes += sum(g.steps_per_block)
        nblocks += len(g.steps_per_block)
        early += sum(1 for s in g.steps_per_block if s < limit)
        if len(samples) < 8 and (not ok or len(samples) < 4):
            samples.append((prompt, text, ok))
        if log is not None and (i + 1) % 100 == 0:
            log(f"  eval {i + 1}/{len(examples)} ({time.time() - t0:.0f}s)")
    n_ok = sum(v[0] for v in per_task.values())
    n = sum(v[1] for v in per_task.values())
    return {
        "exact": {t: v[0] / v[1] for t, v in per_task.items()},
        "overall": n_ok / max(n, 1),
        "n": n,
        "steps_per_block": passes / max(nblocks, 1),
        "tokens_per_forward": tokens / max(passes, 1),
        "early_stop_share": early / max(nblocks, 1),
        "blocks": nblocks,
        "seconds": time.time() - t0,
        "samples": samples,
        "generated": generated,
    }


def format_table(m, offset: int = 0) -> str:
    rows = ["| metric | value |", "|---|---|"]
    for task in T.TASKS:
        if task in m["exact"]:
            rows.append(f"| exact match `{task}` | {100 * m['exact'][task]:.1f}% |")
    rows += [
        f"| exact match overall (n={m['n']}, held-out {offset}-{offset + m['n'] - 1}) | {100 * m['overall']:.1f}% |",
        f"| mean denoise steps per block | {m['steps_per_block']:.2f} |",
        f"| tokens per forward | {m['tokens_per_forward']:.2f} |",
        f"| blocks stopped before step limit | {100 * m['early_stop_share']:.1f}% ({m['blocks']} blocks) |",
    ]
    return "\n".join(rows)


def load(model_dir: str):
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def _parse_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--offset", type=int, default=0,
                    help="first held-out prompt (0: the README's test set; 500: the validation prompts)")
    ap.add_argument("--seed", type=int, default=0, help="task split seed (must match training)")
    ap.add_argument("--torch-seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--generator", default="dgemma", choices=sorted(GENERATORS),
                    help="dgemma (compiled, default), dgemma-fused (compiled with commit fusion), dgemma-eager, "
                    "or transformers' reference generate")
    ap.add_argument(
        "--gen",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a generation_config field, e.g. --gen max_denoising_steps=16 --gen entropy_bound=0.5",
    )
    ap.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                    help="compiled generators: leave out one of our graph passes (CompileOptions.disabled_passes), "
                    "e.g. --disable-pass sample_step_fusion")
    ap.add_argument("--show", action="store_true", help="print a few sample completions")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="dgemma generators: load the weights in this dtype (default: the checkpoint's)")
    ap.add_argument("--quant", default=None, metavar="SCHEME",
                    help="dgemma generators: quantize the weights after loading (dg.quantize: fp8, fp8-weight-only, "
                    "nvfp4-w4a16)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="dgemma generators: the tokenizer's directory (default: model_dir; e.g. the demo's for a "
                    "quantized copy of it without one)")
    ap.add_argument("--dump", metavar="FILE", help="write the generated ids of every prompt (JSON list) to FILE, e.g. "
                    "to compare two generators token for token")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.torch_seed)
    if args.generator.startswith("dgemma"):
        import dgemma_compile as dg

        ours = dg.load(args.model_dir, dtype=getattr(torch, args.dtype) if args.dtype else None)
        if args.quant:
            from dgemma_compile.quant import quantize

            print(quantize(ours, args.quant).text().splitlines()[0], file=sys.stderr)
        tokenizer = dg.load_tokenizer(args.tokenizer or args.model_dir)
        if args.generator == "dgemma-eager":
            model = _EagerRunner(ours)
        else:  # dgemma-fused: commit fusion forced on (CompileOptions.fuse_commit=True; default: CUDA only)
            model = dg.build(ours, dg.CompileOptions(fuse_commit=True if args.generator == "dgemma-fused" else None,
                                                     disabled_passes=tuple(args.disable_pass)))
        gen_config = ours.generation_config.replace(**{k: _parse_value(v) for k, v in (kv.split("=", 1) for kv in args.gen)})
    else:
        model, tokenizer = load(args.model_dir)
        gen_config = model.generation_config
        for kv in args.gen:
            k, v = kv.split("=", 1)
            v = _parse_value(v)
            if k == "entropy_bound":
                gen_config.sampler_config.entropy_bound = float(v)
            else:
                setattr(gen_config, k, v)
    examples = T.make_split("heldout", args.n, args.seed, offset=args.offset)
    m = evaluate(model, tokenizer, examples, gen_config, GENERATORS[args.generator], log=print)
    print(format_table(m, args.offset))
    print(f"\n({m['seconds']:.0f}s, generator={args.generator})")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(m["generated"], f)
    if args.show:
        for p, c, ok in m["samples"]:
            print(f"{'OK ' if ok else 'BAD'} {p!r} -> {c!r}")


if __name__ == "__main__":
    main()
