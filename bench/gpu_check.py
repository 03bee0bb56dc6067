"""One-command GPU check of the compiled generator (run it whenever a session is lent a GPU; < 8 min on an H200).

    python bench/gpu_check.py [--repeats 20] [--part all|correctness|latency] [--device cuda|cpu]

`--part correctness` runs checks 1-3 and 5 (the most valuable minutes of a short lease: bench/gpu_run.sh runs it
first), `--part latency` check 4 alone. `--device cpu` runs the same code on a CPU (the rehearsal of bench/gpu_run.sh,
bench/gpu_rehearse.sh): wall-clock timings instead of CUDA events, no CUDA graphs, and check 5 is skipped (it compares
the CUDA kernel against the CPU op).

1. Demo model, float32 on CUDA: compiled tokens must equal eager tokens (several prompts, blocks, batch sizes).
2. Reports, per batch size of the bucket (`RowTable.views()`), whether its compiled step's CUDA graph was captured or
   why it fell back (logged).
3. The public `Observer` hook on CUDA (CUDA-event spans): eager, one `on_step` per denoise step and block ends
   0, 1, ... in order; compiled, one `on_step` per iteration of the driver (prefill chunks and commits included, so
   at least one per decoder pass) and one "step[B{b}_...]" unit span per `on_step`; positive durations
   (`check_observer`, which also runs on a CPU: tests/bench/test_bench.py).
4. Per-step latency (median of CUDA-event timings) of a denoise step at context 512, eager (`denoise_block` over the
   same buffers) vs compiled (`Bucket.step` of size 1 with one request in row 0 denoising), for the demo model
   and for a random-weight bf16 model with DiffusionGemma-like proportions.
5. `dgemma::sample_step`'s CUDA implementation (the Triton kernel, `kernels/sample/triton_kernel.py`; what the
   `sample_step_fusion` pass puts in every compiled denoise step) against its CPU implementation at the released
   vocabulary (bf16 logits [2, 256, 262144], softcap 30, one greedy row): argmax identical, sampled ids identical at
   >= 99.9% of positions (float32 sums in another order may move a draw at a chunk boundary), entropy and
   probabilities within 1e-4; plus its time against the unfused region compiled by Inductor.
6. Tensor parallel on one multi-GPU machine (`check_tensor_parallel`, only with 2+ CUDA devices; one line saying it
   was skipped otherwise): `dgemma generate --tensor-parallel-size N` (the CLI starts N ranks, nccl, rank r on cuda:r)
   on demo prompts with each experts split (`--experts-split tensor|expert`), its output equal to the single process's,
   N = 2 and, with 4+ devices, 4. `--tensor-parallel-only` runs this check alone (seconds of compile per rank).
Exit status 1 if tokens differ or a check fails. Prints versions and the device first.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dgemma_compile as dg  # noqa: E402
from dgemma_compile.demo import DEMO_MODEL  # noqa: E402
from dgemma_compile.compile import CompileOptions, build  # noqa: E402
from dgemma_compile.model.config import ModelConfig, RopeConfig  # noqa: E402
from dgemma_compile.model.backbone import DiffusionGemma  # noqa: E402
from dgemma_compile.step.phases import Phase  # noqa: E402
from dgemma_compile.model.forwards import denoise_block  # noqa: E402


def cuda_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn` over `repeats` calls: CUDA events on CUDA, the wall clock on a CPU run."""
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_tokens(model, gen) -> bool:
    """Compiled (`gen`, batch sizes 1 and 4) == eager tokens and stats; prints each size's step's CUDA-graph
    state."""
    cfg = model.generation_config.replace(max_new_tokens=40)
    prompts = [[2, 5, 6, 7], [2] + [9] * 20, [2, 11, 12]]
    ok = True
    for ps in (prompts[:1], prompts):
        eager = dg.generate(model, ps, cfg, seed=3, moe_impl=gen.moe_impl)
        compiled = gen.generate(ps, cfg, seed=3)
        same = eager.sequences == compiled.sequences and eager.stats == compiled.stats
        print(f"tokens compiled == eager (batch {len(ps)}): {same}")
        ok &= same
    for row_table in gen.row_tables:
        for view in row_table.views():
            unit = view.step
            state = "captured" if unit.graph is not None else f"no graph ({unit.graph_error or 'not captured yet'})"
            print(f"  {view.name}: {state}, called by {unit.strategy!r}, {unit.calls} calls")
    return ok


class CountingObserver(dg.Observer):
    """Keeps every span and block end it receives."""

    def __init__(self):
        self.steps: list[float] = []
        self.units: list[tuple[str, float]] = []
        self.blocks: list[int] = []

    def on_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def on_unit(self, name: str, seconds: float) -> None:
        self.units.append((name, seconds))

    def on_block_end(self, block: int) -> None:
        self.blocks.append(block)


