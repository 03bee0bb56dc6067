"""The eager reference generator: whole generations against transformers' generate, batching, budgets, config."""

import json

import pytest
import torch
from helpers import hf_model, write_checkpoint
from transformers.models.diffusion_gemma import generation_diffusion_gemma as G

import dgemma_compile as dg
from dgemma_compile.model.config import ConfigError
from dgemma_compile.step import rng

# Temperatures so low that sampling is argmax and every position is accepted: no randomness is left except the
# start canvas of each block, which the test hands to both implementations.
COLD = dict(t_min=1e-6, t_max=2e-6, entropy_bound=0.1, confidence_threshold=0.005, stability_threshold=1)


def transformers_generate(ref, prompts, seed, C, V, *, max_new_tokens, steps, eos=None, **inputs):
    """transformers' generate with each block's start canvas taken from our stream for `seed`; `inputs`: more
    generate inputs (pixel_values, image_position_ids, mm_token_type_ids)."""
    original = G.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs
    block = [0]

    def with_our_canvas(self, **kw):
        canvas = rng.start_canvas(rng.seed_tensor([seed]), torch.tensor(block[0]), C, V)[0]
        kw["model_kwargs"]["decoder_input_ids"] = torch.stack([canvas] * len(prompts))
        block[0] += 1
        return original(self, **kw)

    extra = {"pad_token_id": 0} if eos is None else {"eos_token_id": eos, "pad_token_id": 0}
    G.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs = with_our_canvas
    try:
        out = ref.generate(torch.tensor(prompts), max_new_tokens=max_new_tokens, max_denoising_steps=steps,
                           t_min=COLD["t_min"], t_max=COLD["t_max"],
                           sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=COLD["entropy_bound"]),
                           stability_threshold=1, confidence_threshold=COLD["confidence_threshold"], **extra,
                           **inputs)
    finally:
        G.DiffusionGemmaGenerationMixin._prepare_denoiser_inputs = original
    return out


@pytest.mark.parametrize("seed,layers", [(0, ("sliding_attention", "full_attention")),
                                         (5, ("sliding_attention", "sliding_attention", "full_attention"))])
@pytest.mark.slow
def test_generation_matches_transformers_over_several_blocks(tmp_path, seed, layers):
    ref = hf_model(layer_types=layers, seed=seed, sliding_window=5)
    model = dg.load(write_checkpoint(tmp_path, ref))
    prompts = [[2, 9, 13, 4, 7, 30, 11], [2, 40, 41, 3, 3, 8, 1]]
    cfg = dg.GenerationConfig(max_new_tokens=32, max_denoising_steps=6, eos_token_ids=(63,), **COLD)
    ours = dg.generate(model, prompts, cfg, seed=seed)
    theirs = transformers_generate(ref, prompts, seed, 8, 64, max_new_tokens=32, steps=6, eos=63)
    for b in range(2):
        ref_new = theirs.sequences[b, 7:].tolist()
        n = len(ours.sequences[b])
        assert ours.sequences[b] == ref_new[:n] and set(ref_new[n:]) <= {0}
        assert ours.stats[b].tokens_per_forward == pytest.approx(float(theirs.tokens_per_forward[b]))
    assert sum(s.blocks for s in ours.stats) >= 5, "several blocks per row"


@pytest.mark.slow
def test_eos_in_the_middle_of_a_block_matches_transformers(tmp_path):
    ref = hf_model(seed=3)
    model = dg.load(write_checkpoint(tmp_path, ref))
    prompt = [[2, 17, 5, 22, 9]]
    free = dg.generate(model, prompt, dg.GenerationConfig(max_new_tokens=24, max_denoising_steps=6, eos_token_ids=(),
                                                          **COLD), seed=1)
    tokens = free.sequences[0]
    # declare as eos a token whose first appearance is in the middle of the second block
    pos = next(i for i in range(9, 15) if tokens[i] not in tokens[:i])
    eos = tokens[pos]
    cfg = dg.GenerationConfig(max_new_tokens=24, max_denoising_steps=6, eos_token_ids=(eos,), pad_token_id=0, **COLD)
    ours = dg.generate(model, prompt, cfg, seed=1)
    theirs = transformers_generate(ref, prompt, 1, 8, 64, max_new_tokens=24, steps=6, eos=eos)
    ref_new = theirs.sequences[0, 5:].tolist()
    assert ours.sequences[0] == tokens[:pos + 1]
    assert ref_new[:pos + 1] == ours.sequences[0] and set(ref_new[pos + 1:]) == {0}
    assert ours.stats[0].finish_reason == "eos" and ours.stats[0].blocks == 2
    assert ours.stats[0].tokens_per_forward == pytest.approx(float(theirs.tokens_per_forward[0]))


