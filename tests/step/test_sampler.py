"""Sampler pieces against transformers' EntropyBoundSampler, StableAndConfidentStoppingCriteria and
LinearTemperatureScheduleLogitsProcessor on random logits."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.diffusion_gemma import generation_diffusion_gemma as ref

from bench import vocabulary_region
from dgemma_compile.step import rng, sampler
from dgemma_compile.step.sampler import StepNoise, denoise_update


def start(canvas, frozen, stability):
    """(canvas, argmax, history, finished) of a block's start, as `mixed_step.DenoiseState.begin` sets them."""
    B, C = canvas.shape
    return canvas, canvas.clone(), torch.full((stability, B, C), -1, dtype=torch.long), frozen.clone()


def update(state, logits, temperature, noise, *, entropy_bound, confidence_threshold, stop_early, greedy=False):
    """One `denoise_update` with the same parameters for every row; returns the new (canvas, argmax, history,
    finished) and the update."""
    B = logits.shape[0]
    row = lambda v: torch.full((B,), v, dtype=torch.float32)  # noqa: E731
    new = denoise_update(*state, logits, row(temperature), torch.full((B,), greedy), noise,
                         entropy_bound_B=row(entropy_bound), confidence_B=row(confidence_threshold), stop_early=stop_early)
    return (new.canvas, new.argmax, new.history, new.finished), new


def random_logits(seed, B, C, V, spread):
    g = torch.Generator().manual_seed(seed)
    # mix peaked and flat positions so that acceptance masks are non-trivial
    scale = torch.rand(B, C, 1, generator=g) * spread
    return torch.randn(B, C, V, generator=g) * scale


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 4), C=st.integers(1, 32), V=st.integers(2, 100),
       bound=st.floats(0.01, 5.0), spread=st.floats(0.1, 30.0), step=st.integers(1, 48))
def test_acceptance_matches_entropy_bound_sampler(seed, B, C, V, bound, spread, step):
    logits = random_logits(seed, B, C, V, spread)
    proc = ref.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=48)
    scaled_ref = proc(None, logits, cur_step=step)
    scaled = logits / sampler.temperature(step, 48, 0.4, 0.8)
    torch.testing.assert_close(scaled, scaled_ref, atol=0, rtol=1e-6)

    s = ref.EntropyBoundSampler(ref.EntropyBoundSamplerConfig(entropy_bound=bound), C, V, 48)
    current = torch.randint(0, V, (B, C))
    denoised = torch.randint(0, V, (B, C))
    accepted_ref = s.accept_canvas(current, denoised, scaled_ref, step)
    mask = sampler.entropy_bound_accept(sampler.entropy(scaled_ref), bound)
    assert torch.equal(mask, s.accepted_token_mask)
    assert torch.equal(torch.where(mask, denoised, current), accepted_ref)
    assert mask.any(dim=-1).all(), "the lowest-entropy position is always accepted"


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 4), C=st.integers(1, 16), stability=st.integers(0, 3),
       threshold=st.floats(0.001, 3.0), steps=st.integers(1, 6), temperature=st.floats(0.05, 4.0))
def test_stop_flags_match_stable_and_confident(seed, B, C, stability, threshold, steps, temperature):
    """Stop flags against transformers' criteria fed the temperature-scaled logits (a drawn T: at T = 1 scaled and
    unscaled entropies agree), with the expected argmax history kept here, independently of ours."""
    g = torch.Generator().manual_seed(seed)
    V = 6
    crit = ref.StableAndConfidentStoppingCriteria(stability_threshold=stability, confidence_threshold=threshold)
    state = start(torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.bool), stability)
    flags_ref = torch.zeros(B, dtype=torch.bool)
    argmax_ref = torch.zeros(B, C, dtype=torch.long)
    history_ref: list[torch.Tensor] = []  # argmax canvases of earlier steps, oldest first
    base = torch.randn(B, C, V, generator=g) * 20
    for _ in range(steps):
        # mostly-stable argmax with occasional flips, and a mix of confident / unconfident rows
        logits = base + torch.randn(B, C, V, generator=g) * torch.rand(B, 1, 1, generator=g) * 15
        noise = StepNoise(uniform=torch.rand(B, C, generator=g), renoise=torch.randint(0, V, (B, C), generator=g))
        frozen = flags_ref.clone()
        state, new = update(state, logits, temperature, noise, entropy_bound=0.1, confidence_threshold=threshold,
                            stop_early=True)
        scaled_ref = (logits - logits.amax(-1, keepdim=True)) / temperature  # softmax-equal to logits / T
        torch.testing.assert_close(new.sc_probs, torch.softmax(scaled_ref, -1), atol=0, rtol=0)
        argmax_ref = torch.where(frozen[:, None], argmax_ref, scaled_ref.argmax(-1))
        flags_ref |= crit(argmax_ref, torch.where(frozen[:, None, None], logits, scaled_ref))
        history_ref.append(argmax_ref.clone())
        assert torch.equal(new.argmax, argmax_ref)
        assert torch.equal(new.finished, flags_ref)
        expected = [torch.full((B, C), -1, dtype=torch.long)] * stability + history_ref
        assert torch.equal(new.history, torch.stack(expected[len(expected) - stability:]) if stability
                           else torch.zeros(0, B, C, dtype=torch.long))


