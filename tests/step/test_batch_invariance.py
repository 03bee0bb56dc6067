"""Batch-invariant rows: on the demo model a row's logits at every denoise step are bitwise those of its solo run,
whatever its batch mates (issue: a row's tokens changed with its batch mates when the eager cache was sized to the
longest prompt of the call).

What makes it hold: the cache size is fixed by the caller (`generate(max_seq_len=...)`, `CompileOptions.max_seq_len`),
prefill runs in fixed chunks, and the routed experts run with an implementation whose per-token result does not
depend on how many tokens an expert receives ("dense" eagerly, "gathered" compiled; the "loop" is not: it runs one
GEMM per expert over the tokens routed to it). Across buckets (`CompileOptions.batch_invariant`, on by default on a
CPU): the GEMMs' row counts M = B x T differ, and a CPU GEMM gives a row the same bits whatever M only from a
dtype's switch on (float32 M >= 4, bfloat16 M >= 2, measured: bench/batch_invariance.py); every GEMM of the model
has M a multiple of the canvas (16 demo, 256 released), so no fixed-M call is needed. Checked compiled on the demo
(bucket 1 against bucket 8) and eagerly at the released width in bfloat16.

The recorded signal per row and live step is the soft embedding of the step's softmax((logits - max) / T)
(`mixed_step.DenoiseState.sc_embeds`), a per-row function of that step's logits, plus the final sequences.
"""

import random

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.model.config import DEFAULT_MAX_SEQ_LEN
from dgemma_compile.oracle import EagerSteps, run_block_diffusion
from dgemma_compile.step.requests import plan_requests

# the settings: no row stops on confidence, at most 8 denoise steps per block
SETTINGS = dict(confidence_threshold=1e9, max_denoising_steps=8, max_new_tokens=48)


def _recorded(runner):
    """Wrap `runner.step` to keep, per request, a copy of its self-conditioning input after each step it ran live."""
    trace = [[] for _ in range(runner.R)]
    step = runner.step

    def record():
        live = (~runner.state.finished[:runner.R]).tolist()
        finished = step()
        for r in (r for r, on in enumerate(live) if on):
            trace[r].append(runner.state.sc_embeds[r].clone())
        return finished

    runner.step = record
    return trace


def _compiled_run(gen, cfg):
    """run(prompts, seeds) for `_assert_invariant` through `gen.generate`: each view's step of the bucket is wrapped to
    keep, per request (request r runs in row r: the call's requests fit the rows), a copy of its self-conditioning
    input after each step its row stepped."""
    from dgemma_compile.step.phases import stepping

    row_table = gen.row_table(cfg)

    def run(prompts, seeds):
        trace = [[] for _ in prompts]
        for size in row_table.sizes:
            view = row_table.view(size)
            step = getattr(view, "unwrapped", view.step)

            def record(view=view, step=step):
                live = stepping(view.row_state.phase, fused=row_table.fuse_commit).tolist()
                step()
                for r in (r for r, on in enumerate(live) if on and r < len(prompts)):
                    trace[r].append(view.state.sc_embeds[r].clone())

            view.unwrapped, view.step = step, record
        try:
            return gen.generate(prompts, cfg, seed=seeds), trace
        finally:
            for view in row_table.views():
                view.step = view.unwrapped

    return run


def _random_batches(vocab: int, n: int, seed: int, max_rows: int):
    rng = random.Random(seed)
    for _ in range(n):
        rows = rng.randint(2, max_rows)
        prompts = [[2] + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(rows)]
        yield prompts, [rng.randrange(1, 2**32) for _ in range(rows)]


def _assert_invariant(run, prompts, seeds):
    batch, batch_trace = run(prompts, seeds)
    for r, (p, s) in enumerate(zip(prompts, seeds)):
        solo, solo_trace = run([p], [s])
        assert solo.sequences[0] == batch.sequences[r], f"row {r}: tokens differ from its solo run"
        assert len(solo_trace[0]) == len(batch_trace[r]), f"row {r}: ran other steps than its solo run"
        for k, (a, b) in enumerate(zip(solo_trace[0], batch_trace[r])):
            assert torch.equal(a, b), f"row {r}, live step {k}: logits differ by {(a - b).abs().max().item():.3g}"


