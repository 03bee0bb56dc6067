"""`dgemma::moe_experts`: every implementation against the loop (transformers' order), eager and compiled through
the units' backend (with `moe_decompositions`), the implementation rule, and refused inputs."""

import functools
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dgemma_compile as dg
from dgemma_compile import kernels as ops
from dgemma_compile.compile.options import CompileOptions
from dgemma_compile.compile.units import UnitFactory

moe = torch.ops.dgemma.moe_experts
D, I = 16, 8  # multiples of 8: torch._grouped_mm needs 16-byte strides in bfloat16
# bfloat16: each implementation rounds its intermediates to bfloat16 (gate/up projections, the activation product,
# the down projection, the weighted term, the K-term accumulation): ~6 roundings of relative size <= eps/2 each, so
# two implementations differ by <= ~6 eps relative to the terms' magnitude, which the output scale max|loop| bounds
# up to a small factor (random weights with 1/sqrt(fan_in) scale: no strong cancellation). Observed: <= 1.05 eps
# eager (480 cases per implementation), <= 1.12 eps compiled grouped (20 cases).
BF16_BOUND = 6 * torch.finfo(torch.bfloat16).eps


def experts(N, E, K, *, routing="random", seed=0, dtype=torch.float32):
    """(x [N, D], w [N, K] float32, idx [N, K], gate_up [E, 2I, D], down [E, D, I]); weights at 1/sqrt(fan_in) so the
    output is O(1). routing: "random"; "one" (every token to the same K experts); "unused" (only experts 1, 4, 6 get
    tokens); "repeat" (a canvas of one repeated id: identical rows, identical routing)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    w = torch.rand(N, K, generator=g) + 0.1
    if routing == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    elif routing == "one":
        idx = torch.randperm(E, generator=g)[:K].expand(N, K).clone()
    elif routing == "unused":
        used = torch.tensor([1, 4, 6])
        idx = torch.stack([used[torch.randperm(3, generator=g)[:K]] for _ in range(N)])
    elif routing == "repeat":
        x, w = x[:1].expand(N, D).clone(), w[:1].expand(N, K).clone()
        idx = torch.randperm(E, generator=g)[:K].expand(N, K).clone()
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    return x.to(dtype), w, idx, gate_up.to(dtype), down.to(dtype)


def call(impl, x, w, idx, gate_up, down):
    return moe(x, w, idx, gate_up, [], down, [], impl, "none")


def assert_matches_loop(out, ref):
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        err, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert err <= BF16_BOUND * scale, f"max |out - loop| = {err:.3g} > {BF16_BOUND:.3g} * {scale:.3g}"


ROUTINGS = ["random", "one", "unused", "repeat"]


@pytest.mark.parametrize("impl", ["grouped", "dense", "gathered"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("N,K", [(16, 2), (1, 2), (5, 1), (7, 3)])
def test_eager_float32_matches_loop(impl, routing, N, K):
    args = experts(N, 8, K, routing=routing)
    assert_matches_loop(call(impl, *args), call("loop", *args))


@settings(max_examples=20)
@given(N=st.integers(1, 40), E=st.integers(1, 8), K=st.integers(1, 4), seed=st.integers(0, 1000))
@pytest.mark.parametrize("impl", ["grouped", "dense", "gathered"])
def test_eager_float32_matches_loop_random_shapes(impl, N, E, K, seed):
    args = experts(N, E, min(K, E), seed=seed)
    assert_matches_loop(call(impl, *args), call("loop", *args))


@pytest.mark.parametrize("impl", ["grouped", "dense", "gathered"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_eager_bfloat16_within_bound(impl, routing):
    args = experts(16, 8, 2, routing=routing, dtype=torch.bfloat16)
    out = call(impl, *args)
    assert out.dtype == torch.bfloat16
    assert_matches_loop(out, call("loop", *args))


# ----- compiled through the units' backend (few compiles: one per (impl, dtype), reused across routings) ----------
@functools.cache
def compiled(impl):
    fn = lambda x, w, idx, gate_up, down: moe(x, w, idx, gate_up, [], down, [], impl, "none") * 2  # noqa: E731
    return torch.compile(fn, backend=UnitFactory(CompileOptions(), "cpu").backend("t"), fullgraph=True)


def runs_op(fn, *args, op: str = "dgemma::moe_experts") -> tuple[torch.Tensor, bool]:
    """fn(*args) and whether the custom op `op` ran in the compiled code (a profiler event: independent of Inductor's
    caches). A first call compiles outside the profiler (tracing dispatches the op on fake tensors)."""
    fn(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, any(e.name == op for e in prof.events())


@pytest.mark.parametrize("impl,dtype", [("dense", torch.float32), ("gathered", torch.float32),
                                        ("gathered", torch.bfloat16), ("grouped", torch.bfloat16),
                                        ("loop", torch.float32)])
@pytest.mark.slow
def test_compiled_matches_loop_and_decomposes(impl, dtype):
    """Through the units' backend: "dense", "gathered" and "grouped" are traced into the graph (the op no longer runs), "loop"
    stays an opaque call; all match the eager loop on every routing (same shapes: one compile)."""
    for routing in ROUTINGS:
        args = experts(16, 8, 2, routing=routing, dtype=dtype)
        out, ran = runs_op(compiled(impl), *args)
        assert ran == (impl == "loop"), f"{impl}: dgemma::moe_experts {'did not run' if ran is False else 'ran'}"
        assert_matches_loop(out / 2, call("loop", *args))
    if impl == "gathered":  # its input is stored once (`kernels.moe.op.materialize`), not recomputed in the weight
        # loop: a copy in the generated code (`compile/lowerings.py`: the barrier itself is tested there), no call of
        # the op's Python kernel at run time
        assert not runs_op(compiled(impl), *args, op="dgemma::materialize")[1]


@pytest.mark.slow
def test_compiled_float32_grouped_on_cpu_is_an_opaque_call_with_the_eager_ops_bits():
    """"grouped" compiled in float32 on CPU stays an opaque call of the op (`torch._grouped_mm` traces only in
    bfloat16), which runs it eagerly: bitwise the eager op's output, and the loop's within float32 noise."""
    fn = torch.compile(lambda *a: call("grouped", *a), backend=UnitFactory(CompileOptions(), "cpu").backend("t"),
                       fullgraph=True, dynamic=False)
    args = experts(32, 8, 2)
    out, ran = runs_op(fn, *args)
    assert ran
    assert torch.equal(out, call("grouped", *args))
    assert_matches_loop(out, call("loop", *args))


def test_materialize_is_a_contiguous_copy():
    x = torch.randn(6, 4).T
    y = ops.moe.materialize(x)
    assert torch.equal(y, x) and y.is_contiguous() and y.data_ptr() != x.data_ptr()


def test_materialize_many_copies_each_tensor():
    xs = [torch.randn(6, 4).T, torch.tensor([True, False]), torch.arange(3)]
    ys = ops.moe.materialize_many(xs)
    assert len(ys) == 3
    for x, y in zip(xs, ys):
        assert y.dtype == x.dtype and torch.equal(y, x) and y.is_contiguous() and y.data_ptr() != x.data_ptr()


def test_decompositions_per_graph():
    def graph(*impls):
        def f(x, w, idx, gate_up, down):
            return sum(moe(x, w, idx, gate_up, [], down, [], impl, "none") for impl in impls)
        return torch.fx.symbolic_trace(f)

    key = torch.ops.dgemma.moe_experts.default
    for impl in ("dense", "grouped", "gathered"):
        assert key in ops.moe_decompositions(graph(impl))
    assert key not in ops.moe_decompositions(graph("loop"))
    assert [impl for impl, _, _ in ops.moe.graph_moe_calls(graph("dense", "grouped"))] == ["dense", "grouped"]
    assert key in ops.moe_decompositions(graph("grouped"))  # no example values (dtype unknown): traced
    with pytest.raises(ValueError, match="moe_impl"):
        ops.moe_decompositions(graph("loop", "dense"))
    from torch._inductor.decomposition import select_decomp_table
    assert key not in select_decomp_table()  # nothing registered globally


@pytest.mark.parametrize("dtype,opaque", [(torch.float32, True), (torch.bfloat16, False)])
def test_grouped_stays_opaque_outside_bfloat16(dtype, opaque):
    """`moe_decompositions` reads each call's input from the graph (a Dynamo graph's example values): "grouped" over
    float32 stays an opaque call (no decomposition entry), over bfloat16 it is traced; a graph mixing an opaque call
    with a traced one is refused."""
    def graph(*impls):
        def f(x, w, idx, gate_up, down):
            return sum(moe(x, w, idx, gate_up, [], down, [], impl, "none") for impl in impls)
        gm = torch.fx.symbolic_trace(f)
        next(n for n in gm.graph.nodes if n.name == "x").meta["example_value"] = torch.empty(4, D, dtype=dtype)
        return gm

    key = torch.ops.dgemma.moe_experts.default
    assert (key not in ops.moe_decompositions(graph("grouped"))) == opaque
    calls = ops.moe.graph_moe_calls(graph("grouped", "dense"))
    assert [c[:2] for c in calls] == [("grouped", "none"), ("dense", "none")]
    if opaque:
        with pytest.raises(ValueError, match="moe_impl"):
            ops.moe_decompositions(graph("grouped", "dense"))


@pytest.mark.parametrize("dtype,device,canvas,expected", [
    (torch.float32, "cpu", 256, "grouped"),     # every forward >= 256 tokens: grouped, an opaque eager call
    (torch.float32, "cpu", 255, "gathered"),
    (torch.float32, "cpu", None, "gathered"),   # canvas unknown
    (torch.float32, "cuda", 256, "gathered"),   # _grouped_mm runs in float32 on CPU only
    (torch.float16, "cpu", 256, "gathered"),
])
def test_resolve_moe_impl_grouped_for_large_float32_canvases_on_cpu(dtype, device, canvas, expected):
    got = ops.resolve_moe_impl("auto", dtype=dtype, num_experts=64, top_k=4, compiled=True, device_type=device,
                               canvas_length=canvas)
    assert got == expected
    assert ops.resolve_moe_impl("auto", dtype=dtype, num_experts=64, top_k=4, compiled=True, device_type=device,
                                canvas_length=canvas, quant="fp8") == "gathered"
    if expected == "grouped":  # explicit too; elsewhere outside bfloat16 refused
        assert ops.resolve_moe_impl("grouped", dtype=dtype, num_experts=64, top_k=4, compiled=True,
                                    device_type=device) == "grouped"
    elif dtype != torch.bfloat16 and device != "cpu":
        with pytest.raises(ValueError, match="moe_impl"):
            ops.resolve_moe_impl("grouped", dtype=dtype, num_experts=64, top_k=4, compiled=True, device_type=device)


def test_cache_key_tag():
    """AOTAutograd's cache key ignores the decomposition table: our compiles carry a tag hashing kernels/moe/op.py."""
    with torch.compiler.config.patch(cache_key_tag=""), ops.moe_cache_key():
        assert torch.compiler.config.cache_key_tag.startswith("dgemma-moe-")
    with torch.compiler.config.patch(cache_key_tag="user"):
        with ops.moe_cache_key():
            assert torch.compiler.config.cache_key_tag.startswith("user|dgemma-moe-")
        assert torch.compiler.config.cache_key_tag == "user"
    # a graph that does not trace the op (none in it, or calls that stay opaque) gets no tag: editing the MoE folder
    # leaves its cache entries warm
    with torch.compiler.config.patch(cache_key_tag="user"), ops.moe_cache_key(decomposed=False):
        assert torch.compiler.config.cache_key_tag == "user"


