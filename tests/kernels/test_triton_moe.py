"""The grouped-GEMM MoE Triton kernels (`experimental/moe_grouped_gemm.py`, `experimental/moe_lowering.py`) against
`moe_experts_loop`, run by Triton's interpreter on the CPU (`triton_support.py`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_compile.kernels.moe.op import moe_experts_loop
from triton_support import DEVICE, interpreted_triton_language

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module", autouse=True)
def _interpreted_language():
    with interpreted_triton_language():
        yield


# Relative bound for 16-bit dtypes, as in test_ops.py (BF16_BOUND): ~6 roundings of relative size <= eps/2 each in
# either implementation, against the output scale max |loop|. Observed: <= 1.8 eps (120 cases each, bfloat16, float16).
LOW_PRECISION_BOUND = 6
BLOCKS = dict(block_m=16, block_n=16, block_k=16)  # tl.dot's minimum: the fewest masked lanes at these tiny shapes


def moe_kernels():
    """The kernel module, checked to be interpreted when running on the CPU."""
    from triton.runtime.interpreter import InterpretedFunction

    from dgemma_compile.experimental import moe_grouped_gemm

    if DEVICE == "cpu" and not isinstance(moe_grouped_gemm._gate_up_kernel, InterpretedFunction):
        pytest.fail("moe_grouped_gemm was imported before TRITON_INTERPRET=1 was set: its kernels are not interpreted")
    return moe_grouped_gemm


def moe_args(N, D, I, E, K, *, routing="random", seed=0, dtype=torch.float32):
    """(x [N, D], w [N, K] float32, idx [N, K], gate_up [E, 2I, D], down [E, D, I]) on DEVICE, weights at
    1/sqrt(fan_in) so the output is O(1). routing: "random" (K distinct experts per token); "one" (every token to the
    same K experts: one expert holds all N rows when K = 1); "subset" (only the first K experts of a random order
    receive tokens, the others none)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.rand(N, K, generator=g) + 0.1
    if routing == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) if N else torch.zeros(0, K).long()
    elif routing == "one":
        idx = torch.randperm(E, generator=g)[:K].expand(N, K).clone()
    elif routing == "subset":
        used = torch.randperm(E, generator=g)[:K]
        idx = torch.stack([used[torch.randperm(K, generator=g)] for _ in range(N)])
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    return tuple(t.to(DEVICE) for t in (x.to(dtype), w, idx, gate_up.to(dtype), down.to(dtype)))


def assert_matches_loop(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        bound = LOW_PRECISION_BOUND * torch.finfo(ref.dtype).eps
        err, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert err <= bound * scale, f"max |out - loop| = {err:.3g} > {bound:.3g} * {scale:.3g}"


def check_case(N, D, I, E, K, routing, seed, dtype, **blocks):
    args = moe_args(N, D, I, E, K, routing=routing, seed=seed, dtype=dtype)
    out = moe_kernels().moe_experts_triton(*args, **(blocks or BLOCKS))
    assert_matches_loop(out, moe_experts_loop(*args))


shapes = dict(N=st.integers(1, 12), D=st.sampled_from([8, 16, 24, 40]), I=st.sampled_from([8, 16, 24]),
              E=st.integers(1, 6), K=st.integers(1, 3), routing=st.sampled_from(["random", "one", "subset"]),
              seed=st.integers(0, 1000))


@pytest.mark.slow  # ~2 s interpreted: the fast tier keeps the explicit cases below
@settings(max_examples=25)
@given(**shapes)
def test_moe_float32_matches_loop(N, D, I, E, K, routing, seed):
    check_case(N, D, I, E, min(K, E), routing, seed, torch.float32)


@pytest.mark.slow
@settings(max_examples=15)
@given(**shapes, dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_moe_low_precision_within_bound(N, D, I, E, K, routing, seed, dtype):
    check_case(N, D, I, E, min(K, E), routing, seed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_all_tokens_to_one_expert(dtype):
    """Skew: 40 rows in one expert (3 row tiles of 16, the last partial), the other 5 experts empty; and K = 2 with
    two experts holding everything."""
    check_case(40, 16, 8, 6, 1, "one", 1, dtype)
    check_case(20, 16, 8, 6, 2, "one", 2, dtype)


def test_moe_larger_blocks_and_k_loop():
    """D and I above one K block (several dot steps), with bigger tiles than the shapes (masked lanes)."""
    check_case(9, 40, 24, 4, 2, "random", 3, torch.float32, block_m=32, block_n=16, block_k=16)
    check_case(9, 40, 24, 4, 2, "subset", 4, torch.float32, block_m=16, block_n=32, block_k=32)


def test_moe_strided_weights():
    """Weights as non-contiguous views (the kernels take strides): transposed storage of gate_up and down."""
    x, w, idx, gate_up, down = moe_args(6, 16, 8, 3, 2, seed=5)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gate_up_t.is_contiguous() and not down_t.is_contiguous()
    out = moe_kernels().moe_experts_triton(x, w, idx, gate_up_t, down_t, **BLOCKS)
    assert_matches_loop(out, moe_experts_loop(x, w, idx, gate_up, down))


def test_moe_deterministic():
    """The combine has no atomics: two runs are bit-identical."""
    args = moe_args(12, 16, 8, 4, 2, seed=6, dtype=torch.bfloat16)
    run = moe_kernels().moe_experts_triton
    assert torch.equal(run(*args, **BLOCKS), run(*args, **BLOCKS))


def test_moe_no_tokens():
    args = moe_args(0, 16, 8, 4, 2)
    assert moe_kernels().moe_experts_triton(*args).shape == (0, 16)


@given(counts=st.lists(st.integers(0, 100), min_size=1, max_size=16), block_m=st.sampled_from([1, 16, 64]))
def test_max_row_tiles_bounds_any_routing(counts, block_m):
    tiles = sum(-(-c // block_m) for c in counts)
    assert tiles <= moe_kernels().max_row_tiles(sum(counts), len(counts), block_m)


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "x": a["x"][None]}, "x_ND"),
    (lambda a: {**a, "x": a["x"].double()}, "x_ND"),
    (lambda a: {**a, "idx": a["idx"].float()}, "idx_NK"),
    (lambda a: {**a, "idx": a["idx"][:-1]}, "idx_NK"),
    (lambda a: {**a, "w": a["w"][:, :1]}, "w_NK"),
    (lambda a: {**a, "w": a["w"].long()}, "w_NK"),
    (lambda a: {**a, "gate_up": a["gate_up"][:, :, :8]}, "gate_up_EID"),
    (lambda a: {**a, "gate_up": a["gate_up"][:, :-1]}, "gate_up_EID"),
    (lambda a: {**a, "gate_up": a["gate_up"].half()}, "gate_up_EID"),
    (lambda a: {**a, "down": a["down"][:, :, :4]}, "down_EDI"),
    (lambda a: {**a, "down": a["down"].half()}, "down_EDI"),
    (lambda a: {**a, "w": a["w"].to("meta")}, "w_NK"),
])
def test_moe_refuses_bad_arguments(change, name):
    x, w, idx, gate_up, down = moe_args(4, 16, 8, 3, 2)
    bad = change(dict(x=x, w=w, idx=idx, gate_up=gate_up, down=down))
    with pytest.raises(ValueError, match=name):
        moe_kernels().moe_experts_triton(bad["x"], bad["w"], bad["idx"], bad["gate_up"], bad["down"])


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dgemma_compile.experimental import moe_grouped_gemm as m

assert not triton.knobs.runtime.interpret
blocks = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, UPCAST=False)
for ptr in ("*bf16", "*fp16", "*fp32"):
    consts = dict(blocks, PRECISION="ieee" if ptr == "*fp32" else "tf32")
    types = dict(x_ptr=ptr, gate_up_ptr=ptr, h_ptr=ptr, down_ptr=ptr, order_ptr="*i64", counts_ptr="*i32",
                 route_w_ptr="*fp32", y_ptr="*fp32")
    for kernel in (m._gate_up_kernel, m._down_kernel):
        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (ptr, kernel.__name__)
        print(ptr, kernel.__name__, "wgmma" in compiled.asm["ptx"])