@pytest.mark.slow
def test_eager_rows_are_bitwise_batch_invariant(demo):
    model, _ = demo
    cfg = model.generation_config.replace(**SETTINGS)

    def run(prompts, seeds):
        cfgs, prompts, seeds, _ = plan_requests(model, prompts, cfg, seeds)
        runner = EagerSteps(model, cfgs, seeds, DEFAULT_MAX_SEQ_LEN, "dense")
        trace = _recorded(runner)
        return run_block_diffusion(model, runner, prompts, cfgs), trace

    for prompts, seeds in _random_batches(model.config.vocab_size, 4, seed=0, max_rows=4):
        _assert_invariant(run, prompts, seeds)


@pytest.mark.slow
def test_compiled_rows_are_bitwise_batch_invariant(demo, demo_gen):
    """Within one bucket (2 rows; a solo run leaves the other row idle)."""
    model, _ = demo
    cfg = model.generation_config.replace(**SETTINGS)
    run = _compiled_run(demo_gen, cfg)
    for prompts, seeds in _random_batches(model.config.vocab_size, 16, seed=1, max_rows=2):
        _assert_invariant(run, prompts, seeds)


def test_eager_generate_refuses_requests_beyond_max_seq_len(demo):
    """The eager cache size is the caller's `max_seq_len`, never the batch's: a request needing more is refused."""
    model, _ = demo
    cfg = model.generation_config.replace(max_new_tokens=32)
    with pytest.raises(dg.ConfigError, match="max_seq_len"):
        dg.generate(model, [[2] + [5] * 40], cfg, max_seq_len=40)
    with pytest.raises(dg.ConfigError, match="max_seq_len: must be a positive integer"):
        dg.generate(model, [[2, 5]], cfg, max_seq_len=0)


@pytest.mark.slow
def test_compiled_rows_are_bitwise_invariant_across_buckets(demo):
    """A row alone at batch size 1 against the same row among up to 7 batch mates at size 8 (2 batches: 8 rows, and
    5 rows, the other 3 idle): bitwise the same self-conditioning inputs at every live step and the same tokens."""
    from dgemma_compile.compile import CompileOptions, build

    model, _ = demo
    cfg = model.generation_config.replace(**SETTINGS)
    gen = build(model, CompileOptions(batch_buckets=(1, 8), max_seq_len=256, batch_invariant=True))
    # size 1 ready first: a driver runs a lone row at the smallest READY size (`RowTable.warm`), which after the batch
    # of 8 would otherwise be size 8, and this test compares the two sizes
    gen.warmup(1, cfg)
    run = _compiled_run(gen, cfg)

    rng = random.Random(2)
    prompts = [[2] + [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randrange(3, 40))]
               for _ in range(8)]
    seeds = [rng.randrange(1, 2**32) for _ in range(8)]
    for prompts, seeds in ((prompts, seeds), (prompts[3:], seeds[3:])):
        _assert_invariant(run, prompts, seeds)
    assert {name.split("[")[1][:2] for name in gen.ready} == {"B1", "B8"}


def released_width_model(dtype: torch.dtype, num_experts: int = 8, top_k: int = 2,
                         vocab_size: int = 16_384) -> dg.DiffusionGemma:
    """Two layers (one sliding, one full) at the released width (hidden 2816, 16 query heads, sliding 8 x 256 and full
    2 x 512 KV heads, dense MLP 2112, experts of 704, canvas 256, window 1024, soft-cap 30: `test_real_size.TEXT`'s
    shapes) in `dtype`, random weights (N(0, 0.02) matrices, unit norms; `bench.models.build_direct`). Reduced: 8
    experts top-2 (routing still splits tokens unevenly among experts) and a vocabulary of 16,384 (as the scaled bench
    model: the lm_head's and the self-conditioning product's other dimension; their GEMM rows, what batching changes,
    stay B x 256), so that the test runs in well under a minute."""
    from bench.models import build_direct, full_config
    from dgemma_compile.model.config import FULL, SLIDING

    base = full_config()
    layers = (SLIDING, FULL)
    cfg = base.__class__(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                            "vocab_size": vocab_size, "num_layers": 2, "layer_types": layers,
                            "head_dims": (256, 512), "num_kv_heads": (8, 2), "num_experts": num_experts,
                            "top_k_experts": top_k, "max_position_embeddings": 8192})
    return build_direct(cfg, torch.device("cpu"), dtype)


