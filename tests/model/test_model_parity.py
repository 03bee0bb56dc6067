"""Encoder and denoiser logits against transformers' DiffusionGemmaForBlockDiffusion (float32, CPU)."""

import pytest
import torch
from helpers import hf_cache, hf_model, softcap, write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache

import dgemma_compile as dg

TOL = 1e-4

LAYER_PATTERNS = [
    ("sliding_attention", "full_attention"),
    ("sliding_attention", "sliding_attention", "full_attention"),
    ("full_attention", "sliding_attention", "full_attention"),
    ("full_attention",),
]


@st.composite
def configs(draw):
    kv = draw(st.sampled_from([1, 2, 4]))  # GQA ratios 4, 2, 1 with 4 query heads
    return dict(
        layer_types=draw(st.sampled_from(LAYER_PATTERNS)),
        num_attention_heads=4,
        num_key_value_heads=kv,
        num_global_key_value_heads=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([8, 16])),
        global_head_dim=draw(st.sampled_from([16, 32])),
        sliding_window=draw(st.integers(2, 12)),
        num_experts=draw(st.sampled_from([4, 6])),
        top_k_experts=draw(st.integers(1, 3)),
        canvas_length=draw(st.sampled_from([4, 8])),
        seed=draw(st.integers(0, 10_000)),
    )


def reference_run(ref, prompt, canvases, sc_temps):
    """transformers: encode prompt, then per block: denoise (with and without self-conditioning), commit."""
    cache = DynamicCache(config=ref.config.text_config)
    enc = ref.model.encoder(input_ids=prompt, **hf_cache(cache)).last_hidden_state
    enc_logits = softcap(ref, ref.lm_head(enc))
    outs = []
    for canvas, temp in zip(canvases, sc_temps):
        first = ref(decoder_input_ids=canvas, **hf_cache(cache)).logits
        second = ref(decoder_input_ids=canvas, **hf_cache(cache), self_conditioning_logits=first / temp).logits
        outs.append((first, second))
        ref.model.encoder(input_ids=canvas, **hf_cache(cache))
    return enc_logits, outs


@pytest.mark.slow
@settings(max_examples=16)
@given(cfg=configs(), prompt_lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), blocks=st.integers(1, 3),
       attention=st.sampled_from(["flex", "dense"]))
def test_logits_match_transformers(tmp_path_factory, cfg, prompt_lens, blocks, attention):
    """Prompts shorter and longer than the window, several committed blocks, B > 1 with different lengths, through
    FlexAttention (the model's path) and the dense-mask reference."""
    ref = hf_model(**cfg)
    model = dg.load(write_checkpoint(tmp_path_factory.mktemp("ck"), ref), attention=attention)
    C, V = cfg["canvas_length"], 64
    g = torch.Generator().manual_seed(cfg["seed"])
    B, T = len(prompt_lens), max(prompt_lens)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in prompt_lens]
    canvases = [torch.randint(0, V, (B, C), generator=g) for _ in range(blocks)]
    temps = [0.4 + 0.1 * k for k in range(blocks)]

    cache = model.new_cache(B, T + blocks * C)
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    enc_logits = model.logits(dg.encode(model, ids, cache, torch.tensor(prompt_lens)))
    ours = []
    for canvas, temp in zip(canvases, temps):
        first = dg.denoise(model, canvas, cache)
        second = dg.denoise(model, canvas, cache, first / temp)
        ours.append((first, second))
        dg.encode(model, canvas, cache)

    for b, p in enumerate(prompts):
        ref_enc, ref_outs = reference_run(ref, p[None], [c[b:b + 1] for c in canvases], temps)
        torch.testing.assert_close(enc_logits[b, :len(p)], ref_enc[0], atol=TOL, rtol=0)
        for (f, s), (rf, rs) in zip(ours, ref_outs):
            torch.testing.assert_close(f[b], rf[0], atol=TOL, rtol=0)
            torch.testing.assert_close(s[b], rs[0], atol=TOL, rtol=0)


@pytest.mark.slow
def test_long_prompt_is_chunked_like_one_pass(tiny_dir):
    """A prompt longer than the cache block is encoded in chunks; outputs match a single big-block pass."""
    model = dg.load(tiny_dir)
    ids = torch.randint(0, 48, (2, 29), generator=torch.Generator().manual_seed(1))
    small = model.new_cache(2, 40, block_size=8)
    big = model.new_cache(2, 40, block_size=32)
    torch.testing.assert_close(dg.encode(model, ids, small), dg.encode(model, ids, big), atol=1e-5, rtol=0)
    canvas = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(dg.denoise(model, canvas, small), dg.denoise(model, canvas, big), atol=1e-5, rtol=0)


def test_denoise_never_commits(tiny_dir):
    model = dg.load(tiny_dir)
    cache = model.new_cache(1, 32)
    dg.encode(model, torch.tensor([[2, 5, 6, 7]]), cache)
    committed = [k[:, :, :32].clone() for k in cache.keys]
    dg.denoise(model, torch.randint(0, 48, (1, 8)), cache)
    assert cache.lengths.tolist() == [4]
    for before, after in zip(committed, cache.keys):
        assert torch.equal(before, after[:, :, :32])


def test_encode_rejects_overflow_without_writing(tiny_dir):
    model = dg.load(tiny_dir)
    cache = model.new_cache(2, 10)
    dg.encode(model, torch.tensor([[2, 5, 6], [2, 7, 8]]), cache)
    snapshot = [k.clone() for k in cache.keys]
    try:
        dg.encode(model, torch.zeros(2, 9, dtype=torch.long), cache, torch.tensor([1, 9]))
    except dg.CacheFullError as e:
        assert "rows [1]" in str(e) and "max_seq_len=10" in str(e)
    else:
        raise AssertionError("expected CacheFullError")
    assert cache.lengths.tolist() == [3, 3]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, cache.keys))


def test_bad_inputs_name_the_argument_and_write_nothing(tiny_dir):
    import pytest

    model = dg.load(tiny_dir)
    cache = model.new_cache(2, 16)
    dg.encode(model, torch.tensor([[2, 5], [2, 6]]), cache)
    before = [k.clone() for k in cache.keys], cache.lengths.clone()
    ids = torch.tensor([[2, 5, 6], [2, 7, 8]])
    for bad in (torch.tensor([2.7, 1.0]), torch.tensor([True, True]), [3, 3], torch.tensor([4, 1]), torch.tensor([1])):
        with pytest.raises(ValueError, match="input_lengths"):
            dg.encode(model, ids, cache, bad)
    with pytest.raises(ValueError, match="cache: made for another model"):
        dg.encode(model, ids, dg.load(tiny_dir, dtype=torch.bfloat16).new_cache(2, 16))
    with pytest.raises(ValueError, match="self_conditioning_logits"):
        dg.denoise(model, torch.zeros(2, 8, dtype=torch.long), cache, torch.zeros(2, 8, 48, dtype=torch.long))
    with pytest.raises(ValueError, match="canvas has batch 1"):
        dg.denoise(model, torch.zeros(1, 8, dtype=torch.long), cache)
    assert torch.equal(cache.lengths, before[1]) and all(torch.equal(a, b) for a, b in zip(before[0], cache.keys))