def test_never_stops_on_first_step():
    """Even perfectly confident logits cannot stop a block at its first step (stability needs a previous argmax)."""
    B, C, V = 3, 8, 5
    logits = torch.full((B, C, V), -30.0)
    logits[..., 2] = 30.0
    state = start(torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.bool), 1)
    noise = StepNoise(uniform=torch.rand(B, C), renoise=torch.randint(0, V, (B, C)))
    state, new = update(state, logits, 0.4, noise, entropy_bound=0.1, confidence_threshold=0.005, stop_early=True)
    assert not new.finished.any()
    state, new = update(state, logits, 0.4, noise, entropy_bound=0.1, confidence_threshold=0.005, stop_early=True)
    assert new.finished.all()


def test_frozen_rows_keep_their_state():
    B, C, V = 2, 4, 7
    state = start(torch.randint(0, V, (B, C)), torch.tensor([True, False]), 1)
    before = state[0].clone(), state[1].clone()
    noise = StepNoise(uniform=torch.rand(B, C), renoise=torch.randint(0, V, (B, C)))
    logits = torch.randn(B, C, V) * 5
    _, new = update(state, logits, 0.5, noise, entropy_bound=0.1, confidence_threshold=0.005, stop_early=True)
    assert torch.equal(new.canvas[0], before[0][0]) and torch.equal(new.argmax[0], before[1][0])
    assert torch.equal(new.argmax[1], logits[1].argmax(-1))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of `counts` against `probs` (float64), bins merged (by decreasing
    probability) until each expects >= 5 draws; the p-value from the regularised upper incomplete gamma function."""
    n = counts.sum().double()
    order = probs.argsort(descending=True)
    expected = probs[order].double() * n
    bin_id = torch.floor((torch.cumsum(expected, 0) - expected) / 5).long()
    obs = torch.bincount(bin_id, weights=counts[order].double())
    exp = torch.bincount(bin_id, weights=expected)
    if exp[-1] < 5 and len(exp) > 1:  # fold a short last bin into its neighbour
        obs, exp = torch.cat([obs[:-2], obs[-2:].sum(0, keepdim=True)]), torch.cat([exp[:-2], exp[-2:].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


ALPHA = 1e-3  # fixed in advance: a correct sampler fails one such test in a thousand


@pytest.mark.parametrize("kind,V", [("peaked", 64), ("flat", 64), ("masked", 300), ("random", 5000),
                                    ("released", 262_144)])
@pytest.mark.slow
def test_chunked_inverse_cdf_is_exact_in_distribution(kind, V):
    """10**5 draws per fixed logit row, uniforms from the real Philox stream, against the exact softmax
    probabilities (float64): chi-square goodness of fit at alpha = 1e-3."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(V, generator=g)
    if kind == "peaked":
        logits[7] += 9.0  # ~99% on one id, the rest in the tail
    elif kind == "flat":
        logits.zero_()
    elif kind == "masked":
        logits[::3] = float("-inf")  # ids of probability zero must never come out
    elif kind == "released":
        logits *= 3
    n = 100_000
    uniform = rng.step_noise(rng.seed_tensor([V]), torch.tensor(0), torch.tensor(1), n, V)[0]
    ids = torch.cat([sampler.sample_chunked_icdf(logits[None, None], u[None, None])[0, 0]
                     for u in uniform[0].split(8192)])
    counts = torch.bincount(ids, minlength=V)
    probs = torch.softmax(logits.double(), -1)
    assert counts.shape == (V,) and counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts, probs) > ALPHA


def test_chi_square_check_rejects_a_wrong_sampler():
    """The check above has power: the same draws scored against probabilities off by a factor 1.1 on one id."""
    logits = torch.zeros(64)
    uniform = rng.step_noise(rng.seed_tensor([1]), torch.tensor(0), torch.tensor(1), 100_000, 64)[0]
    counts = torch.bincount(sampler.sample_chunked_icdf(logits[None, None], uniform[None])[0, 0], minlength=64)
    wrong = torch.softmax(logits.double(), -1)
    wrong[0] *= 1.5
    assert chi_square_pvalue(counts, wrong / wrong.sum()) < ALPHA


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31), V=st.integers(2, 3000), chunk=st.sampled_from([1, 3, 64, 4096]),
       spread=st.floats(0.0, 40.0))