# the launcher as moe_lowering's autotuning choice: traced by make_fx into two user-kernel nodes, static grid
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from dgemma_compile.experimental.moe_lowering import _triton_choice
args = (torch.randn(5, 16).bfloat16(), torch.rand(5, 2), torch.tensor([[0, 1]] * 5), torch.randn(3, 16, 16).bfloat16(),
        torch.randn(3, 16, 8).bfloat16())
gm = make_fx(lambda *a: _triton_choice(*a, block_m=16, block_n=64, block_k=64), tracing_mode="fake")(*args)
assert sum("TritonKernelWrapperMutation" in type(n.target).__name__ for n in gm.graph.nodes) == 2, gm.code
"""


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90():
    """The kernels as the GPU compiles them (no interpreter: catches what it forgives, e.g. a non-constexpr global),
    down to an sm_90 cubin with Triton's bundled ptxas, and the launcher traced by make_fx as `moe_lowering` traces
    it; in a subprocess without TRITON_INTERPRET (~5 s)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") == 6, done.stdout


@pytest.mark.slow
def test_moe_lowering_is_explicit_and_leaves_cpu_graphs_unchanged(monkeypatch):
    """Importing `moe_lowering` registers nothing; registered, Inductor consults it for a CPU call, which it declines
    (None: the usual lowering), so the compiled CPU graph computes what it did; unregistering removes it. (Its CUDA
    path is unverified here: no GPU.) One Inductor compile, ~4 s."""
    if DEVICE != "cpu":
        pytest.skip("checks the CPU path; the CUDA path is for the GPU script")
    from torch._inductor.lowering import user_lowerings

    from dgemma_compile.experimental import moe_lowering

    op = torch.ops.dgemma.moe_experts.default
    assert not moe_lowering.moe_lowering_registered() and op not in user_lowerings
    with pytest.raises(ValueError, match="impls"):
        moe_lowering.register_moe_lowering(impls=("triton",))
    moe_lowering.register_moe_lowering()
    try:
        seen = []
        installed = user_lowerings[op]
        monkeypatch.setitem(user_lowerings, op, lambda *a, **k: seen.append(installed(*a, **k)))
        args = moe_args(5, 16, 8, 4, 2, seed=7)
        f = lambda x, w, idx, gate_up, down: torch.ops.dgemma.moe_experts(  # noqa: E731
            x * 2, w, idx, gate_up, [], down, [], "grouped", "none") + 1
        torch._dynamo.reset()
        # no cache hit: its key does not cover user lowerings, and a hit would skip lowering altogether
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            assert torch.equal(torch.compile(f, fullgraph=True)(*args), f(*args))
        assert seen == [None]
    finally:
        monkeypatch.undo()
        moe_lowering.unregister_moe_lowering()
    assert not moe_lowering.moe_lowering_registered() and op not in user_lowerings


