"""Counter-based streams (dgemma_compile.step.rng): Random123 known answers, a pure-Python second oracle, the layout
table, uniformity and independence (chi-square at alpha = 1e-3, p-values from torch.special.gammaincc),
eager == compiled bit for bit without recompiles, batching invariance, ranges and argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgemma_compile.model.config import ConfigError
from dgemma_compile.step.rng import (
    LANE_RENOISE, LANE_SAMPLE, LANE_START_CANVAS, LANE_VOCAB_BASE, MAX_VOCAB, philox4x32, seed_tensor,
    start_canvas, step_noise, stream_words, to_token, to_uniform,
)

ALPHA = 1e-3
M32 = 0xFFFFFFFF
u32 = st.integers(0, M32)

# Random123 tests/kat_vectors, the philox4x32 lines: rounds, ctr[4], key[2] -> result[4].
KAT = """
philox4x32 7 00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
philox4x32 7 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
philox4x32 7 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
"""
KAT_ROWS = [(int(f[1]), [int(x, 16) for x in f[2:6]], [int(x, 16) for x in f[6:8]], [int(x, 16) for x in f[8:]])
            for f in (line.split() for line in KAT.strip().splitlines())]


def philox_ref(ctr, key, rounds=10):
    """Second oracle: Philox4x32 with Python big ints, straight from the SC'11 round function."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return [c0, c1, c2, c3]


def chi2_pvalue(observed: torch.Tensor, expected: float) -> float:
    obs = observed.to(torch.float64).flatten()
    chi2 = ((obs - expected) ** 2 / expected).sum()
    df = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(df, chi2 / 2).item()


def joint_pvalue(u: torch.Tensor, v: torch.Tensor, bins: int = 8) -> float:
    """Chi-square independence of two uniform streams on a bins x bins grid (both marginals known uniform)."""
    cell = (u.flatten() * bins).long() * bins + (v.flatten() * bins).long()
    return chi2_pvalue(torch.bincount(cell, minlength=bins * bins), u.numel() / bins**2)


def correlation_ok(u: torch.Tensor, v: torch.Tensor) -> bool:
    r = torch.corrcoef(torch.stack((u.flatten(), v.flatten())).double())[0, 1]
    return abs(r.item()) * u.numel() ** 0.5 < 3.29  # two-sided normal approximation, alpha = 1e-3


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


SEEDS = seed_tensor([0, 1, 2, 2**32, 2**63, 2**64 - 1, 12345, 2**63 - 1])  # adjacent, high-word-only, edges


# ---- Philox itself ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rounds,ctr,key,expected", KAT_ROWS)
def test_known_answer_vectors(rounds, ctr, key, expected):
    assert philox4x32(t(ctr), t(key), rounds).tolist() == expected
    assert philox_ref(ctr, key, rounds) == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.tuples(u32, u32, u32, u32), st.tuples(u32, u32)), min_size=1, max_size=32))
def test_matches_python_oracle(cases):
    out = philox4x32(t([c for c, _ in cases]), t([k for _, k in cases]))
    assert out.tolist() == [philox_ref(c, k) for c, k in cases]


