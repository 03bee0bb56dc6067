"""Generations with images: the eager generator against transformers' generate, and the compiled generator against
the eager one (token for token; no recompile when a request with images follows one without)."""

from __future__ import annotations

import pytest
import torch
from helpers import write_checkpoint
from test_generate import COLD, transformers_generate
from test_images import IMG, image, multimodal, placeholders

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, build

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")


def pixel_inputs(imgs):
    """transformers' generate inputs for one prompt's images (padded to one patch count)."""
    P = max(im.pixel_values.shape[0] for im in imgs)
    pv, pp = torch.zeros(len(imgs), P, 768), torch.full((len(imgs), P, 2), -1)
    for k, im in enumerate(imgs):
        pv[k, :im.pixel_values.shape[0]], pp[k, :im.position_ids.shape[0]] = im.pixel_values, im.position_ids
    return dict(pixel_values=pv, image_position_ids=pp)


@pytest.mark.slow
def test_generation_with_images_matches_transformers(tmp_path):
    """An image prompt (two images, one of 9 soft tokens: wider than the canvas of 8) batched with a text prompt;
    transformers runs each alone (its generate takes no right-padded batch)."""
    ref = multimodal(seed=2, sliding_window=5)
    model = dg.load(write_checkpoint(tmp_path, ref), attention="dense")
    prompts = [[2, 9, 13] + placeholders(9) + [4, 7] + placeholders(4) + [30, 11], [2, 40, 41, 3, 3, 8, 1]]
    imgs = [[image(9, 1), image(6, 2)], None]
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=6, eos_token_ids=(59,), **COLD)
    ours = dg.generate(model, prompts, cfg, seed=4, images=imgs)
    for b, p in enumerate(prompts):
        ids = torch.tensor([p])
        mm = dict(pixel_inputs(imgs[b]), mm_token_type_ids=(ids == IMG).long()) if imgs[b] else {}
        theirs = transformers_generate(ref, [p], 4, 8, 64, max_new_tokens=16, steps=6, eos=59, **mm)
        ref_new = theirs.sequences[0, len(p):].tolist()
        n = len(ours.sequences[b])
        assert n > 0 and ours.sequences[b] == ref_new[:n] and set(ref_new[n:]) <= {0}, b
    # the image prompt's tokens depend on its images: without the group overlay / with other pixels they differ
    other = dg.generate(model, prompts[:1], cfg, seed=4, images=[[image(9, 7), image(6, 8)]])
    assert other.sequences[0] != ours.sequences[0]


@pytest.mark.slow
def test_compiled_generator_with_images_equals_eager_without_recompiling(tmp_path):
    ref = multimodal(seed=1)
    model = dg.load(write_checkpoint(tmp_path, ref))
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=128))
    cfg = dg.GenerationConfig(max_new_tokens=20, max_denoising_steps=8)
    text = [2, 9, 10, 11]
    first = gen.generate([text], cfg, seed=1)  # compiles the step of batch 2
    prompts = [[2] + placeholders(4) + [5, 6, 7], text, [2, 3] + placeholders(9) + [8] + placeholders(4) + [13]]
    imgs = [[image(6, 1)], None, [image(9, 2), image(6, 3)]]
    out = gen.generate(prompts, cfg, seed=[1, 1, 2], images=imgs)  # 3 requests over 2 rows: a row is reused
    assert dict(gen.ready) == {"step[B2_P1_stop]": 1}
    eager = dg.generate(model, prompts, cfg, seed=[1, 1, 2], images=imgs, moe_impl=gen.moe_impl, max_seq_len=128)
    assert out.sequences == eager.sequences
    assert out.sequences[1] == first.sequences[0]  # the text request's tokens, whatever its batch mates