def check_observer(generate, cfg: dg.GenerationConfig, label: str, compiled: bool) -> bool:
    """One prompt through `generate(prompts, cfg, seed=..., observer=...)`, every duration > 0. Eager: as many
    `on_step` spans as decoder passes, block ends 0, 1, ... in order, no unit spans. Compiled: one `on_step` per
    iteration of the driver -- one per decoder pass, plus the prefill chunk (the 4-token prompt is one chunk) and one
    per separate commit -- each holding one "step[" unit span (the bucket's compiled step), and the last block's end
    reported."""
    obs = CountingObserver()
    out = generate([[2, 5, 6, 7]], cfg, seed=5, observer=obs)
    passes = out.stats[0].steps_per_block
    steps = [s for n, s in obs.units if n.startswith("step[")]
    durations_ok = all(s > 0 for s in obs.steps + [s for _, s in obs.units])
    if compiled:
        separate = out.commits  # one request: its commit iterations; fused commits ride in a counted denoise step
        ok = (durations_ok and len(steps) == len(obs.units) == len(obs.steps)
              and len(obs.steps) == 1 + sum(passes) + separate and obs.blocks[-1:] == [len(passes) - 1])
    else:
        ok = durations_ok and len(obs.steps) == sum(passes) and obs.blocks == list(range(len(passes))) \
            and not obs.units
    print(f"observer ({label}): {len(obs.steps)} steps for {sum(passes)} decoder passes, blocks {obs.blocks}, "
          f"{len(steps)} step[...] unit spans of {len(obs.units)}, median step "
          f"{statistics.median(obs.steps) * 1e3:.3f} ms: {'ok' if ok else 'WRONG'}")
    return ok


CONTEXT = 512
"""Committed slots before the timed denoise steps (the prompt's length)."""


def step_latency(model, label: str, repeats: int) -> None:
    """A denoise step at context `CONTEXT`, batch 1: the compiled step of size 1 (`Bucket.step`) with one request
    in row 0 denoising (its prompt of `CONTEXT` tokens prefilled by the step), vs the eager `denoise_block` over the
    same buffers. Each compiled step advances the row (its block may end): the row is re-admitted and prefilled
    again (untimed) whenever it is not DENOISE, and each timing is of one call."""
    gen = build(model, CompileOptions(batch_buckets=(1,), max_seq_len=1024))
    t0 = time.perf_counter()
    gen.warmup(1)
    compile_s = time.perf_counter() - t0
    cfg = model.generation_config.resolved(model.config)
    row_table = gen.row_table(cfg)
    view = row_table.view(1)
    prompt = [model.config.bos_token_id] + [3 + i % 20 for i in range(CONTEXT - 1)]
    readmits = -1

    def ready() -> None:
        nonlocal readmits
        phase = lambda: Phase(int(view.row_state.phase[0]))  # noqa: E731
        if phase() == Phase.DENOISE:
            return
        if phase() != Phase.PREFILL:
            row_table.admit(0, prompt, cfg, 0)
            view.refresh()
            readmits += 1
        while phase() == Phase.PREFILL:
            view.step()

    with torch.no_grad():
        ready()
        for _ in range(3):  # untimed (warmup captured the graph already)
            ready()
            view.step()
        times = []
        for _ in range(repeats):
            ready()
            times.append(cuda_ms(view.step, 1))
        compiled_ms = statistics.median(times)
        ready()
        state, cache = view.state, view.cache
        eager_ms = cuda_ms(lambda: denoise_block(model, state.canvas, cache, None, state.has_sc, moe_impl=gen.moe_impl,
                                                 self_conditioning_embeds=state.sc_embeds), repeats)
    graph = "CUDA graph" if view.step.graph is not None else "no CUDA graph"
    print(f"{label}: denoise step at context {CONTEXT}, batch 1: eager {eager_ms:.2f} ms, compiled {view.name} "
          f"({graph}) {compiled_ms:.2f} ms, ratio {eager_ms / compiled_ms:.2f}x; compile {compile_s:.0f} s; "
          f"{readmits} re-admissions (untimed)")