@pytest.mark.slow
def test_only_a_graph_that_traces_the_experts_is_tagged(monkeypatch):
    """Through the units' backend, a compile carries the MoE folder's tag only when its graph traces a
    `dgemma::moe_experts` call ("dense"): a graph without one, and one whose call stays opaque ("loop"), compile
    without it, so an edit of `kernels/moe/` leaves their Inductor cache entries warm."""
    from dgemma_compile.kernels.moe import op as moe_op

    seen = []
    real = moe_op.moe_cache_key

    def recording(decomposed: bool = True):
        seen.append(decomposed)
        return real(decomposed)

    monkeypatch.setattr(moe_op, "moe_cache_key", recording)
    args = experts(16, 8, 2)
    backend = UnitFactory(CompileOptions(), "cpu").backend
    plain = torch.compile(lambda x, w: (x @ w.T).relu(), backend=backend("plain"), fullgraph=True)
    x = torch.randn(16, 8)
    assert torch.equal(plain(x, x), (x @ x.T).relu())
    for impl in ("dense", "loop"):
        fn = torch.compile(lambda *a, impl=impl: call(impl, *a), backend=backend(impl), fullgraph=True)
        assert_matches_loop(fn(*args), call("loop", *args))
    assert seen == [False, True, False]


# ----- the rule and refused inputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("requested,dtype,E,K,compiled_,expected", [
    ("auto", torch.float32, 128, 8, False, "loop"),
    ("auto", torch.bfloat16, 128, 8, False, "loop"),
    ("auto", torch.bfloat16, 128, 8, True, "grouped"),
    ("auto", torch.bfloat16, 8, 2, True, "gathered"),    # E/K = 4
    ("auto", torch.bfloat16, 9, 2, True, "grouped"),     # E/K = 4.5
    ("auto", torch.float16, 128, 8, True, "gathered"),   # _grouped_mm traces only in bfloat16
    ("auto", torch.float32, 128, 8, True, "gathered"),
    ("auto", torch.float32, 8, 2, True, "gathered"),     # the demo model
    ("loop", torch.float32, 128, 8, True, "loop"),
    ("dense", torch.bfloat16, 128, 8, True, "dense"),
    ("grouped", torch.bfloat16, 8, 2, True, "grouped"),
    ("grouped", torch.float32, 128, 8, False, "grouped"),  # eager float32 grouped works
])
def test_resolve_moe_impl(requested, dtype, E, K, compiled_, expected):
    assert ops.resolve_moe_impl(requested, dtype=dtype, num_experts=E, top_k=K, compiled=compiled_) == expected


