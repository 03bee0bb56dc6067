"""The built-in demo model: loads, matches transformers, generates reproducibly, compiles to the same tokens."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

import dgemma_compile as dg
from helpers import hf_cache, softcap
from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.demo import tasks


def heldout(n):
    return [prompt for _, prompt, _ in tasks.make_split("heldout", n, seed=0)]


@pytest.mark.slow  # fast-tier budget; the tiny-model parity tests stay fast
def test_demo_logits_equal_transformers(demo):
    from transformers import DiffusionGemmaForBlockDiffusion

    model, tok = demo
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(DEMO_MODEL)).eval()
    C, V = model.config.canvas_length, model.config.vocab_size
    for prompt in heldout(4):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        canvas = torch.randint(0, V, (1, C), generator=torch.Generator().manual_seed(len(prompt)))
        cache_ref = DynamicCache(config=ref.config.text_config)
        with torch.no_grad():
            h_ref = ref.model.encoder(input_ids=ids, **hf_cache(cache_ref)).last_hidden_state
            d_ref = ref(decoder_input_ids=canvas, **hf_cache(cache_ref)).logits
        cache = model.new_cache(1, 128)
        h = dg.encode(model, ids, cache)
        torch.testing.assert_close(model.logits(h), softcap(ref, ref.lm_head(h_ref)), atol=1e-4, rtol=0)
        torch.testing.assert_close(dg.denoise(model, canvas, cache), d_ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_demo_generation_is_reproducible(demo):
    model, tok = demo
    prompts = [tok(p)["input_ids"] for p in heldout(3)]
    a = dg.generate(model, prompts, seed=7)
    b = dg.generate(model, prompts, seed=7)
    assert a.sequences == b.sequences and a.stats == b.stats
    assert all(s.finish_reason == "eos" for s in a.stats), "the demo model ends its answers"


@pytest.mark.slow
def test_demo_compiled_tokens_equal_eager(demo, demo_gen):
    model, tok = demo
    prompts = [tok(p)["input_ids"] for p in heldout(4)[1:3]]  # one bucket of 2: each bucket costs a compile
    eager = dg.generate(model, prompts, seed=[1, 2], moe_impl=demo_gen.moe_impl)
    compiled = demo_gen.generate(prompts, seed=[1, 2])
    assert compiled.sequences == eager.sequences and compiled.stats == eager.stats


@pytest.mark.slow
@pytest.mark.parametrize("T", [0.0, 1e-45, 1e-38, 1e-30, 1e-6])
def test_demo_answers_at_tiny_and_zero_temperature(demo, demo_gen, T):
    """A constant temperature T (t_min == t_max): below float32's smallest normal it is greedy by definition, just
    above it the scaled logits are huge but finite; every answer is right, eager and compiled alike."""
    model, tok = demo
    examples = tasks.make_split("heldout", 4, seed=0)
    prompts = [tok(p)["input_ids"] for _, p, _ in examples]
    cfg = model.generation_config.replace(t_min=T, t_max=T)
    eager = dg.generate(model, prompts, cfg, seed=5, moe_impl=demo_gen.moe_impl)
    compiled = demo_gen.generate(prompts, cfg, seed=5)
    assert compiled.sequences == eager.sequences and compiled.stats == eager.stats
    answers = [tok.decode(seq, skip_special_tokens=True) for seq in eager.sequences]
    assert all(tasks.check(p, a) for (_, p, _), a in zip(examples, answers)), answers
    assert all(st.finish_reason == "eos" for st in eager.stats)


@pytest.mark.slow  # fast-tier budget
def test_with_temperature_scales_the_schedule_and_zero_is_greedy(demo):
    model, tok = demo
    cfg = model.generation_config
    assert cfg.with_temperature(1.0) == cfg
    assert (cfg.with_temperature(0.5).t_min, cfg.with_temperature(0.5).t_max) == (cfg.t_min * 0.5, cfg.t_max * 0.5)
    prompts = [tok(p)["input_ids"] for p in heldout(2)]
    greedy = dg.generate(model, prompts, cfg.with_temperature(0.0), seed=1)
    # the old failure: t_min = 0, t_max = 1e-40 used to overflow and return all pad tokens
    tiny = dg.generate(model, prompts, cfg.replace(t_min=0.0, t_max=1e-40), seed=1)
    assert tiny.sequences == greedy.sequences and all(st.finish_reason == "eos" for st in tiny.stats)
    for bad in (-1.0, float("nan"), float("inf"), True, 1e300):
        with pytest.raises(dg.ConfigError, match="temperature"):
            cfg.with_temperature(bad)


@pytest.mark.slow
def test_demo_answers_held_out_prompts(demo):
    """The first held-out prompts of every task, in one batch: the end-to-end accuracy signal. The shipped checkpoint
    answers all 500 held-out test prompts (README), so any broken layer, mask or sampler shows up here."""
    model, tok = demo
    examples = tasks.make_split("heldout", 12, seed=0)
    out = dg.generate(model, [tok(p)["input_ids"] for _, p, _ in examples], seed=0)
    answers = [tok.decode(seq, skip_special_tokens=True) for seq in out.sequences]
    wrong = [(p, a) for (_, p, _), a in zip(examples, answers) if not tasks.check(p, a)]
    assert not wrong, wrong
    assert {t for t, _, _ in examples} == set(tasks.TASKS)


def test_demo_adds_numbers_at_the_edges_of_the_format(demo):
    """Sums at the edges of the fixed-width format: results below 10 and 100 (rare in the uniform draw, and wrong before
    the sum became fixed-width, tasks.py), zero, the largest sum, carries into the fourth digit."""
    model, tok = demo
    prompts = ["add 000+000=", "add 005+007=", "add 041+038=", "add 999+999=", "add 500+500=", "add 009+991="]
    out = dg.generate(model, [tok(p)["input_ids"] for p in prompts], seed=0)
    answers = [tok.decode(seq, skip_special_tokens=True) for seq in out.sequences]
    assert answers == ["0000", "0012", "0079", "1998", "1000", "1000"]
    assert all(tasks.check(p, a) for p, a in zip(prompts, answers))
