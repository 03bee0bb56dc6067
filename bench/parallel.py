"""Cost of tensor parallelism: a released-width slice on N = 1, 2, 4 gloo ranks on this CPU, beside the roofline.

    OMP_NUM_THREADS=1 python -m bench.parallel [--ranks 1,2,4] [--experts tensor,expert] [--repeats 5]
        [--vocab 32768] [--out bench/results/parallel_cost_cpu_<date>.md]

Per (N, experts split), each rank (a process of `parallel.spawn`, 1 intra-op thread) builds the same random-weight
slice (`slice_config`: the release's widths -- hidden 2816, 16 query heads, sliding 8 KV heads of 256 and full 2 of
512, dense MLP 2112, experts of 704 -- with 2 layers, 8 experts top 2, canvas 256, `--vocab` ids), shards it
(`parallel.shard`, N > 1) and runs the eager reference's steps (`oracle.EagerSteps`, as `dg.generate` does):
- bytes: `parallel.traffic.measure_steps` counts the collectives of one prefill chunk, denoise step and commit
  (calls, payload and ring wire bytes per rank), beside `traffic.analytic_bytes`; whatever the step holds is counted,
  so after a change of the sharding (the vocabulary-parallel sampler drops the logits gather) a re-run gives the
  new bytes and the analytic column shows whether the formula still describes it;
- ms per denoise step per rank: the median of `--repeats` timed `EagerSteps.step` calls after 2 untimed ones;
- gloo ms per step: the same step's collectives replayed alone (same shapes and dtypes, in order), median;
- logits vs one process (N > 1): max abs difference of the denoise step's logits from the N = 1 run's;
- routing balance (expert split): the largest share of the layer's assignments that one rank's experts received.
Then the released model's bytes per denoise step (analytic, bf16, B = 1) and what they cost on an H200 node's NVLink
(`NVLINK_BYTES_PER_S`, ~450 GB/s a direction, and `NVLINK_LATENCY_S` per collective, an assumption) beside the
one-GPU roofline floor of the step (`bench/roofline.py`), divided by N as the ideal per-rank floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import environment, models, roofline  # noqa: E402
from dgemma_compile.model.config import FULL, SLIDING, GenerationConfig, ModelConfig, RopeConfig  # noqa: E402

NVLINK_BYTES_PER_S = 450e9
"""H200 NVLink 4: 900 GB/s per GPU in both directions together, ~450 GB/s a direction (NVIDIA's spec)."""
NVLINK_LATENCY_S = 10e-6
"""An assumed floor per all-reduce on one NVLink node (launch + synchronisation of a small NCCL all-reduce, of order
10 us); not measured here (no GPU). Multiplied by the collectives per step."""


def slice_config(vocab: int) -> ModelConfig:
    """The release's widths, 2 layers (sliding, full), 8 experts top 2, canvas 256, `vocab` ids (module docstring)."""
    rope = {SLIDING: RopeConfig(rope_type="default", theta=1e4),
            FULL: RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25)}
    return ModelConfig(vocab_size=vocab, hidden_size=2816, intermediate_size=2112, num_layers=2, num_attention_heads=16,
                       layer_types=(SLIDING, FULL), head_dims=(256, 512), num_kv_heads=(8, 2), sliding_window=1024,
                       rope=rope, num_experts=8, top_k_experts=2, moe_intermediate_size=704, canvas_length=256,
                       final_logit_softcapping=30.0, max_position_embeddings=8192, eos_token_ids=(1,))


