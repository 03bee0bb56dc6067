"""The sample-step Triton kernel and Philox (`kernels/sample/triton_kernel.py`) against `sampler.sample_step` and `rng`, and
dgemma::sample_step's CUDA implementation against its CPU one, run by Triton's interpreter on the CPU
(`triton_support.py`)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_compile.step import rng, sampler
from triton_support import DEVICE, interpreted_triton_language
from test_rng import KAT_ROWS

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module", autouse=True)
def _interpreted_language():
    with interpreted_triton_language():
        yield


_sample_module = []


def sample_kernels():
    """kernels/sample/triton_kernel.py with kernels that run here: interpreted on the CPU, compiled on a CUDA device.

    Triton 3.7.1 reads `triton.knobs.runtime.interpret` (the env var TRITON_INTERPRET, set by triton_support)
    once per kernel, when `@triton.jit` decorates it; launches never read it again. Importing triton earlier is
    harmless, but if `dgemma_compile.kernels.sample.triton_kernel` itself was imported before this file (e.g. by `kernels.sample`
    registering its CUDA kernel), its kernels are compiled-mode JITFunctions that cannot take CPU tensors. Then this
    executes a private copy of the file (its own module object, not in sys.modules) with the knob forced on inside
    `triton.knobs.runtime.scope()`, so the outcome never depends on test order and the process's module is untouched.
    """
    if not _sample_module:
        from triton.runtime.interpreter import InterpretedFunction

        from dgemma_compile.kernels.sample import triton_kernel as module
        if DEVICE == "cpu" and not isinstance(module._sample_step_kernel, InterpretedFunction):
            spec = importlib.util.spec_from_file_location("dgemma_compile.kernels.sample._sample_step_interpreted",
                                                          module.__file__)
            module = importlib.util.module_from_spec(spec)
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                spec.loader.exec_module(module)
            assert isinstance(module._sample_step_kernel, InterpretedFunction)
        _sample_module.append(module)
    return _sample_module[0]


def test_philox_known_answers():
    """Random123's known-answer vectors (test_rng.KAT_ROWS), 7 and 10 rounds, through the device function."""
    for rounds, ctr, key, want in KAT_ROWS:
        got = sample_kernels().philox4x32_triton(torch.tensor([ctr], device=DEVICE), torch.tensor([key], device=DEVICE),
                                                 rounds)
        assert got.tolist() == [want]


@settings(max_examples=6)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**32), rounds=st.sampled_from([7, 10]))
def test_philox_words_match_rng(n, seed, rounds):
    """Words bit-identical to `rng.philox4x32` on arbitrary int64 counters and keys (each word taken mod 2**32)."""
    g = torch.Generator().manual_seed(seed)
    ctr, key = (torch.randint(-2**63, 2**63 - 1, (n, w), generator=g, dtype=torch.int64) for w in (4, 2))
    got = sample_kernels().philox4x32_triton(ctr.to(DEVICE), key.to(DEVICE), rounds)
    assert torch.equal(got.cpu(), rng.philox4x32(ctr, key, rounds))


@settings(max_examples=8)
@given(seeds=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4), C=st.integers(1, 300),
       block=st.integers(0, 2**40), step=st.integers(0, 2**33), per_row=st.booleans())
def test_philox_uniform_matches_step_noise(seeds, C, block, step, per_row):
    """`philox_uniform` is `rng.step_noise`'s uniform bit for bit (block/step 0-d or per row, past 2**32 too)."""
    seeds_B = rng.seed_tensor(seeds)
    B = len(seeds)
    block_t = torch.tensor([block + b for b in range(B)]) if per_row else torch.tensor(block)
    step_t = torch.tensor([step * b for b in range(B)]) if per_row else torch.tensor(step)
    got = sample_kernels().philox_uniform(seeds_B.to(DEVICE), block_t.to(DEVICE), step_t.to(DEVICE), C)
    assert torch.equal(got.cpu(), rng.step_noise(seeds_B, block_t, step_t, C, 2)[0])


def run_both(logits, T, greedy, u, *, sc_dtype=torch.float32, block_v=1024):
    """(kernel, oracle) SampleSteps, both on the CPU (the oracle's sc_probs in float32 whatever sc_dtype)."""
    out = sample_kernels().sample_step_triton(logits.to(DEVICE), T.to(DEVICE), greedy.to(DEVICE), u.to(DEVICE),
                                              sc_dtype=sc_dtype, block_v=block_v)
    assert out.sc_probs.dtype == sc_dtype
    return sampler.SampleStep(*(t.cpu() for t in out)), sampler.sample_step(logits, T, greedy, u)