@pytest.mark.slow
def test_batch_rows_equal_solo_runs(tiny_dir):
    """Three prompts of different lengths: every row gets exactly the tokens it gets alone (sampling on)."""
    model = dg.load(tiny_dir)
    prompts = [[2, 5, 6], [2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [2, 20, 21, 22, 23, 24]]
    cfg = dg.GenerationConfig(max_new_tokens=20, max_denoising_steps=5, t_min=0.8, t_max=1.5, entropy_bound=0.5,
                              eos_token_ids=(1,))
    seeds = [11, 12, 13]
    batch = dg.generate(model, prompts, cfg, seed=seeds)
    for p, s, seq, stats in zip(prompts, seeds, batch.sequences, batch.stats):
        solo = dg.generate(model, [p], cfg, seed=s)
        assert solo.sequences[0] == seq
        assert solo.stats[0] == stats
    assert len({tuple(s) for s in batch.sequences}) == 3


@pytest.mark.parametrize("budget", [1, 7, 8, 13, 17])
def test_max_new_tokens_is_exact(tiny_dir, budget):
    """With eos off, every request returns exactly `max_new_tokens` tokens (the reference rounds up to canvases)."""
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=budget, max_denoising_steps=3, eos_token_ids=())
    out = dg.generate(model, [[2, 5, 6, 7], [2, 9]], cfg, seed=0)
    for seq, st in zip(out.sequences, out.stats):
        assert len(seq) == budget and st.finish_reason == "length"
        assert st.num_tokens == sum(t != 0 for t in seq)
        assert st.blocks == -(-budget // 8)


def test_fixed_steps_when_early_stop_disabled(tiny_dir):
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=4, stop_early=False, eos_token_ids=(47,), **{
        k: v for k, v in COLD.items() if k != "stability_threshold"})
    out = dg.generate(model, [[2, 5, 6, 7]], cfg, seed=0)
    assert out.stats[0].steps_per_block == [4, 4]
    early = dg.generate(model, [[2, 5, 6, 7]], cfg.replace(stop_early=True), seed=0)
    assert all(2 <= s <= 4 for s in early.stats[0].steps_per_block)


def test_on_block_streams_committed_tokens(tiny_dir):
    model = dg.load(tiny_dir)
    seen = []
    cfg = dg.GenerationConfig(max_new_tokens=20, max_denoising_steps=3, eos_token_ids=(47,))
    out = dg.generate(model, [[2, 5]], cfg, seed=4, on_block=lambda i, toks: seen.append((i, toks[0])))
    assert [i for i, _ in seen] == [0, 1, 2]
    assert sum((t for _, t in seen), []) == out.sequences[0]


@pytest.mark.parametrize("change,name", [
    (dict(entropy_bound=0.0), "entropy_bound"), (dict(entropy_bound=-1.0), "entropy_bound"),
    (dict(confidence_threshold=0.0), "confidence_threshold"), (dict(t_min=0.5, t_max=0.4), "t_max"),
    (dict(t_min=-0.1), "t_min"), (dict(max_denoising_steps=0), "max_denoising_steps"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(stability_threshold=-1), "stability_threshold"), (dict(t_max=float("nan")), "t_max"),
    (dict(stop_early="no"), "stop_early"), (dict(eos_token_ids="1"), "eos_token_id"),
])
def test_invalid_generation_config_names_the_parameter(change, name):
    with pytest.raises(ConfigError, match=name):
        dg.GenerationConfig(**change)