@pytest.mark.parametrize("requested,dtype", [("grouped", torch.float32), ("grouped", torch.float16),
                                             ("fast", torch.bfloat16)])
def test_resolve_moe_impl_refuses(requested, dtype):
    with pytest.raises(ValueError, match="moe_impl"):
        ops.resolve_moe_impl(requested, dtype=dtype, num_experts=8, top_k=2, compiled=True)


@pytest.mark.parametrize("quant", ["fp8", "fp8-weight-only", "nvfp4-w4a16", "int4"])
def test_grouped_and_unknown_formats_are_refused(quant):
    """"grouped" takes unquantized experts only; an unknown format is refused by every implementation; both name
    moe_impl and the format (never a silent dequantize to another path)."""
    x, w, idx, gate_up, down = experts(4, 8, 2)
    impls = ["grouped"] if quant != "int4" else list(ops.MOE_IMPLS)
    for impl in impls:
        with pytest.raises(ValueError, match=f"moe_impl='{impl}' does not take '{quant}'"):
            moe(x, w, idx, gate_up, [], down, [], impl, quant)
    if quant != "int4":
        with pytest.raises(ValueError, match="moe_impl='grouped'"):
            ops.resolve_moe_impl("grouped", dtype=torch.bfloat16, num_experts=8, top_k=2, compiled=True, quant=quant)
        assert ops.resolve_moe_impl("auto", dtype=torch.bfloat16, num_experts=64, top_k=2, compiled=True,
                                    quant=quant) == "gathered"