def rounding_apart(logits, T, greedy, u, a, b, tol=1e-5):
    """bool [B, C]: sampled ids a and b are equal, or only float32 rounding of the sums separates them.

    The kernel and the oracle sum in different orders (tiles and a tree scan in the kernel, sequential cumsums in the
    oracle), so where u * total lies within rounding of a cumulative boundary they may pick neighbouring ids. In
    float64: the cumulative mass through min(a, b) and through max(a, b) - 1 must both lie within tol * total of the
    target (every id between them has a negligible mass). tol = 1e-5 is ~170 float32 roundings, above what the
    oracle's sequential cumsum over a 4096-id chunk typically accumulates (~sqrt(4096)). Greedy rows never qualify."""
    shifted = logits.double() - logits.double().amax(-1, keepdim=True)
    cdf = torch.exp(shifted / torch.where(greedy, 1.0, T.double())[:, None, None]).cumsum(-1)
    total = cdf[..., -1]
    target = u.double() * total
    through_lo = cdf.gather(-1, torch.minimum(a, b)[..., None])[..., 0]
    through_hi = cdf.gather(-1, (torch.maximum(a, b) - 1).clamp(min=0)[..., None])[..., 0]
    near = ((through_lo - target).abs() <= tol * total) & ((through_hi - target).abs() <= tol * total)
    return (a == b) | (near & ~greedy[:, None])


def assert_same(out, ref, logits, T, greedy, u):
    """argmax bit-identical; entropy to 1e-5 relative (1e-6 absolute near 0); sc_probs to 1e-5 relative in float32
    (exp(s) / Z with Z summed in another order), to one unit of the last place in bfloat16/float16 (a float32 value
    within rounding of a halfway point may round either way); sampled identical or `rounding_apart`."""
    assert torch.equal(out.argmax, ref.argmax)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-6)
    dtype = out.sc_probs.dtype
    rtol, atol = (1e-5, 1e-12) if dtype == torch.float32 else (torch.finfo(dtype).eps, 2**-24)
    torch.testing.assert_close(out.sc_probs.float(), ref.sc_probs.to(dtype).float(), rtol=rtol, atol=atol)
    one_hot = torch.nn.functional.one_hot(out.argmax, logits.shape[-1]).to(dtype)
    assert torch.equal(out.sc_probs[greedy], one_hot[greedy])
    assert rounding_apart(logits, T, greedy, u, out.sampled, ref.sampled).all(), (out.sampled, ref.sampled)


# temperatures per row: greedy (T = 1 as `temperature_table` stores it), tiny (just above float32's smallest normal,
# where every non-max scaled logit is clamped to float32's lowest), or ordinary
temperatures = st.lists(st.one_of(st.just(None), st.sampled_from([1.2e-38, 1e-30, 1e-4]), st.floats(0.05, 3.0)),
                        min_size=1, max_size=3)
# a tiny T overflows (x - m) / T to -inf before the clamp, which numpy (the interpreter) reports
OVERFLOW_OK = "ignore:overflow encountered in divide:RuntimeWarning"
vocab_sizes = st.sampled_from([1, 2, 37, 1000, 4095, 4096, 4097, 2 * 4096 + 123, 3 * 4096])


def temperature_rows(temps):
    greedy = torch.tensor([t is None for t in temps])
    return torch.tensor([1.0 if t is None else t for t in temps], dtype=torch.float32), greedy


