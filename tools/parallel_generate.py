"""The compiled step over a tensor-parallel model (issue 28): N gloo ranks of the demo model, each sharded
(`parallel.shard`), each building the compiled generator (`dg.build`, default options) and generating the same
prompts; checks that every rank's tokens are equal, equal to the sharded model's eager loop and to the
single-process eager loop, and reports `gen.explain` (graphs, graph breaks) per rank. Writes a JSON results file.

    python tools/parallel_generate.py [--world-size 2] [--experts-split tensor|expert] [--out results.json]
        [--checkpoint DIR] [--quant SCHEME]

`--checkpoint`: another checkpoint of the demo's vocabulary (a compressed-tensors one, read slice by slice by
`parallel.load_sharded`); `--quant`: quantize it on load (before sharding, as `dgemma generate --quant` does).

Takes ~3 min on 2 shared cores at 2 ranks (each rank compiles its own step). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dgemma_compile as dg  # noqa: E402
from dgemma_compile import parallel  # noqa: E402
from dgemma_compile.compile import CompileOptions  # noqa: E402
from dgemma_compile.demo import DEMO_MODEL  # noqa: E402
from dgemma_compile.inputs.text import encode_prompt  # noqa: E402

PROMPTS = ["sort 3 1 2 9 5=", "add 123+045=", "rev 3 1 2=", "dedup 3 1 3 2="]  # docs/demo.md's formats


def _ids() -> list[list[int]]:
    tok = dg.load_tokenizer(DEMO_MODEL)
    return [encode_prompt(tok, p, bos_token_id=2) for p in PROMPTS]


def _seqs(out) -> list[list[int]]:
    return [[int(t) for t in s] for s in out.sequences]


def _load(checkpoint: str, quant: str | None):
    """The one-process model: `checkpoint`, quantized to `quant` when given."""
    model = dg.load(checkpoint)
    if quant is not None:
        dg.quantize(model, quant)
    return model


def _rank(rank: int, world: int, out_dir: str, experts: str = "tensor", checkpoint: str = str(DEMO_MODEL),
          quant: str | None = None) -> None:
    parallel.init("cpu", timeout_s=300)
    model = parallel.load_sharded(checkpoint, experts=experts, quant=quant)  # its slices (quantized first: --quant)
    t0 = time.monotonic()
    gen = dg.build(model, CompileOptions(batch_buckets=(len(PROMPTS),), max_seq_len=256))
    compiled = gen.generate(_ids(), seed=0)
    first_s = time.monotonic() - t0
    eager = dg.generate(model, _ids(), seed=0, moe_impl=gen.moe_impl)
    reports = gen.explain(len(PROMPTS))
    rep = {"rank": rank, "compiled": _seqs(compiled), "eager": _seqs(eager), "moe_impl": gen.moe_impl,
           "compile_and_first_generate_s": round(first_s, 1),
           "units": [{"unit": r.unit, "graph_count": r.graph_count, "graph_break_count": r.graph_break_count,
                      "recompiles": r.recompiles_in_workload} for r in reports]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rep))
    parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--experts-split", choices=("tensor", "expert"), default="tensor",
                    help="how the routed experts are split (parallel.shard's experts=)")
    ap.add_argument("--out", default=None, help="results JSON (default: printed only)")
    ap.add_argument("--checkpoint", default=str(DEMO_MODEL), help="the model (default: the demo; its tokenizer)")
    ap.add_argument("--quant", default=None, help="quantize on load, before sharding (dg.quantize's schemes)")
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="parallel_generate_")
    t0 = time.monotonic()
    parallel.spawn(_rank, a.world_size, (d, a.experts_split, a.checkpoint, a.quant), timeout_s=1200)
    ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(a.world_size)]
    ref = _seqs(dg.generate(_load(a.checkpoint, a.quant), _ids(), seed=0, moe_impl=ranks[0]["moe_impl"]))
    tok = dg.load_tokenizer(DEMO_MODEL)
    checks = {
        "ranks_equal": all(r["compiled"] == ranks[0]["compiled"] for r in ranks),
        "compiled_equals_single_process": ranks[0]["compiled"] == ref,
        "sharded_eager_equals_single_process": all(r["eager"] == ref for r in ranks),
        "zero_graph_breaks": all(r["units"] for r in ranks)
        and all(u["graph_break_count"] == 0 for r in ranks for u in r["units"]),
        "one_graph_per_unit": all(u["graph_count"] == 1 for r in ranks for u in r["units"]),
    }
    results = {"world_size": a.world_size, "experts": a.experts_split, "checkpoint": a.checkpoint, "quant": a.quant,
               "prompts": PROMPTS, "checks": checks,
               "texts": [tok.decode(s, skip_special_tokens=True) for s in ranks[0]["compiled"]],
               "per_rank": [{k: r[k] for k in ("rank", "moe_impl", "compile_and_first_generate_s", "units")}
                            for r in ranks],
               "wall_s": round(time.monotonic() - t0, 1)}
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