def scaled_model(device) -> DiffusionGemma:
    """Random bf16 weights with DiffusionGemma-26B-A4B proportions at 1/4 width and 8 layers."""
    layer_types = tuple("full_attention" if (i + 1) % 6 == 0 or i == 7 else "sliding_attention" for i in range(8))
    cfg = ModelConfig(vocab_size=65_536, hidden_size=704, intermediate_size=528, num_layers=8, num_attention_heads=4,
                      layer_types=layer_types, head_dims=tuple(128 if t == "full_attention" else 64 for t in layer_types),
                      num_kv_heads=tuple(1 if t == "full_attention" else 2 for t in layer_types), sliding_window=256,
                      rope={"sliding_attention": RopeConfig(rope_type="default", theta=1e4),
                            "full_attention": RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25)},
                      num_experts=32, top_k_experts=8, moe_intermediate_size=176, canvas_length=256)
    with torch.device(device):
        model = DiffusionGemma(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.generation_config = dg.GenerationConfig(max_denoising_steps=16, stop_early=False)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def check_sample_step_kernel(repeats: int) -> bool:
    from dgemma_compile.step import sampler

    g = torch.Generator().manual_seed(0)
    B, C, V = 2, 256, 262_144
    logits = (torch.randn(B, C, V, generator=g) * 8).to(torch.bfloat16)
    T, greedy, u = torch.tensor([0.8, 1.0]), torch.tensor([False, True]), torch.rand(B, C, generator=g)
    ref = torch.ops.dgemma.sample_step(logits, T, greedy, u, 30.0, torch.bfloat16)
    dev = [t.cuda() for t in (logits, T, greedy, u)]
    out = [t.cpu() for t in torch.ops.dgemma.sample_step(*dev, 30.0, torch.bfloat16)]
    same_argmax = torch.equal(out[0], ref[0])
    sampled = (out[1] == ref[1]).float().mean().item()
    ent = (out[2] - ref[2]).abs().max().item()
    probs = (out[3].float() - ref[3].float()).abs().max().item()
    ok = same_argmax and sampled >= 0.999 and ent <= 1e-4 and probs <= 1e-4
    kernel_ms = cuda_ms(lambda: torch.ops.dgemma.sample_step(*dev, 30.0, torch.bfloat16), repeats)
    region = torch.compile(lambda x, t, gr, uu: sampler.sample_step(torch.tanh(x.float() / 30.0) * 30.0, t, gr, uu))
    region(*dev)
    region_ms = cuda_ms(lambda: region(*dev), repeats)
    print(f"sample_step kernel vs CPU op (2 x 256 x 262144 bf16): argmax identical {same_argmax}, sampled equal "
          f"{sampled:.4%}, max |entropy diff| {ent:.2e}, max |prob diff| {probs:.2e} -> {'ok' if ok else 'FAIL'}; "
          f"kernel {kernel_ms:.2f} ms vs Inductor's unfused region {region_ms:.2f} ms")
    return ok


TP_PROMPTS = "sort 3 1 2 9 5=\nrev 4 0 7=\nadd 12+30=\ndedup 5 5 1 2 2=\n"
"""Demo prompts (one a line) of the multi-GPU check; the CLI prints one JSON line per prompt."""


def check_tensor_parallel(timeout_s: float = 900.0) -> bool:
    """`dgemma generate --prompts-file -` on the demo with `--tensor-parallel-size N` (nccl, one rank a GPU) for each
    experts split, against one process on cuda:0: the printed completions must be equal. Skipped (True, one line)
    with fewer than 2 CUDA devices. N: 2, and 4 when 4+ devices (the demo's 4 query heads and 8 experts divide)."""
    n_dev = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_dev < 2:
        print(f"tensor parallel (multi-GPU): skipped, {n_dev} CUDA device(s) here; needs 2 or more")
        return True

    def generate(*flags: str) -> str:
        cmd = [sys.executable, "-m", "dgemma_compile.cli", "generate", "--prompts-file", "-", "--batch-size", "4",
               *flags]
        done = subprocess.run(cmd, input=TP_PROMPTS, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    ok = True
    want = generate()
    for n in [n for n in (2, 4) if n <= n_dev]:
        for split in ("tensor", "expert"):
            t0 = time.perf_counter()
            try:
                got = generate("--tensor-parallel-size", str(n), "--experts-split", split)
                same = got == want
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                got, same = str(e), False
            ok &= same
            print(f"tensor parallel N={n} experts={split} (nccl, {n} GPUs): output == one process: {same} "
                  f"({time.perf_counter() - t0:.0f} s with compiles)" + ("" if same else f"\n  got: {got[-500:]!r}"))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tensor-parallel-only", action="store_true", help="run the multi-GPU check alone")
    p.add_argument("--part", choices=("all", "correctness", "latency"), default="all",
                   help="correctness: checks 1-3, 5 and 6; latency: check 4; all: both (default)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same checks on a CPU (a rehearsal: wall-clock timings, check 5 skipped)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        check_tensor_parallel()  # says it is skipped
        return 2
    if args.tensor_parallel_only:
        return 0 if check_tensor_parallel() else 1
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (rehearsal: no CUDA)"
    print(f"torch {torch.__version__}, device {name}, dgemma_compile from {dg.__file__}", flush=True)
    ok = True
    clock = "CUDA events" if args.device == "cuda" else "wall clock"
    if args.part in ("all", "correctness"):
        if args.device == "cuda":
            ok &= check_sample_step_kernel(args.repeats)
        else:
            print("sample_step kernel vs CPU op: skipped (needs CUDA)")
        demo = dg.load(DEMO_MODEL, device=args.device)
        gen = build(demo, CompileOptions(batch_buckets=(1, 4), max_seq_len=256))
        ok &= check_tokens(demo, gen)
        cfg = demo.generation_config.replace(max_new_tokens=40)
        ok &= check_observer(gen.generate, cfg, f"compiled, {clock}", compiled=True)
        ok &= check_observer(lambda *a, **k: dg.generate(demo, *a, **k), cfg, f"eager, {clock}", compiled=False)
        if args.device == "cuda":
            ok &= check_tensor_parallel()
    if args.part in ("all", "latency"):
        step_latency(dg.load(DEMO_MODEL, device=args.device), "demo fp32", args.repeats)
        step_latency(scaled_model(args.device), "scaled bf16", args.repeats)
    print(f"gpu_check: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