@pytest.mark.slow
@pytest.mark.filterwarnings(OVERFLOW_OK)
@settings(max_examples=20)
@given(temps=temperatures, C=st.integers(1, 3), V=vocab_sizes, scale=st.sampled_from([0.1, 1.0, 4.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       sc_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       block_v=st.sampled_from([1024, 4096]), seed=st.integers(0, 2**16))
def test_sample_step_matches_oracle(temps, C, V, scale, dtype, sc_dtype, block_v, seed):
    """Random logits: argmax bit-identical, entropy and sc_probs to rounding (`assert_same`), sampled identical or only
    rounding apart (`rounding_apart`; none of these examples needs that escape, nor did any of 384 random positions
    at V = 4096..9000 tried by hand)."""
    g = torch.Generator().manual_seed(seed)
    T, greedy = temperature_rows(temps)
    logits = (torch.randn(len(temps), C, V, generator=g) * scale).to(dtype)
    u = torch.rand(len(temps), C, generator=g)
    out, ref = run_both(logits, T, greedy, u, sc_dtype=sc_dtype, block_v=block_v)
    assert_same(out, ref, logits, T, greedy, u)


@pytest.mark.slow
@pytest.mark.filterwarnings(OVERFLOW_OK)
@settings(max_examples=20)
@given(temps=temperatures, C=st.integers(1, 3), V=vocab_sizes, density=st.sampled_from([0.0, 0.001, 0.3, 1.0]),
       masked=st.booleans(), block_v=st.sampled_from([16, 1024, 4096]), seed=st.integers(0, 2**16))
def test_sample_step_exact_masses(temps, C, V, density, masked, block_v, seed):
    """Logits at the max (random ties) or 200 below it (or -inf): every exp(scaled) is exactly 1 or 0 for T <= 1, so
    every sum is an exact integer on both sides and `sampled` must match exactly, with no escape: chunk choice, empty
    and padded chunks, and the id search within a chunk. Ties at the max: both argmaxes are the first one."""
    if V > 1000 and block_v == 16:
        block_v = 1024  # 16-id tiles over thousands of ids are slow in the interpreter
    g = torch.Generator().manual_seed(seed)
    T, greedy = temperature_rows([t if t is None else min(t, 1.0) for t in temps])
    B = len(temps)
    top = torch.rand(B, C, 1, generator=g) * 10
    hit = torch.rand(B, C, V, generator=g) < density
    hit[..., torch.randint(V, (1,), generator=g)] = True
    logits = torch.where(hit, top, float("-inf") if masked else top - 200)
    u = torch.rand(B, C, generator=g)
    u[0, 0], u[-1, -1] = 0.0, 1 - 2**-24  # the first id of positive mass; the last (u's extremes)
    out, ref = run_both(logits, T, greedy, u, block_v=block_v)
    assert torch.equal(out.sampled, ref.sampled)
    assert_same(out, ref, logits, T, greedy, u)


def test_argmax_ties():
    """Exact ties in the scaled logits: torch.argmax returns the first index, and so does the kernel (the first id
    whose scaled logit is 0). Row 0: raw ties at ids 5, 3000 and 9000. Row 1: logits -1e-45 at id 2 and 0 at id 7
    with T = 2: (-1e-45 - 0) / 2 rounds to -0.0, which equals 0.0, so id 2 is a tie in the scaled logits (not in the
    raw ones) and both sides return 2."""
    logits = torch.full((2, 1, 9001), -5.0)
    logits[0, 0, [5, 3000, 9000]] = 3.0
    logits[1, 0, 2], logits[1, 0, 7] = -1e-45, 0.0
    T, greedy = torch.tensor([1.0, 2.0]), torch.tensor([False, False])
    u = torch.tensor([[0.3], [0.9]])
    out, ref = run_both(logits, T, greedy, u)
    assert ref.argmax.flatten().tolist() == [5, 2] == out.argmax.flatten().tolist()
    assert_same(out, ref, logits, T, greedy, u)


@pytest.mark.slow
def test_sample_step_draws_its_uniform():
    """With (seeds, block, step) the kernel draws `rng.step_noise`'s uniform itself: same outputs as passing it."""
    g = torch.Generator().manual_seed(3)
    logits, T, greedy = torch.randn(3, 2, 5000, generator=g), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0, 0, 1]) > 0
    seeds, block, step = rng.seed_tensor([7, 2**64 - 1, 2**40]), torch.tensor(2), torch.tensor([9, 8, 7])
    u = rng.step_noise(seeds, block, step, 2, 5000)[0]
    run = sample_kernels().sample_step_triton
    drawn = run(logits.to(DEVICE), T.to(DEVICE), greedy.to(DEVICE), seeds=seeds.to(DEVICE), block=block.to(DEVICE),
                step=step.to(DEVICE))
    given_u = run(logits.to(DEVICE), T.to(DEVICE), greedy.to(DEVICE), u.to(DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(drawn, given_u))
    out, ref = run_both(logits, T, greedy, u)
    assert_same(out, ref, logits, T, greedy, u)


def _sample_args():
    return dict(logits=torch.randn(2, 3, 50), temperature=torch.ones(2), greedy=torch.zeros(2, dtype=torch.bool),
                uniform=torch.rand(2, 3))


@pytest.mark.parametrize("change, name", [
    (lambda a: {**a, "logits": a["logits"][0]}, "logits"),
    (lambda a: {**a, "logits": a["logits"].double()}, "logits"),
    (lambda a: {**a, "logits": a["logits"].transpose(1, 2).contiguous().transpose(1, 2)}, "logits"),
    (lambda a: {**a, "temperature": a["temperature"].double()}, "temperature"),
    (lambda a: {**a, "temperature": a["temperature"][:1]}, "temperature"),
    (lambda a: {**a, "greedy": a["greedy"].int()}, "greedy"),
    (lambda a: {**a, "uniform": a["uniform"][:, :2]}, "uniform"),
    (lambda a: {**a, "uniform": None}, "uniform"),
    (lambda a: {**a, "seeds": torch.zeros(2, dtype=torch.int64), "block": torch.tensor(0), "step": torch.tensor(1)},
     "uniform"),
    (lambda a: {**a, "uniform": None, "seeds": torch.zeros(3, dtype=torch.int64), "block": torch.tensor(0),
                "step": torch.tensor(1)}, "seeds"),
    (lambda a: {**a, "uniform": None, "seeds": torch.zeros(2, dtype=torch.int64), "block": torch.tensor(0),
                "step": torch.tensor([1.0, 2.0])}, "step"),
    (lambda a: {**a, "block": torch.tensor(0)}, "block"),
    (lambda a: {**a, "sc_dtype": torch.float64}, "sc_dtype"),
    (lambda a: {**a, "block_v": 100}, "block_v"),
])
def test_sample_step_refuses_bad_arguments(change, name):
    args = change(_sample_args())
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=name):
        sample_kernels().sample_step_triton(**args)


