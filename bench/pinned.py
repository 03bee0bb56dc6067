"""What pinning an answer's separators does on the demo (issue 40 item 1): exact match and denoise steps per block of
the list tasks with and without a template, in one run.

    python -m bench.pinned [--n 500] [--batch 25] [--temperatures 1 3] [--out bench/results]

Prompts: the held-out test split [0, n) (`demo.tasks.make_split("heldout", n)`), its list tasks whose answer length
the prompt gives (sort and rev: as many digits as the prompt lists, one space apart). Each runs twice through the
eager reference generator (`dg.generate`, batches of `--batch` rows; a row's tokens never depend on its batch),
checkpoint defaults with each temperature scale of `--temperatures` (`GenerationConfig.with_temperature`: 1 = the
checkpoint's schedule; 3 = hot, where the demo errs and takes more steps), seed 0: unpinned, and with the
separators pinned -- the template "_ _ _ _ _" for five digits
(`canvas.BLANK` free, the spaces held; the eos after the last digit is left free). Reported per task and condition:
exact match (`tasks.check`), mean denoise steps per block, tokens per forward (generated non-pad tokens / decoder
passes), and how many pinned answers differ from their unpinned one.

Writes bench/results/pinned_cpu_<date>.md and prints it.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import dgemma_compile as dg
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.demo import tasks as T
from dgemma_compile.inputs.text import encode_prompt

from . import environment

TASKS = ("sort", "rev")


def template(prompt: str) -> str:
    """The answer's separators pinned: one blank per listed digit, one space apart."""
    n = len(re.findall(r"\d", prompt.split("=")[0]))
    return " ".join("_" * n)


def run(model, tok, prompts: list[str], canvas: bool, batch: int, scale: float):
    """(texts, stats) of every prompt, in order."""
    cfg = model.generation_config if scale == 1 else model.generation_config.with_temperature(scale)
    ids = [encode_prompt(tok, p, bos_token_id=model.config.bos_token_id) for p in prompts]
    texts, stats = [], []
    for i in range(0, len(ids), batch):
        part = prompts[i:i + batch]
        out = dg.generate(model, ids[i:i + batch], cfg, seed=0, max_seq_len=256, tokenizer=tok,
                          canvas=[template(p) for p in part] if canvas else None)
        texts += [tok.decode(s, skip_special_tokens=True) for s in out.sequences]
        stats += out.stats
    return texts, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    prompts = [p for task, p, _ in T.make_split("heldout", args.n, 0) if task in TASKS]
    lines = [f"# Pinned separators on the demo ({environment.today()})", "",
             f"`python -m bench.pinned --n {args.n} --batch {args.batch} --temperatures "
             f"{' '.join(f'{t:g}' for t in args.temperatures)}` at {environment.git_commit()}; "
             f"{environment.device_name('cpu')}; torch {environment.versions().get('torch')}; "
             f"load {environment.load_average()}. The held-out test split's sort and rev prompts among the first "
             f"{args.n}, eager reference generator, checkpoint defaults, seed 0; pinned: the template "
             f"`_ _ _ _ _` (one blank per digit, the spaces held).", "",
             "| temperature x | task | prompts | exact (unpinned) | exact (pinned) | steps/block (unpinned) "
             "| steps/block (pinned) "
             "| tokens/forward (unpinned) | tokens/forward (pinned) | answers changed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    seconds = {}
    for scale in args.temperatures:
        results = {}
        for pinned in (False, True):
            t0 = time.perf_counter()
            results[pinned] = run(model, tok, prompts, pinned, args.batch, scale)
            seconds[scale, pinned] = time.perf_counter() - t0
        lines += _rows(prompts, results, scale)
    lines += ["", "Wall time: " + ", ".join(f"x{s:g} {'pinned' if p else 'unpinned'} {v:.1f} s"
                                            for (s, p), v in seconds.items())
              + " (not a speed benchmark: the machine is shared)."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out) / f"pinned_cpu_{environment.today()}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


def _rows(prompts: list[str], results: dict, scale: float) -> list[str]:
    lines = []
    for task in (*TASKS, "all"):
        idx = [i for i, p in enumerate(prompts) if task == "all" or T.task_of(p) == task]
        row = [f"{scale:g}", task, str(len(idx))]
        exact, steps, tpf = [], [], []
        for pinned in (False, True):
            texts, stats = results[pinned]
            exact.append(sum(T.check(prompts[i], texts[i]) for i in idx) / len(idx))
            blocks = [s for i in idx for s in stats[i].steps_per_block]
            steps.append(sum(blocks) / len(blocks))
            tpf.append(sum(stats[i].num_tokens for i in idx) / sum(stats[i].decoder_passes for i in idx))
        changed = sum(results[False][0][i] != results[True][0][i] for i in idx)
        row += [f"{exact[0]:.1%}", f"{exact[1]:.1%}", f"{steps[0]:.2f}", f"{steps[1]:.2f}", f"{tpf[0]:.2f}",
                f"{tpf[1]:.2f}", str(changed)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
