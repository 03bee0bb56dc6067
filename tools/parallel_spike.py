"""Spike (issue 28, item 0): do functional collectives compile under Inductor on CPU with gloo, inside a function
shaped like our compile unit, with 0 graph breaks, and give the single-process values?

Starts 2 gloo ranks (`dgemma_compile.parallel.launch.spawn`, a timeout on the group) and on each compiles, with
`torch.compile(fullgraph=True)` (Inductor) under `torch.no_grad()`:
- a row-parallel linear (each rank holds K/N input columns of the weight) followed by
  `torch.distributed._functional_collectives.all_reduce(..., "sum")`, then an RMSNorm-like epilogue;
- the vocabulary-parallel reductions the sampler needs over a [M, V/N] logits slice: the global max
  (all_reduce "max"), the softmax normaliser and entropy (all_reduce "sum") and the global argmax (max value, then
  the smallest global index holding it: all_reduce "min"), so every rank picks the same token;
- and, for comparison, the same linear with the in-place `torch.distributed.all_reduce`.
It records `torch._dynamo.explain` (graph and break counts) per variant and compares the values with the
single-process computation. Writes one JSON per rank and prints rank 0's.

    python tools/parallel_spike.py [--out DIR] [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dgemma_compile.parallel import group as pgroup  # noqa: E402
from dgemma_compile.parallel.launch import spawn  # noqa: E402

M, K, N_OUT, V = 32, 256, 128, 1024  # tokens, linear in/out, vocabulary


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(M, K, generator=g), torch.randn(N_OUT, K, generator=g) / K ** 0.5,
            torch.randn(M, V, generator=g) * 4)


def _row_parallel(x_MK, w_NK, group):
    partial = x_MK @ w_NK.T
    y = funcol.all_reduce(partial, "sum", group)
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def _row_parallel_inplace(x_MK, w_NK, group):
    y = x_MK @ w_NK.T
    dist.all_reduce(y, group=group)
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


def _inplace_on_view(x_MK, w_NK, group):
    """In-place all_reduce of a view: the base must see the reduced values (eager semantics)."""
    y = x_MK @ w_NK.T
    dist.all_reduce(y[:, : y.shape[1] // 2], group=group)
    return y


def _vocab_reductions(logits_MV, offset, group):
    """Global max, log-normaliser, entropy and argmax of logits split over ranks by vocabulary ([M, V/N] here,
    `offset` the rank's first global id, an int64 0-d tensor)."""
    local_max = logits_MV.amax(-1)
    gmax = funcol.all_reduce(local_max, "max", group)
    e = torch.exp(logits_MV - gmax[:, None])
    z = funcol.all_reduce(e.sum(-1), "sum", group)
    p_log_p = funcol.all_reduce((e * (logits_MV - gmax[:, None])).sum(-1), "sum", group)
    entropy = torch.log(z) - p_log_p / z
    ids = torch.arange(logits_MV.shape[-1]) + offset
    big = torch.iinfo(torch.int64).max
    cand = torch.where(logits_MV == gmax[:, None], ids, torch.full_like(ids, big)).amin(-1)
    argmax = funcol.all_reduce(cand, "min", group)
    return gmax, torch.log(z) + gmax, entropy, argmax


def _explain(fn, *args):
    torch._dynamo.reset()
    try:
        e = torch._dynamo.explain(fn)(*args)
        return {"graph_count": e.graph_count, "graph_break_count": e.graph_break_count,
                "break_reasons": [str(r.reason) for r in e.break_reasons],
                "ops": [str(op) for ops in e.ops_per_graph for op in ops
                        if "c10d" in str(op) or "all_reduce" in str(op)]}
    except Exception as ex:  # the report says what failed
        return {"error": f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"}


def _rank(rank: int, world: int, out_dir: str) -> None:
    group = pgroup.init("cpu", timeout_s=60)
    x, w, logits = _inputs()
    k, v = K // world, V // world
    x_l, w_l = x[:, rank * k:(rank + 1) * k], w[:, rank * k:(rank + 1) * k]
    lg_l = logits[:, rank * v:(rank + 1) * v].contiguous()
    offset = torch.tensor(rank * v)
    report = {"rank": rank, "world_size": world, "torch": torch.__version__}
    with torch.no_grad():
        ref_y_raw = ref_y = x @ w.T
        ref_y = ref_y * torch.rsqrt(ref_y.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref_max = logits.amax(-1)
        ref_lse = torch.logsumexp(logits, -1)
        p = torch.softmax(logits, -1)
        ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
        ref_arg = logits.argmax(-1)

        report["explain_row_parallel_funcol"] = _explain(lambda a, b: _row_parallel(a, b, group), x_l, w_l)
        report["explain_vocab_funcol"] = _explain(lambda a, o: _vocab_reductions(a, o, group), lg_l, offset)
        report["explain_row_parallel_inplace"] = _explain(lambda a, b: _row_parallel_inplace(a, b, group), x_l, w_l)

        torch._dynamo.reset()
        t0 = time.perf_counter()
        row = torch.compile(lambda a, b: _row_parallel(a, b, group), fullgraph=True, backend="inductor")
        y = row(x_l, w_l)
        voc = torch.compile(lambda a, o: _vocab_reductions(a, o, group), fullgraph=True, backend="inductor")
        gmax, lse, ent, arg = voc(lg_l, offset)
        report["compile_s"] = round(time.perf_counter() - t0, 1)
        report["row_parallel_max_abs_diff"] = float((y - ref_y).abs().max())
        report["vocab_max_equal"] = bool(torch.equal(gmax, ref_max))
        report["vocab_logsumexp_max_abs_diff"] = float((lse - ref_lse).abs().max())
        report["vocab_entropy_max_abs_diff"] = float((ent - ref_ent).abs().max())
        report["vocab_argmax_equal"] = bool(torch.equal(arg, ref_arg))
        eager_y = _row_parallel(x_l, w_l, group)
        report["compiled_equals_eager_bitwise"] = bool(torch.equal(y, eager_y))
        gathered = funcol.all_gather_single(y.contiguous(), 0, group)
        report["ranks_bitwise_identical"] = bool(all(torch.equal(c, y) for c in gathered.chunk(world)))
        try:
            torch._dynamo.reset()
            inpl = torch.compile(lambda a, b: _row_parallel_inplace(a, b, group), fullgraph=True, backend="inductor")
            yi = inpl(x_l, w_l)
            report["inplace_compiled"] = {"ok": True, "max_abs_diff": float((yi - ref_y).abs().max())}
        except Exception as ex:
            report["inplace_compiled"] = {"ok": False, "error": f"{type(ex).__name__}: {str(ex).splitlines()[0]}"}
        torch._dynamo.reset()
        partial = x_l @ w_l.T
        want = partial.clone()
        want[:, : N_OUT // 2] = ref_y_raw[:, : N_OUT // 2]
        try:
            fn = torch.compile(lambda a, b: _inplace_on_view(a, b, group), fullgraph=True, backend="inductor")
            got = fn(x_l, w_l)
            report["inplace_on_view_compiled"] = {"ok": True, "max_abs_diff_vs_eager_semantics":
                                                  float((got - want).abs().max())}
        except Exception as ex:
            report["inplace_on_view_compiled"] = {"ok": False,
                                                  "error": f"{type(ex).__name__}: {str(ex).splitlines()[0]}"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    pgroup.destroy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for rank{r}.json (default: a temporary one)")
    ap.add_argument("--world-size", type=int, default=2)
    a = ap.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="parallel_spike_")
    Path(out).mkdir(parents=True, exist_ok=True)
    spawn(_rank, a.world_size, (out,), timeout_s=600)
    print(Path(out, "rank0.json").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