def test_chunked_matches_the_unchunked_inverse_cdf(seed, V, chunk, spread):
    """Same uniforms, any chunking: the same ids as the plain inverse CDF except where u lands within float32
    rounding of a boundary (rare: at most 1% of positions here)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 64, V, generator=g) * spread
    u = torch.rand(2, 64, generator=g)
    a, b = sampler.sample_chunked_icdf(logits, u, chunk), sampler.sample_inverse_cdf(logits, u)
    assert ((a == b).float().mean() >= 0.99) and (a < V).all()


def test_greedy_and_tiny_temperatures_are_finite():
    """T = 0 and denormal T are greedy (argmax, entropy 0 so all accepted, one-hot self-conditioning); T just above
    the greedy line scales to huge logits that stay finite."""
    B, C, V = 4, 6, 11
    logits = torch.randn(B, C, V) * 5
    state = start(torch.zeros(B, C, dtype=torch.long), torch.zeros(B, dtype=torch.bool), 1)
    noise = StepNoise(uniform=torch.rand(B, C), renoise=torch.randint(0, V, (B, C)))
    T, greedy = sampler.temperature_table([(0.0, 0.0, 1), (1e-45, 1e-45, 1), (1e-38, 1e-38, 1), (2e-38, 2e-38, 1)], 1)
    assert greedy[:, 0].tolist() == [True, True, True, False] and torch.isfinite(T).all()
    new = denoise_update(*state, logits, T[:, 0], greedy[:, 0], noise, entropy_bound_B=torch.full((B,), 0.1),
                         confidence_B=torch.full((B,), 0.005), stop_early=True)
    assert torch.equal(new.canvas[:3], logits[:3].argmax(-1)) and torch.equal(new.argmax, logits.argmax(-1))
    assert torch.isfinite(new.sc_probs).all()
    one_hot = new.sc_probs[:3]
    assert torch.equal(one_hot, torch.nn.functional.one_hot(logits[:3].argmax(-1), V).float())


def test_temperature_table_in_float64_with_budgets():
    T, greedy = sampler.temperature_table([(0.4, 0.8, 3), (0.5, 0.5, 1)], 4)
    want = torch.tensor([[0.4 + 0.4 * 3 / 3, 0.4 + 0.4 * 2 / 3, 0.4 + 0.4 * 1 / 3, 1.0], [0.5, 1.0, 1.0, 1.0]],
                        dtype=torch.float64).float()
    assert torch.equal(T, want)
    assert greedy.tolist() == [[False, False, False, True], [False, True, True, True]]
    with pytest.raises(ValueError, match="max_denoising_steps"):
        sampler.temperature_table([(0.4, 0.8, 5)], 4)


def test_inverse_cdf_sampling_distribution():
    """Empirical frequencies of inverse-CDF samples match softmax probabilities."""
    logits = torch.tensor([[[2.0, 0.0, -1.0, 1.0]]]).expand(1, 20000, 4).contiguous()
    u = torch.rand(1, 20000, generator=torch.Generator().manual_seed(0))
    ids = sampler.sample_inverse_cdf(logits, u)
    freq = torch.bincount(ids.flatten(), minlength=4).float() / ids.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0, 0], -1), atol=0.015, rtol=0)
    # u -> 0 gives the first token with non-zero probability, u -> 1 the last
    edge = sampler.sample_inverse_cdf(logits[:, :2], torch.tensor([[0.0, 1.0 - 1e-7]]))
    assert edge.tolist() == [[0, 3]]


def _region_inputs(B: int, C: int, V: int, seed: int = 0):
    """`bench.vocabulary_region.inputs` soft-capped: row 1 greedy, row 2 constrained."""
    head, T, greedy, uniform, allowed, constrained = vocabulary_region.inputs(B, C, V, torch.float32, seed)
    return torch.tanh(head / 30.0) * 30.0, T, greedy, uniform, allowed, constrained


@pytest.mark.parametrize("V", [27, 5000])  # the demo's vocabulary; two chunks, the second padded
def test_shared_exp_pass_gives_the_separate_passes_bits_eagerly(V):
    """`sample_step` computes exp(scaled) once for the sampler, the entropy and the self-conditioning input; eagerly
    every output equals the former composition's (each with its own max subtraction) bit for bit."""
    args = _region_inputs(3, 8, V)
    for got, want in zip(sampler.sample_step(*args), vocabulary_region.sample_step_before(*args), strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_shared_exp_pass_gives_the_separate_passes_bits_compiled():
    """Compiled by Inductor (its softmax and logsumexp decompositions, its exp), the same bits as the former
    composition compiled, for a vocabulary of whole vectors (two chunks here; the scaled model's 16,384 and the
    released 262,144 too). Where V leaves a tail after the last full vector, one kernel may take a tail id's exp on
    the scalar path where the other took the vector path: that id's sc_probs can differ by an ulp (V = 5,000:
    1 of 5,000 values; the demo's V = 27 gave the same bits, and its 500-prompt dump is byte-identical).
    bench/vocabulary_region.py times the two."""
    args = _region_inputs(3, 8, 5120)
    with torch.no_grad():
        now = torch.compile(sampler.sample_step, fullgraph=True)(*args)
        before = torch.compile(vocabulary_region.sample_step_before, fullgraph=True)(*args)
    for field, got, want in zip(sampler.SampleStep._fields, now, before, strict=True):
        assert torch.equal(got, want), field
