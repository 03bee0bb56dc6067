"""`python -m bench`: side-by-side benchmark of our compiled and eager generators, transformers (eager and its
compiled static-cache path) and an autoregressive baseline, on the same checkpoint, prompts, seeds and steps.

    python -m bench --model demo --workloads fixed,adaptive
    python -m bench --model scaled --prompt-len 256 --output-len 512 --repeats 3
    python -m bench --model full --device cuda --prompt-len 1024 --output-len 1024   # see bench/h200.sh

Each system runs in its own long-lived worker process (`--in-process` to share this one): every system is first
prepared one at a time (load, compile, one untimed warm-up pass), then the `--repeats` timed passes run round-robin
(repeat 1 of every system, then repeat 2, ...; `runner.py`), so that load on the machine hits every system alike.
`--sequential` runs one system to the end before the next starts instead. Compile time is reported apart. Results:
markdown and CSV under bench/results/ ({model}_{device}_{YYYY-MM-DD}.md/.csv), the markdown also on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from . import environment, models, report, roofline, runner, systems, workloads

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo | scaled | full | full-tiny (or a name for --checkpoint)")
    p.add_argument("--checkpoint", default=None, help="benchmark this checkpoint directory instead")
    p.add_argument("--workloads", default="fixed", help="comma list of: fixed, adaptive")
    p.add_argument("--systems", default=None,
                   help=f"comma list of {', '.join(systems.SYSTEMS)} (default: all that apply; no transformers "
                        "systems for models without a checkpoint)")
    p.add_argument("--base", default=report.BASE, help="the system every speedup ratio is against (default "
                   f"{report.BASE}; e.g. hf-eager for ours-step-eager against transformers' eager path)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(systems.DTYPES),
                   help="weights dtype (default: the checkpoint's; bfloat16 for full/full-tiny, and for every system "
                        "when a quantized system (ours-compiled-<scheme>) is chosen, so that its baseline is bf16 "
                        "ours-compiled)")
    p.add_argument("--prompt-len", type=int, default=256, help="fixed: prompt tokens (adaptive, non-demo: too)")
    p.add_argument("--output-len", type=int, default=512, help="fixed: generated tokens (a multiple of the canvas)")
    p.add_argument("--steps", type=int, default=16, help="fixed: denoise steps per block")
    p.add_argument("--batch", type=int, default=1, help="fixed: requests per batch")
    p.add_argument("--n-prompts", type=int, default=8, help="adaptive: prompts (run one at a time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the workload after one warm-up pass")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="static committed slots of the compiled caches (default: just enough for the workload)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per system (default: $OMP_NUM_THREADS or 1)")
    p.add_argument("--host-memory", choices=("retain", "default"), default="retain",
                   help="CPU: every worker keeps the memory it frees (`dgemma_compile.cli.host_memory`, what the CLI does), "
                        "so no system's steps page-fault their temporaries in afresh (not with --in-process: a "
                        "process-wide setting stays out of the caller's process); default: the C library's own")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory bandwidth in B/s for the roofline (default: 4.8e12 on CUDA; on CPU a measured "
                        "single-thread copy bandwidth)")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for the roofline (default: H200 bf16 "
                   "spec on CUDA, none on CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="per system: stop timed repeats once they took this long (at least one runs)")
    p.add_argument("--timeout-s", type=float, default=900, help="per system and workload: seconds spent on its "
                   "requests (prepare with compile, warm-up and timed repeats), waits for other systems excluded")
    p.add_argument("--deadline-s", type=float, default=None, help="all systems together: no wait on a worker goes "
                   "on past this many seconds from the start (that system fails as timed out, the later ones too, "
                   "and the report is written): a time box for the whole run (bench/gpu_run.sh)")
    p.add_argument("--in-process", action="store_true", help="run every system in this process, still round-robin "
                   "(faster start, no timeouts; memory peaks then include the other systems' allocations)")
    p.add_argument("--sequential", action="store_true", help="no interleaving: each system's worker runs all its "
                   "repeats and exits before the next starts (when N copies of the model do not fit in memory)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    p.add_argument("--prefix", default="", help="results file names start with this (e.g. quant_ -> "
                   "quant_{model}_{device}_{date}.md)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--note", default="", help="free text printed with the results (e.g. machine contention)")
    return p


def default_systems(spec: models.ModelSpec) -> list[str]:
    # the fused / unfused variants answer one question (commit fusion), the quantized ones another; ask for them by name
    return [s for s in systems.SYSTEMS
            if (spec.has_checkpoint or not s.startswith("hf-"))
            and s not in ("ours-compiled-fused", "ours-compiled-unfused") + systems.QUANT_SYSTEMS]


class _Peaks:
    """Roofline machine numbers: bandwidth (B/s) and peak FLOP/s per dtype, given, H200 specs or measured here."""

    def __init__(self, args, device: str):
        self.args, self.cuda = args, device.startswith("cuda")
        if args.bandwidth:
            self.bandwidth, self.why = args.bandwidth, ["bandwidth given"]
        elif self.cuda:
            self.bandwidth, self.why = roofline.H200_BANDWIDTH, ["bandwidth: H200 HBM3e spec"]
        else:
            self.bandwidth, self.why = environment.cpu_copy_bandwidth(), ["bandwidth: measured single-thread copy"]
        self.flops: dict[str, float] = {}

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            if self.args.peak_flops:
                self.flops[dtype], why = self.args.peak_flops, "given"
            elif self.cuda:
                self.flops[dtype], why = roofline.H200_BF16_FLOPS, "H200 dense bf16 spec"
            else:
                self.flops[dtype] = environment.cpu_matmul_flops(systems.DTYPES.get(dtype, torch.float32))
                why = f"measured single-thread {dtype} matmul"
            self.why.append(f"peak FLOP/s ({dtype}): {why}")
        return self.flops[dtype]


def _roofline(spec: models.ModelSpec, work: workloads.Workload, dtype: str, peaks: _Peaks) -> roofline.Roofline:
    from dgemma_compile.model.loader import load_configs

    mcfg = load_configs(spec.checkpoint)[0] if spec.has_checkpoint else models.full_config(tiny=spec.direct == "full-tiny")
    prompts = [len(p) for r in work.requests for p in r.prompts]
    return roofline.for_workload(mcfg, batch=len(work.requests[0].prompts), prompt_len=round(sum(prompts) / len(prompts)),
                                 output_len=work.max_new_tokens, steps=work.config.max_denoising_steps,
                                 dtype_bytes={"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2),
                                 bandwidth=peaks.bandwidth, peak_flops=peaks.peak_flops(dtype))


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns {"markdown", "sections", "paths", "order"} (for tests; order: per workload kind,
    (repeat index, system) of every timed repeat in the order they ran)."""
    args = parser().parse_args(argv)
    deadline = time.perf_counter() + args.deadline_s if args.deadline_s is not None else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(threads)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    spec = models.resolve(args.model, args.checkpoint)
    chosen = args.systems.split(",") if args.systems else default_systems(spec)
    unknown = [s for s in chosen if s not in systems.SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(systems.SYSTEMS)}")
    dtype = args.dtype
    if dtype is None and any(systems.quant_scheme(s) for s in chosen):
        dtype = "bfloat16"  # quantized rows are compared with bf16 ours-compiled: every system loads in bf16
        log("quantized system(s) chosen: --dtype bfloat16 for every system (the baseline is bf16 ours-compiled)")
    load_start, started = environment.load_average(), environment.now()
    # a process-wide allocator setting: only in the workers' own processes, never in a caller's (--in-process, tests)
    retain = args.host_memory == "retain" and device == "cpu" and not args.in_process
    peaks = _Peaks(args, device)

    sections, csv_sections, dtypes, orders = [], [], set(), {}
    for kind in [k.strip() for k in args.workloads.split(",") if k.strip()]:
        wspec = workloads.WorkloadSpec(kind=kind, prompt_len=args.prompt_len, output_len=args.output_len,
                                       steps=args.steps, batch=args.batch if kind == "fixed" else 1,
                                       n_prompts=args.n_prompts, seed=args.seed, repeats=args.repeats)
        work, _ = systems.workload_for(spec, wspec)
        log(f"{spec.name} / {work.describe()}")
        payloads = [dict(system=system, model=dataclasses.asdict(spec), workload=wspec.to_dict(), device=device,
                         dtype=dtype, threads=threads, max_seq_len=args.max_seq_len,
                         host_memory=retain)
                    for system in chosen]
        measured = runner.measure(payloads, wspec.repeats, interleave=not args.sequential, isolated=not args.in_process,
                                  timeout_s=args.timeout_s, budget_s=args.budget_s, deadline=deadline, log=log)
        raw, orders[kind] = measured.results, measured.order
        ok = [r for r in raw if r.get("status") == "ok"]
        dtypes |= {r["dtype"] for r in ok}
        roof = _roofline(spec, work, ok[0]["dtype"], peaks) if ok else None
        sec = report.section(f"workload `{kind}`", work.describe(), raw, roof, args.base)
        sections.append(sec)
        csv_sections.append((wspec.to_dict(), sec))

    vers = environment.versions()
    meta = dict(
        model=spec.name, device_tag=environment.device_tag(device), date=environment.today(),
        command="python -m bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        checkpoint=environment.checkpoint_id(spec.checkpoint), device=environment.device_name(device),
        dtype=", ".join(sorted(dtypes)) or dtype or "-", threads_n=threads,
        threads=f"torch {threads} thread(s) per system, OMP_NUM_THREADS={threads}",
        versions=", ".join(f"{k} {v}" for k, v in vers.items()), versions_dict=vers,
        isolation=("every system in this process" if args.in_process else
                   "every system in its own worker process, kept alive for the whole workload"),
        schedule=("sequential: each system prepared, warmed up and timed to the end before the next started"
                  if args.sequential else
                  "interleaved: systems prepared (compile, warm-up) one at a time, then timed repeats round-robin "
                  "(repeat 1 of every system in the order listed, then repeat 2, ...)"),
        memory=("CUDA max_memory_allocated during the timed passes" if device.startswith("cuda") else
                "resident-set high-water mark (VmHWM) during the timed passes, weights included; freed host memory "
                + ("retained in every worker (dgemma_compile.cli.host_memory)" if retain else
                   "returned as the C library decides")),
        load=f"load average 1/5/15 min at start {load_start}, at end {environment.load_average()} "
             f"({os.cpu_count()} logical CPUs)",
        started=started, finished=environment.now(), note=" ".join([args.note, "Roofline " + "; ".join(peaks.why) + "."]).strip())
    md = report.markdown(meta, sections)
    print(md)
    paths = []
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{args.prefix}{spec.name}_{meta['device_tag']}_{meta['date']}"
        paths = [args.out / f"{stem}.md", args.out / f"{stem}.csv"]
        paths[0].write_text(md)
        report.write_csv(paths[1], meta, csv_sections)
        log(f"wrote {paths[0]} and {paths[1]}")
    return {"markdown": md, "sections": sections, "paths": paths, "order": orders}


if __name__ == "__main__":
    main()