def _gemm_is_row_invariant(dtype: torch.dtype) -> bool:
    """Whether this host's GEMM in `dtype` gives a row the same bits alone (256 rows) as inside 512 rows: oneDNN's
    AMX bfloat16 kernels (found on a Sapphire Rapids host, 2026-12-06) block over M differently by size and are not;
    then no model in that dtype on the host can be, and the check below has nothing of ours to test."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2112, 2816, generator=g) * 0.02).to(dtype)
    x = torch.randn(512, 2816, generator=g).to(dtype)
    return torch.equal(torch.nn.functional.linear(x[256:], w), torch.nn.functional.linear(x, w)[256:])


@pytest.mark.slow
def test_released_width_logits_are_bitwise_batch_invariant_in_the_hosts_compute_dtype():
    """The released width in the dtype this host computes the released (bfloat16) checkpoint in
    (`compute_dtype.for_host`: bfloat16 where its GEMM is native, float32 where it is ATen's slow reference path,
    e.g. an AVX2-only host; there a bfloat16 run of this test took 10.6 minutes of CI and checked a dtype no default
    path of the host takes), eager: each row's float32 logits of two denoise passes (the second self-conditioned on
    the first) after its prompt's encoder chunk are bitwise those of its solo run, for the batch-invariant experts
    ("dense", the eager engine's; "grouped", what compiled bfloat16 runs at the released E/K = 16, and compiled
    float32 on CPU at a canvas of 256). Fixed shapes as in the engine: prompts padded to one 256-token chunk, a cache
    of 512 slots for every batch size. Rows: 2 prompts of 200 and 120 tokens; the solo run of the second (a third row
    of 30 tokens added time and no case: the batch's rows already differ in length and position)."""
    from dgemma_compile.model import compute_dtype

    dtype, _ = compute_dtype.for_host(torch.bfloat16, torch.device("cpu"))
    if not _gemm_is_row_invariant(dtype):
        pytest.skip(f"this host's {dtype} GEMM is not row-invariant (oneDNN AMX kernels): docs/numerics.md")
    model = released_width_model(dtype)
    C, slots = model.config.canvas_length, 512
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    lengths = [200, 120]
    ids = torch.randint(3, V, (2, C), generator=g)
    canvas = torch.randint(3, V, (2, C), generator=g)
    canvas2 = torch.randint(3, V, (2, C), generator=g)

    def run(rows: list[int], moe_impl: str) -> list[torch.Tensor]:
        cache = model.new_cache(len(rows), slots)
        dg.encode(model, ids[rows], cache, torch.tensor([lengths[r] for r in rows]), moe_impl=moe_impl)
        first = dg.denoise(model, canvas[rows], cache, None, moe_impl=moe_impl)
        return [first, dg.denoise(model, canvas2[rows], cache, first, moe_impl=moe_impl)]

    for moe_impl in ("dense", "grouped"):
        batch = run([0, 1], moe_impl)
        for r in (1,):
            for k, (solo, together) in enumerate(zip(run([r], moe_impl), batch)):
                assert solo.dtype == torch.float32
                assert torch.equal(solo[0], together[r]), \
                    f"{dtype} {moe_impl}, row {r}, pass {k}: differs by {(solo[0] - together[r]).abs().max().item():.3g}"


def test_batch_invariant_option_and_rule(demo):
    """`CompileOptions.batch_invariant`: None = on for CPU, off for CUDA (True refused there); the rule
    (`check_batch_invariant`) refuses a canvas below the dtype's GEMM row switch, an unmeasured dtype and the "loop"
    experts; by default a generator that cannot have it runs without, asked for it raises. Nothing compiles here."""
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.compile.options import GEMM_ROW_SWITCH, check_batch_invariant

    assert CompileOptions().batch_invariance("cpu") and not CompileOptions().batch_invariance("cuda")
    assert not CompileOptions(batch_invariant=False).batch_invariance("cpu")
    with pytest.raises(dg.ConfigError, match="batch_invariant"):
        CompileOptions(batch_invariant=True).batch_invariance("cuda")
    with pytest.raises(dg.ConfigError, match="batch_invariant"):
        CompileOptions(batch_invariant="yes")
    check_batch_invariant(16, torch.float32, "gathered")
    check_batch_invariant(256, torch.bfloat16, "grouped")
    for args in ((GEMM_ROW_SWITCH[torch.float32] - 1, torch.float32, "gathered"), (16, torch.float16, "gathered"),
                 (16, torch.float32, "loop")):
        with pytest.raises(dg.ConfigError, match="batch_invariant"):
            check_batch_invariant(*args)
    model, _ = demo
    assert build(model).batch_invariant
    assert not build(model, CompileOptions(moe_impl="loop")).batch_invariant
    with pytest.raises(dg.ConfigError, match="loop"):
        build(model, CompileOptions(moe_impl="loop", batch_invariant=True))