@pytest.mark.parametrize("call, name", [
    (lambda m: m.philox4x32_triton(torch.zeros(3, 3, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64)),
     "counter"),
    (lambda m: m.philox4x32_triton(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)), "key"),
    (lambda m: m.philox4x32_triton(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64), 0),
     "rounds"),
    (lambda m: m.philox_uniform(torch.zeros(2, dtype=torch.int32), torch.tensor(0), torch.tensor(0), 4), "seeds"),
    (lambda m: m.philox_uniform(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                                torch.tensor(0), 4), "block"),
    (lambda m: m.philox_uniform(torch.zeros(2, dtype=torch.int64), torch.tensor(0), torch.tensor(0), 0),
     "canvas_length"),
])
def test_philox_refuses_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call(sample_kernels())


SAMPLE_SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dgemma_compile.kernels.sample import triton_kernel as m

assert not triton.knobs.runtime.interpret
target = GPUTarget("cuda", 90, 32)


def build(kernel, types, consts):
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, consts), target=target).asm


cases = (("*fp32", "*fp32", False, 1, False), ("*bf16", "*bf16", True, 64, True), ("*fp32", "*fp16", True, 4, True))
for logits, sc, philox, k_pad, has_mask in cases:
    consts = dict(K_PAD=k_pad, BLOCK_V=1024, PHILOX=philox, OUT_BF16=sc == "*bf16", HAS_MASK=has_mask)
    types = dict(logits_ptr=logits, stride_b="i64", stride_c="i64", t_ptr="*fp32", greedy_ptr="*i1", u_ptr="*fp32",
                 seed_ptr="*i64", block_ptr="*i64", step_ptr="*i64", argmax_ptr="*i64", sampled_ptr="*i64",
                 entropy_ptr="*fp32", probs_ptr=sc, allowed_ptr="*i32", constrained_ptr="*i1")
    asm = build(m._sample_step_kernel, types, consts)
    assert asm["cubin"] and "div.rn.f32" in asm["ptx"], (logits, sc)
    print(logits, sc, philox)
words = build(m._philox_words_kernel, dict(ctr_ptr="*i64", key_ptr="*i64", out_ptr="*i64"), dict(ROUNDS=10, BLOCK=128))
assert words["cubin"] and "mul.hi.u32" in words["ptx"]
uniform = build(m._philox_uniform_kernel, dict(seed_ptr="*i64", block_ptr="*i64", step_ptr="*i64", out_ptr="*fp32"),
                dict(BLOCK_C=256))
assert uniform["cubin"]
print("philox")
"""


@pytest.mark.slow
def test_sample_kernels_compile_for_sm90():
    """The sample_step (with and without the first-position mask) and Philox kernels as the GPU compiles them (the interpreter forgives type errors a compile
    would not), down to sm_90 cubins with Triton's bundled ptxas, in a subprocess without TRITON_INTERPRET (~5 s):
    the division is the correctly rounded div.rn and the Philox high word a native mul.hi.u32."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SAMPLE_SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("\n") == 4, done.stdout