def test_temperature_zero_minimum_and_token_ids_checked(tiny_dir):
    """A schedule that is zero at every step (t_min == t_max == 0, legal) is greedy throughout, as one of a
    denormal temperature is (greedy below float32's smallest normal): same tokens, whatever the sampling seed's
    draws would have been; a non-zero schedule on the same seed differs from it here."""
    model = dg.load(tiny_dir)
    ok = dg.GenerationConfig(t_min=0.0, t_max=0.0, max_new_tokens=8, max_denoising_steps=3, eos_token_ids=())
    zero = dg.generate(model, [[2, 3]], ok, seed=0)
    assert len(zero.sequences[0]) == 8
    assert zero.sequences == dg.generate(model, [[2, 3]], ok.replace(t_min=1e-45, t_max=1e-45), seed=0).sequences
    assert zero.sequences != dg.generate(model, [[2, 3]], ok.replace(t_min=2.0, t_max=2.0), seed=0).sequences
    with pytest.raises(ConfigError, match="eos_token_id"):
        dg.generate(model, [[2, 3]], ok.replace(eos_token_ids=(48,)))
    with pytest.raises(ConfigError, match="pad_token_id"):
        dg.generate(model, [[2, 3]], ok.replace(pad_token_id=99))


@pytest.mark.parametrize("prompts,msg", [
    ([[]], r"prompts\[0\]: empty"), ([[2, 48]], r"prompts\[0\]: token ids"), ([[2, -1]], r"prompts\[0\]"),
    ([], "no prompt"), ([[2] * 131_072], "longer than the model's context"),
])
def test_bad_prompts_are_rejected(tiny_dir, prompts, msg):
    model = dg.load(tiny_dir)
    with pytest.raises(ConfigError, match=msg):
        dg.generate(model, prompts, dg.GenerationConfig(max_new_tokens=4))


def test_seed_validation(tiny_dir):
    model = dg.load(tiny_dir)
    with pytest.raises(ConfigError, match="seed"):
        dg.generate(model, [[2, 3], [2, 4]], dg.GenerationConfig(max_new_tokens=4), seed=[1])
    for bad in (-1, 2**64, 1.0, "3", True):
        with pytest.raises(ConfigError, match="seed"):
            dg.generate(model, [[2, 3]], dg.GenerationConfig(max_new_tokens=4), seed=bad)


def test_generation_config_json_with_nested_sampler_config(tmp_path):
    write_checkpoint(tmp_path, generation=dict(max_denoising_steps=12, t_min=0.1, t_max=0.9, stability_threshold=2,
                                               confidence_threshold=0.01, max_new_tokens=40, eos_token_id=[1, 50],
                                               sampler_config=G.EntropyBoundSamplerConfig(entropy_bound=0.3)))
    model = dg.load(tmp_path)
    assert model.generation_config == dg.GenerationConfig(
        max_new_tokens=40, max_denoising_steps=12, entropy_bound=0.3, t_min=0.1, t_max=0.9, stability_threshold=2,
        confidence_threshold=0.01, eos_token_ids=(1, 50))
    raw = json.loads((tmp_path / "generation_config.json").read_text())
    raw["sampler_config"]["entropy_bound"] = -0.5
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    with pytest.raises(dg.CheckpointError, match=r"generation_config.json: entropy_bound"):
        dg.load(tmp_path)


def test_pad_emitted_by_the_model_is_not_counted(tiny_dir):
    """transformers counts non-pad tokens for tokens per forward; a model emitting pad ids gets no credit for them."""
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=2, eos_token_ids=(47,))
    free = dg.generate(model, [[2, 9, 9]], cfg, seed=2)
    common = max(set(free.sequences[0]), key=free.sequences[0].count)  # declare a frequent token to be pad
    out = dg.generate(model, [[2, 9, 9]], cfg.replace(pad_token_id=common), seed=2)
    assert out.sequences == free.sequences
    assert out.stats[0].num_tokens == len(out.sequences[0]) - out.sequences[0].count(common) < len(out.sequences[0])


def test_eos_as_one_integer():
    assert dg.GenerationConfig(eos_token_ids=5).eos_token_ids == (5,)


def test_absent_generation_keys_take_reference_defaults(tiny_dir):
    """Our defaults are transformers' DiffusionGemma generation defaults (read from transformers, not repeated)."""
    ref = G.DiffusionGemmaGenerationConfig._get_default_generation_params()
    ours = dg.GenerationConfig()
    assert ours == dg.GenerationConfig.from_hf_dict({k: v for k, v in ref.items() if k != "sampler_config"})
    assert ours.entropy_bound == ref["sampler_config"].entropy_bound
    for key in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                "confidence_threshold"):
        assert getattr(ours, key) == ref[key], key
    assert dg.load(tiny_dir).generation_config == ours