def _rank(rank: int, world: int, out_dir: str, vocab: int, experts: str, repeats: int, prompt_len: int) -> None:
    """One rank's measurements, written to out_dir/rank{rank}.json (and its denoise logits to rank{rank}.pt)."""
    import torch.distributed as dist

    from dgemma_compile import parallel
    from dgemma_compile.oracle import EagerSteps, prefill
    from dgemma_compile.model.forwards import denoise_block
    from dgemma_compile.parallel.traffic import CollectiveCounter, measure_steps

    if world > 1:
        parallel.init("cpu", timeout_s=600)
    model = models.build_direct(slice_config(vocab), torch.device("cpu"), torch.float32, seed=0)
    model.generation_config = GenerationConfig(max_denoising_steps=64, stop_early=False)
    if world > 1:
        model = parallel.shard(model, experts=experts)
    traffic = measure_steps(model, batch=1, prompt_len=prompt_len, world_size=world)

    shares = []  # the expert split's balance: the largest rank's share of each layer's assignments

    def balance(module, args, out):
        idx = out[1].flatten()
        E = model.config.num_experts
        per_rank = torch.bincount(idx // (E // world), minlength=world)
        shares.append(float(per_rank.max()) / idx.numel())

    hooks = [layer.router.register_forward_hook(balance) for layer in model.layers]
    cfg = model.generation_config.resolved(model.config)
    runner = EagerSteps(model, [cfg], [0], max_seq_len=prompt_len + 2 * model.config.canvas_length, moe_impl="loop")
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        prefill(runner, ids, torch.tensor([prompt_len]))
        runner.begin_block(0, torch.zeros(1, dtype=torch.bool))
        state = runner.state  # the block's first forward on its seeded start canvas: the same input for every N
        logits = denoise_block(model, state.canvas, runner.cache, None, state.has_sc, moe_impl="loop",
                               self_conditioning_embeds=state.sc_embeds)
        for i in range(2 + repeats):
            t0 = time.perf_counter()
            runner.step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        for h in hooks:
            h.remove()
        with CollectiveCounter(world) as counter:  # the denoise step's collectives, to replay alone
            runner.step()
        comm = []
        if world > 1:
            group = model.tensor_parallel.group
            payload = [torch.ones(r.shape, dtype=r.dtype) for r in counter.records]
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                for x in payload:
                    dist.all_reduce(x, group=group)  # synchronous: the time of the collective itself
                comm.append(time.perf_counter() - t0)
            comm = comm[1:]
    torch.save({"logits": logits}, Path(out_dir, f"rank{rank}.pt"))
    out = {"step_ms": [t * 1e3 for t in times], "comm_ms": [t * 1e3 for t in comm],
           "traffic": {k: {"calls": v.calls, "payload_bytes": v.payload_bytes, "wire_bytes": v.wire_bytes,
                           "by_shape": [[list(key[1]), key[0], key[2], n] for key, n in v.by_shape.items()]}
                       for k, v in traffic.items()},
           "balance": max(shares) if shares and world > 1 else None,
           "mean_balance": statistics.mean(shares) if shares and world > 1 else None}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        parallel.destroy()


def run_case(world: int, experts: str, *, vocab: int, repeats: int, prompt_len: int, timeout_s: float) -> dict:
    """Spawn `world` ranks for one case; returns {"ranks": [rank reports], "logits": [rank 0's denoise logits]}."""
    from dgemma_compile import parallel

    with tempfile.TemporaryDirectory(prefix="dgemma_bench_parallel_") as d:
        parallel.spawn(_rank, world, (d, vocab, experts, repeats, prompt_len), timeout_s=timeout_s)
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
        logits = torch.load(Path(d, "rank0.pt"))["logits"]
    return {"ranks": ranks, "logits": logits}


def demo_balance(worlds: list[int]) -> dict[int, tuple[float, float]]:
    """The expert split's balance with a trained router: the demo model (8 experts top 2) on 64 of its test prompts,
    one batch, through `dg.generate`; per N, (mean, max) over layers and forwards of the largest rank's share of the
    assignments, when rank r holds experts [r*E/N, (r+1)*E/N)."""
    import dgemma_compile as dg
    from dgemma_compile.demo import DEMO_MODEL, tasks

    model = dg.load(DEMO_MODEL)
    tok = dg.load_tokenizer(DEMO_MODEL)
    prompts = [tok(prompt)["input_ids"] for _, prompt, _ in tasks.make_split("heldout", 64)]
    seen: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda m, a, out: seen.append(out[1].flatten()))
             for layer in model.layers]
    dg.generate(model, prompts, model.generation_config.replace(max_new_tokens=16), seed=0)
    for h in hooks:
        h.remove()
    E, out = model.config.num_experts, {}
    for n in worlds:
        shares = [float(torch.bincount(idx // (E // n), minlength=n).max()) / idx.numel() for idx in seen]
        out[n] = (statistics.mean(shares), max(shares))
    return out


def released_rows(ranks: list[int], cfg: ModelConfig) -> list[str]:
    """Markdown rows: the released model's denoise step (B = 1, C = 256, bf16), per N: analytic payload and wire
    bytes, collectives, NVLink time (bandwidth + latency) against the roofline floor / N."""
    from dgemma_compile.parallel.traffic import analytic_bytes

    r = roofline.for_workload(cfg, batch=1, prompt_len=1024, output_len=1024, steps=16, dtype_bytes=2,
                              bandwidth=roofline.H200_BANDWIDTH)
    floor = r.step_floor_s
    rows = []
    for n in ranks:
        if n == 1:
            continue
        parts = analytic_bytes(cfg, n, kind="denoise", batch=1, tokens=cfg.canvas_length, dtype_bytes=2)
        payload = sum(parts.values())
        wire = 2 * (n - 1) / n * payload
        calls = 1 + 3 * cfg.num_layers + 6  # embedding, 3 a layer, the sampler's 5, the self-conditioning product
        link = wire / NVLINK_BYTES_PER_S + calls * NVLINK_LATENCY_S
        rows.append(f"| {n} | {payload / 1e6:,.1f} (sampler {parts['sampler'] / 1e3:,.1f} KB) | {wire / 1e6:,.1f} | "
                    f"{calls} | {link * 1e3:.2f} | {floor / n * 1e3:.2f} | {link / (floor / n + link):.0%} |")
    return rows, floor


def report(results: dict, args, started: str, balance: dict | None = None) -> str:
    from dgemma_compile.parallel.traffic import analytic_bytes

    cfg = slice_config(args.vocab)
    lines = [f"# Tensor parallel cost on CPU gloo ranks ({environment.today()})", "",
             f"`python -m bench.parallel --ranks {args.ranks} --experts {args.experts} --repeats {args.repeats} "
             f"--rounds {args.rounds} --vocab {args.vocab}`; started {started}, machine load "
             f"{environment.load_average()} at the end. Cases run one after another, round-robin over "
             f"{args.rounds} round(s); each case's timings pooled over its rounds (per-round medians in brackets).",
             f"Device: {environment.device_name('cpu')}; versions {environment.versions()}; 1 intra-op thread per "
             f"rank; gloo over loopback.", "",
             "Model: the release's widths (hidden 2816, 16 query heads, sliding 8 KV heads of 256, full 2 of 512, dense "
             f"MLP 2112, experts of 704), 2 layers (sliding, full), 8 experts top 2, canvas 256, vocabulary "
             f"{args.vocab}, random float32 weights (`bench.parallel.slice_config`); batch 1, a prompt of "
             f"{args.prompt_len} tokens, the eager reference's steps (`oracle.EagerSteps`, experts impl \"loop\").",
             "", "## Per rank and denoise step, measured", "",
             "| N | experts | ms / step (rank 0, median) | ms / step (slowest rank) | gloo ms / step (collectives "
             "alone) | gloo share | collectives | payload MB | wire MB (ring) | analytic MB | max |logits - 1 rank| | "
             "largest rank's share of assignments |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = results.get((1, "tensor"))
    for (n, split), res in sorted(results.items()):
        ranks = res["ranks"]
        med = [statistics.median(r["step_ms"]) for r in ranks]
        comm = statistics.median(ranks[0]["comm_ms"]) if ranks[0]["comm_ms"] else 0.0
        t = ranks[0]["traffic"]["denoise"]
        want = sum(analytic_bytes(cfg, n, kind="denoise", batch=1, tokens=cfg.canvas_length, dtype_bytes=4,
                                  experts=split).values())
        diff = "-" if n == 1 or base is None or base["logits"] is None else \
            f"{float((res['logits'] - base['logits']).abs().max()):.2g}"
        share = "-" if ranks[0]["balance"] is None or split != "expert" else \
            f"{ranks[0]['mean_balance']:.0%} mean, {ranks[0]['balance']:.0%} max (even: {1 / n:.0%})"
        rounds = ranks[0].get("round_ms")
        first = f"{med[0]:.0f}" + ("" if not rounds else " [" + ", ".join(f"{x:.0f}" for x in rounds) + "]")
        lines.append(f"| {n} | {split if n > 1 else '-'} | {first} | {max(med):.0f} | {comm:.1f} | {comm / med[0]:.0%} | {t['calls']} | "
                     f"{t['payload_bytes'] / 1e6:.2f} | {t['wire_bytes'] / 1e6:.2f} | {want / 1e6:.2f}"
                     f"{'' if want == t['payload_bytes'] else ' (differs)'} | {diff} | {share} |")
    lines += ["", "Collectives per forward kind (rank 0, measured; shape, op, dtype, calls):", ""]
    for (n, split), res in sorted(results.items()):
        if n == 1:
            continue
        for kind, t in res["ranks"][0]["traffic"].items():
            shapes = ", ".join(f"{op} {shape} {dt} x{c}" for shape, op, dt, c in t["by_shape"])
            lines.append(f"- N={n} {split}, {kind}: {t['calls']} calls, {t['payload_bytes'] / 1e6:.2f} MB: {shapes}")
    if balance:
        lines += ["", "Expert split's balance with a trained router (`demo_balance`: the demo model, 8 experts top 2, 64 "
                  "held-out prompts in one batch; the largest rank's share of a layer's assignments per forward):", ""]
        lines += [f"- N={n}: mean {m:.0%}, max {x:.0%} (even: {1 / n:.0%}; the tensor split: exactly {1 / n:.0%} of "
                  f"every expert's work on every rank)" for n, (m, x) in balance.items()]
    rows, floor = released_rows([int(x) for x in args.ranks.split(",")] + [8], models.full_config())
    lines += ["", "## The released model's denoise step on an H200 node (analytic, bf16, batch 1, canvas 256)", "",
              f"One-GPU roofline floor of the step (`bench/roofline.py`, HBM {roofline.H200_BANDWIDTH / 1e12:.1f} TB/s, "
              f"bf16, context ~1k): {floor * 1e3:.2f} ms; ideal per-rank floor = floor / N. NVLink: "
              f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s a direction, plus an assumed {NVLINK_LATENCY_S * 1e6:.0f} us per "
              f"collective.", "",
              "| N | payload MB / step | wire MB / step (ring) | collectives | NVLink ms | floor / N ms | "
              "communication's share |",
              "|---:|---:|---:|---:|---:|---:|---:|"] + rows
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--experts", default="tensor,expert")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per rank and round")
    p.add_argument("--rounds", type=int, default=1, help="passes over every case, round-robin (timings pooled)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", default=None, help="markdown report (default bench/results/parallel_cost_cpu_<date>.md)")
    p.add_argument("--json", default=None, help="also the raw results as JSON")
    args = p.parse_args(argv)
    started = environment.now()
    cases = [(n, split) for n in (int(x) for x in args.ranks.split(","))
             for split in (["tensor"] if n == 1 else args.experts.split(","))]
    results = {}
    for round_ in range(args.rounds):  # round-robin: a slow minute of the shared machine hits every case alike
        for n, split in cases:
            t0 = time.monotonic()
            res = run_case(n, split, vocab=args.vocab, repeats=args.repeats, prompt_len=args.prompt_len,
                           timeout_s=args.timeout_s)
            if (n, split) in results:  # pool the timings; bytes and logits are the same every round
                for old, new in zip(results[(n, split)]["ranks"], res["ranks"]):
                    old["step_ms"] += new["step_ms"]
                    old["comm_ms"] += new["comm_ms"]
                    old.setdefault("round_ms", [statistics.median(old["step_ms"][:args.repeats])])
                    old["round_ms"].append(statistics.median(new["step_ms"]))
            else:
                results[(n, split)] = res
            print(f"round {round_ + 1}, N={n} {split}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    worlds = [n for n in (int(x) for x in args.ranks.split(",")) if n > 1]
    text = report(results, args, started, demo_balance(worlds) if "expert" in args.experts and worlds else None)
    out = Path(args.out or Path(__file__).parent / "results" / f"parallel_cost_cpu_{environment.today()}.md")
    out.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{n}:{s}": r["ranks"] for (n, s), r in results.items()}))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