def test_bad_impl():
    with pytest.raises(ValueError, match="moe_impl must be one of"):
        call("fast", *experts(4, 8, 2))


def test_compile_options_moe_impl():
    from dgemma_compile.model.config import ConfigError

    assert CompileOptions().moe_impl == "auto"
    for impl in ("loop", "grouped", "dense"):
        assert CompileOptions(moe_impl=impl).moe_impl == impl
    with pytest.raises(ConfigError, match="moe_impl"):
        CompileOptions(moe_impl="fast")


# ----- the model's plumbing --------------------------------------------------------------------------------------
def test_model_moe_impl(tiny_dir):
    """`moe_impl` reaches every layer (an explicit one per call, else the model's attribute); an unknown one is
    refused before anything is written."""
    import dgemma_compile as dg
    from dgemma_compile.model.backbone import DiffusionGemma

    model = dg.load(tiny_dir)
    assert model.moe_impl == "loop"
    with pytest.raises(ValueError, match="moe_impl"):
        DiffusionGemma(model.config, moe_impl="auto")
    cache = model.new_cache(1, 32)
    prompt = torch.tensor([[3, 5, 7, 9, 11]])
    dg.encode(model, prompt, cache)
    canvas = torch.randint(0, model.config.vocab_size, (1, model.config.canvas_length))
    ref = dg.denoise(model, canvas, cache)
    for impl in ("grouped", "dense"):
        torch.testing.assert_close(dg.denoise(model, canvas, cache, moe_impl=impl), ref, atol=1e-4, rtol=1e-5)
    model.moe_impl = "dense"
    torch.testing.assert_close(dg.denoise(model, canvas, cache), dg.denoise(model, canvas, cache, moe_impl="dense"),
                               atol=0, rtol=0)
    keys = [k.clone() for k in cache.keys]
    with pytest.raises(ValueError, match="moe_impl"):
        dg.encode(model, prompt, cache, moe_impl="fast")
    assert int(cache.lengths[0]) == 5 and all(torch.equal(a, b) for a, b in zip(keys, cache.keys))