def test_stop_hook_ends_rows_after_their_block(tiny_dir):
    """A request ended by the stop hook keeps the block that triggered it, gets finish "stop", is not denoised
    further; its batch mates get exactly the tokens of a run without the hook."""
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=24, max_denoising_steps=3, eos_token_ids=())
    prompts, seeds = [[2, 5, 6], [2, 7, 8, 9], [2, 11]], [3, 4, 5]
    free = dg.generate(model, prompts, cfg, seed=seeds)
    calls = []

    def stop(block, new_tokens):
        calls.append((block, [list(t) for t in new_tokens]))
        return [1] if block == 0 else [0] if block == 1 else []

    out = dg.generate(model, prompts, cfg, seed=seeds, stop=stop)
    assert [b for b, _ in calls] == [0, 1, 2]
    assert calls[1][1][1] == [] and calls[2][1][0] == [], "ended rows gain nothing afterwards"
    assert out.sequences[1] == free.sequences[1][:8] and out.stats[1].finish_reason == "stop"
    assert out.stats[1].steps_per_block == free.stats[1].steps_per_block[:1]
    assert out.stats[1].num_tokens == sum(t != 0 for t in out.sequences[1])
    assert out.sequences[0] == free.sequences[0][:16] and out.stats[0].finish_reason == "stop"
    assert out.sequences[2] == free.sequences[2] and out.stats[2] == free.stats[2]


def test_stop_hook_wins_in_its_block_ignores_earlier_finished_requests_and_checks_indices(tiny_dir):
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=2, eos_token_ids=())
    prompts = [[2, 5], [2, 9, 9]]
    free = dg.generate(model, prompts, cfg, seed=1)
    eos = next(t for t in free.sequences[1][:8] if t not in free.sequences[0])  # row 1's first block only
    with_eos = cfg.replace(eos_token_ids=(eos,))
    base = dg.generate(model, prompts, with_eos, seed=1)
    assert base.stats[1].finish_reason == "eos" and base.stats[1].blocks == 1
    assert base.stats[0].finish_reason == "length" and base.stats[0].blocks == 2
    # the hook names row 1 again after its eos: ignored; it names row 0 in the block that also hits the budget: "stop"
    out = dg.generate(model, prompts, with_eos, seed=1, stop=lambda block, toks: [0, 1] if block == 1 else [])
    assert out.stats[1] == base.stats[1] and out.sequences == base.sequences
    assert out.stats[0].finish_reason == "stop" and out.stats[0].steps_per_block == base.stats[0].steps_per_block
    for bad in (True, 1.0, -1):
        with pytest.raises(ValueError, match="stop: returned request index"):
            dg.generate(model, [[2, 5]], cfg, seed=1, stop=lambda block, toks, bad=bad: [bad])
    with pytest.raises(ValueError, match="stop: returned request index 3"):
        dg.generate(model, [[2, 5]], cfg, seed=1, stop=lambda block, toks: [3])


class Events(dg.Observer):
    """Records the order of steps, block ends and on_block calls."""

    def __init__(self):
        self.log = []

    def on_step(self, seconds):
        self.log.append("step")

    def on_unit(self, name, seconds):
        self.log.append(name.split("[")[0])

    def on_block_end(self, block):
        self.log.append(f"end{block}")


def test_observer_sees_every_step_and_on_block_runs_before_the_next_blocks_steps(tiny_dir):
    model = dg.load(tiny_dir)
    cfg = dg.GenerationConfig(max_new_tokens=24, max_denoising_steps=3, eos_token_ids=())
    events = Events()
    out = dg.generate(model, [[2, 5, 6], [2, 9]], cfg, seed=2, observer=events,
                      on_block=lambda block, toks: events.log.append(f"text{block}"))
    per_block = [max(st.steps_per_block[b] for st in out.stats) for b in range(3)]
    assert events.log == sum((["step"] * n + [f"end{b}", f"text{b}"] for b, n in enumerate(per_block)), [])