@pytest.mark.parametrize("softcap,dtype,sc_dtype", [(None, torch.float32, torch.float32),
                                                    (30.0, torch.float32, torch.float32),
                                                    (15.0, torch.bfloat16, torch.bfloat16)])
def test_op_cuda_path_matches_the_cpu_op_in_slices(softcap, dtype, sc_dtype, monkeypatch):
    """What the op runs on CUDA (the kernel; with a softcap, one launch per slice of positions), here interpreted,
    against the op's CPU implementation with the same slicing: argmax identical, the rest as `assert_same`."""
    from dgemma_compile.kernels.sample import op

    B, C, V = 2, 3, 300
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(B, C, V, generator=g) * 40).to(dtype)
    T, greedy, u = torch.tensor([0.7, 1.0]), torch.tensor([False, True]), torch.rand(B, C, generator=g)
    monkeypatch.setattr(op, "CHUNK_BYTES", 4 * V * 2)  # two positions per slice: three slices
    out = op.triton_sample_step(sample_kernels().sample_step_triton, logits.to(DEVICE), T.to(DEVICE),
                                greedy.to(DEVICE), u.to(DEVICE), softcap, sc_dtype)
    ref = torch.ops.dgemma.sample_step(logits, T, greedy, u, softcap, sc_dtype)
    assert [t.shape for t in out] == [t.shape for t in ref] and out[3].dtype == sc_dtype
    capped = op._prologue(logits, softcap)
    out_f32 = sampler.SampleStep(*(t.cpu() for t in out))
    ref_f32 = sampler.sample_step(capped, T, greedy, u)
    assert torch.equal(ref[0], ref_f32.argmax)
    assert_same(out_f32, ref_f32, capped, T, greedy, u)


@pytest.mark.parametrize("softcap,dtype", [(None, torch.float32), (30.0, torch.float32), (15.0, torch.bfloat16)])
def test_masked_op_matches_the_reference(softcap, dtype, monkeypatch):
    """The first-position mask inside the op (per-row bitmask and flag, `sampler.mask_first`): the kernel
    (interpreted; with a softcap one launch per slice) and the CPU op against `sampler.sample_step` with the mask;
    a constrained row's position 0 picks only allowed ids, every other row and position is as without the mask."""
    from dgemma_compile.inputs.constraint import pack_bitmask
    from dgemma_compile.kernels.sample import op

    B, C, V = 3, 3, 300
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(B, C, V, generator=g) * 40).to(dtype)
    T, greedy = torch.tensor([0.7, 1.0, 0.9]), torch.tensor([False, True, False])
    u = torch.rand(B, C, generator=g)
    allowed_V = torch.rand(B, V, generator=g) < 0.05
    allowed = torch.stack([pack_bitmask(a) for a in allowed_V])
    constrained = torch.tensor([True, True, False])
    monkeypatch.setattr(op, "CHUNK_BYTES", 4 * V * 2)  # two positions per slice
    capped = op._prologue(logits, softcap)
    ref = sampler.sample_step(capped, T, greedy, u, allowed, constrained)
    cpu = torch.ops.dgemma.sample_step(logits, T, greedy, u, softcap, None, allowed, constrained)
    assert torch.equal(cpu[0], ref.argmax) and torch.equal(cpu[1], ref.sampled)
    torch.testing.assert_close(cpu[2], ref.entropy, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cpu[3], ref.sc_probs, rtol=1e-6, atol=1e-12)
    dev = [t.to(DEVICE) for t in (logits, T, greedy, u)]
    out = op.triton_sample_step(sample_kernels().sample_step_triton, *dev, softcap, None, allowed.to(DEVICE),
                                constrained.to(DEVICE))
    masked = sampler.mask_first(capped, allowed, constrained)
    assert_same(sampler.SampleStep(*(t.cpu() for t in out)), ref, masked, T, greedy, u)
    for b in (0, 1):  # constrained: position 0 allowed; its later positions and the free row unmasked
        assert allowed_V[b, ref.argmax[b, 0]] and allowed_V[b, ref.sampled[b, 0]]
    free = sampler.sample_step(capped, T, greedy, u)
    assert torch.equal(free.argmax[2], ref.argmax[2]) and torch.equal(free.argmax[:, 1:], ref.argmax[:, 1:])
    assert torch.equal(free.sc_probs[:, 1:], ref.sc_probs[:, 1:]) and torch.equal(free.sc_probs[2], ref.sc_probs[2])
    with pytest.raises(ValueError, match="allowed and constrained"):
        torch.ops.dgemma.sample_step(logits, T, greedy, u, softcap, None, allowed, None)