@pytest.mark.slow
def test_units_backend_compiles_through_inductors_fx_graph_cache():
    """The backend's decomposition table pickles to a stable key, so Inductor's FX graph cache serves a unit compiled
    before (in this process or an earlier one) instead of bypassing the cache ("Cannot produce stable cache key":
    a plain dict of decompositions holds an unpicklable pybind11 function). Two compiles of one MoE graph: neither
    bypasses the cache, the second is served by it."""
    from torch._dynamo.utils import counters

    def fn(x, w, idx, gate_up, down):
        return moe(x, w, idx, gate_up, [], down, [], "gathered", "none") + 1

    args = experts(8, 4, 2, routing="random", dtype=torch.float32)
    before = dict(counters["inductor"])
    for _ in range(2):  # a new backend each time: Dynamo recompiles, Inductor's cache may serve the graph
        compiled = torch.compile(fn, backend=UnitFactory(CompileOptions(), "cpu").backend("cache"), fullgraph=True)
        torch.testing.assert_close(compiled(*args), fn(*args))
    seen = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_bypass", "fxgraph_cache_hit")}
    assert seen["fxgraph_cache_bypass"] == 0 and seen["fxgraph_cache_hit"] >= 1, seen
    assert pickle.loads(pickle.dumps(ops.moe.DecompositionTable(True))) == ops.moe.DecompositionTable(True)