def test_broadcasting_and_bijection():
    ctr = torch.stack(torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij"), -1).reshape(-1, 2)
    ctr = torch.cat((ctr, torch.zeros_like(ctr)), -1)  # 2**16 distinct counters
    out = philox4x32(ctr, t([[7, 9]]))
    assert out.shape == (2**16, 4) and out.min() >= 0 and out.max() <= M32
    assert torch.unique(out, dim=0).shape[0] == 2**16  # a keyed bijection: distinct counters, distinct outputs
    assert torch.equal(philox4x32(ctr[:5, None], t([[1, 2], [3, 4]])),
                       torch.stack([philox4x32(ctr[:5], t([k])) for k in ([1, 2], [3, 4])], 1))


# ---- layout and conversions ------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**64 - 1), u32, u32, st.integers(1, 40), st.sampled_from([0, 1, 2, 16, 65551, M32]))
def test_layout_table(seed, block, step, canvas, lane):
    words = stream_words(seed_tensor([seed]), t(block), t([step]), canvas, (lane,))
    pos = canvas - 1
    assert words[0, pos, 0].tolist() == philox_ref((block, step, pos, lane), (seed & M32, seed >> 32))
    canvas_ids = start_canvas(seed_tensor([seed]), t(block), canvas, 1000)
    w0 = philox_ref((block, 0, pos, LANE_START_CANVAS), (seed & M32, seed >> 32))[0]
    assert canvas_ids[0, pos].item() == (w0 * 1000) >> 32
    uniform, renoise = step_noise(seed_tensor([seed]), t(block), t(step), canvas, 1000)
    ws = philox_ref((block, step, pos, LANE_SAMPLE), (seed & M32, seed >> 32))[0]
    wr = philox_ref((block, step, pos, LANE_RENOISE), (seed & M32, seed >> 32))[0]
    assert uniform[0, pos].item() == (ws >> 8) / 2**24 and renoise[0, pos].item() == (wr * 1000) >> 32


@settings(max_examples=40, deadline=None)
@given(st.lists(u32, min_size=1, max_size=16), st.integers(1, MAX_VOCAB))
def test_conversions_exact(words, vocab):
    w = t(words + [0, M32])
    assert to_token(w, vocab).tolist() == [(x * vocab) >> 32 for x in words + [0, M32]]
    assert to_uniform(w).tolist() == [(x >> 8) / 2**24 for x in words + [0, M32]]


@pytest.mark.parametrize("vocab", [1, 2, 27, 1000, 262144, MAX_VOCAB])
def test_ranges(vocab):
    edge = t([0, 1, 2**31, M32 - 1, M32])
    assert to_uniform(edge).max().item() == 1 - 2**-24 < 1.0
    ids = torch.cat((to_token(edge, vocab).flatten(), start_canvas(SEEDS, t(3), 512, vocab).flatten(),
                     step_noise(SEEDS, t(3), t(7), 512, vocab)[1].flatten()))
    assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < vocab
    assert to_token(t([M32]), vocab).item() == vocab - 1
    uniform = step_noise(SEEDS, t(3), t(7), 512, vocab)[0]
    assert uniform.dtype == torch.float32 and uniform.min() >= 0 and uniform.max() < 1


# ---- statistics ------------------------------------------------------------------------------------------

def test_uniforms_are_uniform():
    uniform, _ = step_noise(SEEDS.repeat(2) + t([0] * 8 + [99] * 8), t(4), t(9), 4096, 2)
    assert chi2_pvalue(torch.bincount((uniform.flatten() * 256).long(), minlength=256), uniform.numel() / 256) > ALPHA


@pytest.mark.parametrize("vocab,shift", [(2, 0), (27, 0), (1000, 0), (262144, 12)])
def test_token_ids_are_uniform(vocab, shift):
    ids = torch.cat((start_canvas(SEEDS, t(1), 8192, vocab), step_noise(SEEDS, t(1), t(5), 8192, vocab)[1]))
    counts = torch.bincount(ids.flatten() >> shift, minlength=(vocab - 1 >> shift) + 1)
    assert chi2_pvalue(counts, ids.numel() / counts.numel()) > ALPHA


def _u(seeds, block, step, lane=LANE_SAMPLE, canvas=4096):
    return to_uniform(stream_words(seeds, t(block), t(step), canvas, (lane,))[..., 0, 0])


INDEPENDENCE_PAIRS = {
    "seed+1": lambda: (_u(SEEDS, 2, 3), _u(SEEDS + 1, 2, 3)),
    "seed+2**32": lambda: (_u(SEEDS, 2, 3), _u(SEEDS + 2**32, 2, 3)),
    "rows": lambda: (_u(SEEDS, 2, 3)[:-1], _u(SEEDS, 2, 3)[1:]),
    "positions": lambda: (_u(SEEDS, 2, 3)[:, :-1], _u(SEEDS, 2, 3)[:, 1:]),
    "steps": lambda: (_u(SEEDS, 2, 3), _u(SEEDS, 2, 2)),
    "blocks": lambda: (_u(SEEDS, 2, 3), _u(SEEDS, 3, 3)),
    "block/step swap": lambda: (_u(SEEDS, 2, 3), _u(SEEDS, 3, 2)),
    "lanes sample/renoise": lambda: (_u(SEEDS, 2, 3), _u(SEEDS, 2, 3, LANE_RENOISE)),
    "lanes canvas/vocab": lambda: (_u(SEEDS, 2, 0, LANE_START_CANVAS), _u(SEEDS, 2, 0, LANE_VOCAB_BASE)),
}


@pytest.mark.parametrize("name", list(INDEPENDENCE_PAIRS))
def test_streams_are_independent(name):
    u, v = INDEPENDENCE_PAIRS[name]()
    assert not torch.equal(u, v)
    assert joint_pvalue(u, v) > ALPHA
    assert correlation_ok(u, v)


def test_no_two_streams_equal():
    rows = [stream_words(SEEDS, t(b), t(s), 16, (0, 1, 2, 16, 17))[..., 0].permute(0, 2, 1).reshape(-1, 16)
            for b in range(4) for s in range(4)]  # one row per (seed, block, step, lane), 16 positions each
    words = torch.cat(rows)
    assert torch.unique(words, dim=0).shape[0] == words.shape[0] == 8 * 16 * 5


# ---- batching, compile -----------------------------------------------------------------------------------

def test_rows_depend_only_on_their_own_seed():
    block, step = t([0, 5, 5, 1, 2, 3, 4, 9]), t([1, 2, 3, 4, 5, 6, 7, 8])
    uniform, renoise = step_noise(SEEDS, block, step, 64, 1000)
    canvas = start_canvas(SEEDS, block, 64, 1000)
    for i in range(len(SEEDS)):
        u_i, r_i = step_noise(SEEDS[i:i + 1], block[i], step[i:i + 1], 64, 1000)
        assert torch.equal(u_i[0], uniform[i]) and torch.equal(r_i[0], renoise[i])
        assert torch.equal(start_canvas(SEEDS[i:i + 1], block[i:i + 1], 64, 1000)[0], canvas[i])
    shuffled = torch.randperm(len(SEEDS), generator=torch.Generator().manual_seed(0))
    u_s, _ = step_noise(SEEDS[shuffled], block[shuffled], step[shuffled], 64, 1000)
    assert torch.equal(u_s, uniform[shuffled])


def _all(seeds, block, step, ctr, key):
    return philox4x32(ctr, key), start_canvas(seeds, block, 64, 262144), *step_noise(seeds, block, step, 64, 1000)


def test_compiled_is_bit_identical_and_never_recompiles():
    torch._dynamo.reset()
    compiled = torch.compile(_all, fullgraph=True, dynamic=False)
    ctr, key = t([r[1] for r in KAT_ROWS[3:]]), t([r[2] for r in KAT_ROWS[3:]])
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        seeds = SEEDS if i == 0 else torch.randint(-2**63, 2**63 - 1, (8,), generator=gen)
        block, step = t(i * 7), torch.randint(0, 2**32, (8,), generator=gen)
        ctr = ctr if i == 0 else torch.randint(0, 2**32, (3, 4), generator=gen)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compiled(seeds, block, step, ctr, key)
        for a, b in zip(got, _all(seeds, block, step, ctr, key)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if i == 0:
            assert got[0].tolist() == [r[3] for r in KAT_ROWS[3:]]


# ---- argument errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [[1.5], [True], [-1], [2**64], ["3"], [None], 7, "12", None])
def test_bad_seeds_raise_config_error(bad):
    with pytest.raises(ConfigError, match="seed"):
        seed_tensor(bad)


def test_seed_tensor_bit_patterns():
    assert seed_tensor([0, 2**63 - 1, 2**63, 2**64 - 1]).tolist() == [0, 2**63 - 1, -2**63, -1]


@pytest.mark.parametrize("vocab", [0, -3, MAX_VOCAB + 1, True, 2.0])
def test_bad_vocab_raises(vocab):
    with pytest.raises(ValueError, match="vocab_size"):
        start_canvas(SEEDS, t(0), 8, vocab)


@pytest.mark.parametrize("block,match", [(0, "block"), (torch.tensor(0, dtype=torch.int32), "block"),
                                         (t([0, 1]), "block"), (t([[0] * 8]), "block")])
def test_bad_indices_raise(block, match):
    with pytest.raises(ValueError, match=match):
        step_noise(SEEDS, block, t(1), 8, 10)
    with pytest.raises(ValueError, match="canvas_length"):
        step_noise(SEEDS, t(0), t(1), 0, 10)
