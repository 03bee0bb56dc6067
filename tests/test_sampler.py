"""Sampler pieces against transformers' EntropyBoundSampler, StableAndConfidentStoppingCriteria and
LinearTemperatureScheduleLogitsProcessor on random logits."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.diffusion_gemma import generation_diffusion_gemma as ref

from dgemma_compile import sampler
from dgemma_compile.sampler import StepNoise, denoise_update


def start(canvas, frozen, stability):
    """(canvas, argmax, history, finished) of a block's start, as `steps.DenoiseState.begin` sets them."""
    B, C = canvas.shape
    return canvas, canvas.clone(), torch.full((stability, B, C), -1, dtype=torch.long), frozen.clone()


def update(state, logits, temperature, noise, **kw):
    """One `denoise_update`; returns the new (canvas, argmax, history, finished) and the update."""
    new = denoise_update(*state, logits, temperature, noise, **kw)
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
        scaled_ref = logits / temperature
        torch.testing.assert_close(new.scaled, scaled_ref, atol=0, rtol=0)
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


def test_streams_are_counter_based():
    a = sampler.step_noise([7, 8], block=2, step=5, canvas_length=6, vocab_size=50)
    b = sampler.step_noise([8], block=2, step=5, canvas_length=6, vocab_size=50)
    assert torch.equal(a.uniform[1], b.uniform[0]) and torch.equal(a.renoise[1], b.renoise[0])
    assert not torch.equal(sampler.start_canvas(7, 0, 16, 50), sampler.start_canvas(7, 1, 16, 50))
