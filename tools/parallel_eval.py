"""Tokens of a tensor-parallel run against one process on the demo's held-out test prompts (issue 28, item 3).

Starts N gloo ranks (`parallel.spawn`, 1 thread each); each shards the demo model (`parallel.shard`), builds the
compiled generator with default options (`dg.build`, as `tools/eval_demo_model.py` does) and completes held-out
prompts [offset, offset + n) one at a time at seed 0, exactly the eval's requests; every rank writes its generated
ids. The parent compares the ranks with each other and with a single-process dump (`eval_demo_model.py --dump`, the
reference of main's numerics) and reports the share that differ, prompt by prompt, with the exact-match score.

    python tools/parallel_eval.py --world-size 2 --reference /tmp/perf_500.json --out results.json
        [--checkpoint DIR] [--quant SCHEME]   # the reference: eval_demo_model.py DIR [--quant SCHEME] --dump

Takes ~10-30 min on 2 shared cores (each rank compiles its own step, then 500 requests with collectives).
Exit status 1 when a rank differs from another or from the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dgemma_compile as dg  # noqa: E402
from dgemma_compile import parallel  # noqa: E402
from dgemma_compile.demo import DEMO_MODEL  # noqa: E402
from dgemma_compile.demo import tasks as T  # noqa: E402


def _rank(rank: int, world: int, n: int, offset: int, out_dir: str, cache: str | None, bucket: int | None,
          checkpoint: str = str(DEMO_MODEL), quant: str | None = None) -> None:
    if cache:  # an Inductor cache of the rank's own (see --per-rank-cache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache, f"rank{rank}"))
    parallel.init("cpu", timeout_s=600)
    model = parallel.load_sharded(checkpoint, quant=quant)  # the rank's slices (quantized first with --quant)
    tok = dg.load_tokenizer(DEMO_MODEL)
    gen = dg.build(model) if bucket is None else dg.build(model, dg.CompileOptions(batch_buckets=(bucket,)))
    config = model.generation_config
    t0 = time.monotonic()
    ids, steps = [], []
    for _task, prompt, _answer in T.make_split("heldout", n, 0, offset=offset):
        out = gen.generate([tok(prompt)["input_ids"]], config, seed=0)
        ids.append([int(t) for t in out.sequences[0]])
        steps.append(list(out.stats[0].steps_per_block))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"ids": ids, "steps": steps, "moe_impl": gen.moe_impl,
                                                             "seconds": round(time.monotonic() - t0, 1)}))
    parallel.destroy()


def _exact(tok, examples, ids) -> float:
    eos, ok = tok.eos_token_id, 0
    for (_task, prompt, _answer), new in zip(examples, ids):
        new = new[:new.index(eos)] if eos in new else new
        ok += T.check(prompt, tok.decode(new, skip_special_tokens=True))
    return ok / max(len(ids), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--reference", required=True, help="single-process ids: eval_demo_model.py --dump FILE")
    ap.add_argument("--out", default=None, help="results JSON (default: printed only)")
    ap.add_argument("--batch-bucket", type=int, default=None, metavar="B",
                    help="one compiled bucket of B rows for the one-request calls (default: dg.build's buckets, B=1 "
                         "for them); batch-invariant rows on CPU give the same tokens (docs/parallel.md: why B=4 at 4 "
                         "ranks)")
    ap.add_argument("--per-rank-cache", default=None, metavar="DIR",
                    help="give each rank its own Inductor cache DIR/rank<r> (TORCHINDUCTOR_CACHE_DIR) instead of the "
                         "shared one (docs/parallel.md: what 4 ranks compiling into one cache did)")
    ap.add_argument("--checkpoint", default=str(DEMO_MODEL),
                    help="the model (default: the demo; a quantized copy of it such as tests/fixtures/quant/"
                         "demo-nvfp4a16); the demo's tokenizer either way")
    ap.add_argument("--quant", default=None, help="quantize on load, before sharding (dg.quantize's schemes)")
    a = ap.parse_args(argv)
    ref = json.loads(Path(a.reference).read_text())[:a.n]
    if len(ref) < a.n:
        raise SystemExit(f"--reference {a.reference} holds {len(ref)} prompts, fewer than --n {a.n}")
    d = tempfile.mkdtemp(prefix="parallel_eval_")
    t0 = time.monotonic()
    parallel.spawn(_rank, a.world_size, (a.n, a.offset, d, a.per_rank_cache, a.batch_bucket, a.checkpoint, a.quant),
                   timeout_s=7200)
    ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(a.world_size)]
    ids = ranks[0]["ids"]
    differ_ranks = [i for i in range(a.n) if any(r["ids"][i] != ids[i] for r in ranks)]
    differ_ref = [i for i in range(a.n) if ids[i] != ref[i]]
    tok = dg.load_tokenizer(DEMO_MODEL)
    examples = T.make_split("heldout", a.n, 0, offset=a.offset)
    results = {"world_size": a.world_size, "checkpoint": a.checkpoint, "quant": a.quant,
               "per_rank_cache": a.per_rank_cache, "batch_bucket": a.batch_bucket, "n": a.n, "offset": a.offset,
               "reference": a.reference,
               "moe_impl": ranks[0]["moe_impl"], "prompts_differing_between_ranks": differ_ranks,
               "prompts_differing_from_single_process": differ_ref,
               "share_equal_to_single_process": 1 - len(differ_ref) / a.n,
               "exact_match": _exact(tok, examples, ids), "exact_match_reference": _exact(tok, examples, ref),
               "generate_s_per_rank": [r["seconds"] for r in ranks], "wall_s": round(time.monotonic() - t0, 1)}
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if not differ_ranks and not differ_ref else 1


if __name__ == "__main__":
    raise SystemExit(main())
