"""Images in: the vision encoder's loading and its features against transformers' `get_image_features`, prompts with
images against transformers' DiffusionGemma encoder (prompt logits, encoder hidden states, denoise logits), and the
errors of bad image inputs."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from helpers import hf_cache, hf_model, softcap, write_checkpoint
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicCache

import dgemma_compile as dg
from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.images import Image, encode_prompts, pieces, prepare
from dgemma_compile.model.loader import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

IMG, BOI, EOI = 60, 61, 62
TOL = 1e-4  # the text path's parity bound (tests/model/test_model_parity.py)


def multimodal(**kw):
    kw.setdefault("use_bidirectional_attention", "vision")
    return hf_model(image_ids=(IMG, BOI, EOI), **kw)


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """(transformers reference, its checkpoint directory): a window of 4, a canvas of 8, image groups on."""
    ref = multimodal()
    return ref, write_checkpoint(tmp_path_factory.mktemp("mm"), ref)


def image(side: int, seed: int, pad: int = 0) -> Image:
    """A side x side grid of random patches (side^2 / 9 soft tokens), `pad` padding patches after it."""
    g = torch.Generator().manual_seed(seed)
    P = side * side
    pos = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(P, 2)
    pv = torch.rand(P + pad, 768, generator=g)
    return Image(pv, torch.cat([pos, torch.full((pad, 2), -1)]))


def placeholders(n: int) -> list[int]:
    return [BOI] + [IMG] * n + [EOI]


def reference(ref, prompt: list[int], imgs: list[Image], canvas: torch.Tensor, groups: bool = True):
    """transformers, as its generate runs a prompt: the encoder over the whole prompt under the masks of
    `create_masks_for_generate(..., mm_token_type_ids)`, the image features scattered in; then a denoise step.
    Returns (encoder hidden states [T, D], prompt logits [T, V], denoise logits [C, V])."""
    ids = torch.tensor([prompt])
    cache = DynamicCache(config=ref.config.text_config)
    pos = torch.arange(ids.shape[1])[None]
    masks = ref.model.encoder.create_masks_for_generate(
        config=ref.config, inputs_embeds=torch.empty(1, ids.shape[1], 0), **hf_cache(cache), position_ids=pos,
        attention_mask=torch.ones_like(ids, dtype=torch.bool), mm_token_type_ids=(ids == IMG).long() if groups else None)
    kw = {}
    if imgs:
        P = max(im.pixel_values.shape[0] for im in imgs)
        pv, pp = torch.zeros(len(imgs), P, 768), torch.full((len(imgs), P, 2), -1)
        for k, im in enumerate(imgs):
            pv[k, :im.pixel_values.shape[0]], pp[k, :im.position_ids.shape[0]] = im.pixel_values, im.position_ids
        kw = dict(pixel_values=pv, image_position_ids=pp)
    with torch.no_grad():
        enc = ref.model.encoder(input_ids=ids, attention_mask=masks, **hf_cache(cache), position_ids=pos, **kw)
        hidden = enc.last_hidden_state[0]
        den = ref(decoder_input_ids=canvas[None], **hf_cache(cache)).logits[0]
    return hidden, softcap(ref, ref.lm_head(hidden)), den


# --- loading ---------------------------------------------------------------------------------------------------------


def test_vision_encoder_loads_and_matches_get_image_features(mm):
    ref, ckpt = mm
    model = dg.load(ckpt)
    assert model.vision is not None and model.vision.config.image_token_id == IMG
    assert model.vision.config.bidirectional_groups
    for im in (image(6, 1), image(9, 2, pad=18)):
        with torch.no_grad():
            want = ref.model.encoder.get_image_features(im.pixel_values[None], im.position_ids[None]).pooler_output
        got = model.vision.features(im.pixel_values, im.position_ids)
        assert got.shape == want.shape and torch.equal(got, want)


def test_vision_is_optional_and_text_logits_do_not_change(mm, caplog):
    ref, ckpt = mm
    with caplog.at_level(logging.INFO, logger="dgemma_compile"):
        text_only = dg.load(ckpt, vision=False, attention="dense")
    assert text_only.vision is None and any("vision=False" in r.getMessage() for r in caplog.records)
    full = dg.load(ckpt, vision=True, attention="dense")
    ids = torch.tensor([[2, 5, 9, 11, 3]])
    outs = []
    for model in (text_only, full):
        cache = model.new_cache(1, 16)
        outs.append((model.logits(dg.encode(model, ids, cache)), dg.denoise(model, torch.arange(8)[None] + 3, cache)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    with pytest.raises(CheckpointError, match="vision: must be None, True or False"):
        dg.load(ckpt, vision="yes")


def test_image_ids_outside_the_vocabulary_load_text_only(tmp_path, caplog):
    ckpt = write_checkpoint(tmp_path / "ck", hf_model())  # transformers' default ids, beyond a vocabulary of 64
    with caplog.at_level(logging.INFO, logger="dgemma_compile"):
        assert dg.load(ckpt).vision is None
    assert any("image_token_id 258880 is outside the vocabulary" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match=r"config.json: vision=True, but the checkpoint cannot take images: "
                                              r"image_token_id 258880 is outside the vocabulary \[0, 64\)"):
        dg.load(ckpt, vision=True)


@pytest.mark.parametrize("case, pattern", [
    ("missing", r"tensor model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight is missing"),
    ("shape", r"model.safetensors: tensor model.encoder.embed_vision.embedding_projection.weight has shape \[32, 15\], "
              r"expected \[32, 16\]"),
    ("dtype", r"model.safetensors: tensor model.encoder.vision_tower.patch_embedder.input_proj.weight has dtype I8"),
    ("unexpected", r"unexpected tensor model.encoder.vision_tower.extra.weight \(not part of DiffusionGemma's text "
                   r"model or vision encoder\)"),
    ("tower_type", r"config.json: vision_config: only a gemma4_vision tower is supported, got 'siglip_vision_model'"),
])
def test_bad_vision_checkpoints_name_file_and_tensor(tmp_path, mm, case, pattern):
    d = tmp_path / "ck"
    shutil.copytree(mm[1], d)
    path = d / "model.safetensors"
    state = load_file(path)
    if case == "missing":
        state.pop("model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight")
    elif case == "shape":
        state["model.encoder.embed_vision.embedding_projection.weight"] = torch.zeros(32, 15)
    elif case == "dtype":
        state["model.encoder.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(16, 768, dtype=torch.int8)
    elif case == "unexpected":
        state["model.encoder.vision_tower.extra.weight"] = torch.zeros(3)
    else:
        cfg = json.loads((d / "config.json").read_text())
        cfg["vision_config"]["model_type"] = "siglip_vision_model"
        (d / "config.json").write_text(json.dumps(cfg))
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=pattern):
        dg.load(d)


# --- prompts with images ---------------------------------------------------------------------------------------------


def test_pieces_keep_every_group_whole():
    runs = [(3, 4), (9, 20)]  # 20 > the chunk of 8
    assert pieces(29, runs, 8) == [(0, 3, None), (3, 7, 0), (7, 8, None), (8, 9, None), (9, 29, 1)]
    assert pieces(12, [(0, 12)], 4) == [(0, 12, 0)]
    # text after the last image up to the next multiple of the chunk (ImagePrompt.prefix), cut where text prompts are
    assert pieces(32, runs, 8) == [(0, 3, None), (3, 7, 0), (7, 8, None), (8, 9, None), (9, 29, 1), (29, 32, None)]
    assert pieces(20, [(1, 2)], 8) == [(0, 1, None), (1, 3, 0), (3, 8, None), (8, 16, None), (16, 20, None)]


def test_bad_image_inputs_name_the_thing(mm):
    model = dg.load(mm[1])
    good = [2, 5] + placeholders(4) + [9]
    cases = [
        ([good], None, r"prompts\[0\]: holds image placeholders \(id 60\) but no images were given"),
        ([good], [[image(6, 0)], []], r"images: give one list of images \(or None\) per prompt \(1\), got 2"),
        ([good], [[image(6, 0), image(6, 1)]], r"prompts\[0\]: 1 image placeholder runs \(id 60\) but 2 images"),
        ([good], [[image(9, 0)]], r"images\[0\]\[0\]: 9 soft tokens, but its placeholder run in prompts\[0\] holds 4"),
        ([[2, 5, BOI] + [IMG] * 4], [[image(6, 0)]], r"prompts\[0\]: ends with an image"),
        ([good], [[Image(torch.rand(36, 700), image(6, 0).position_ids)]],
         r"images\[0\]\[0\]: pixel_values: must be a float tensor \[patches, 768\], got torch.float32 \[36, 700\]"),
        ([good], [[Image(torch.rand(36, 768), torch.zeros(36, 3, dtype=torch.long))]],
         r"images\[0\]\[0\]: position_ids: must be an integer tensor \[36, 2\]"),
        ([good], [["not an image"]], r"images\[0\]\[0\]: must be a dgemma_compile.inputs.images.Image, got str"),
        ([[2] + placeholders(1121) + [3]], [[image(6, 0)]], r"prompts\[0\]: an image of 1121 soft tokens, more than the "
                                                            r"1120 served"),
    ]
    for prompts, images, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            prepare(model, prompts, images)
    text_only = dg.load(mm[1], vision=False)
    with pytest.raises(ConfigError, match="images: this model has no vision encoder"):
        prepare(text_only, [good], [[image(6, 0)]])


def _parity(ref, model, prompts, imgs, canvases):
    """Ours (one batch: image prefixes, then the text) against transformers row by row."""
    items = prepare(model, prompts, imgs)
    cache = model.new_cache(len(prompts), 96)
    hidden = encode_prompts(model, cache, prompts, items)
    den = dg.denoise(model, torch.stack(canvases), cache)
    for r, p in enumerate(prompts):
        want_h, want_logits, want_den = reference(ref, p, imgs[r] or [], canvases[r])
        assert hidden[r].shape == want_h.shape
        assert (hidden[r] - want_h).abs().max() < TOL, r
        assert (model.logits(hidden[r]) - want_logits).abs().max() < TOL, r
        assert (den[r] - want_den).abs().max() < TOL, r


@pytest.mark.parametrize("attention", [pytest.param("flex", marks=pytest.mark.slow), "dense"])
def test_prompts_with_images_match_transformers(mm, attention):
    """One image at the start, two mid-prompt (one of 9 soft tokens: wider than the canvas of 8 and the window of 4),
    and a text prompt, in one batch."""
    ref, ckpt = mm
    model = dg.load(ckpt, attention=attention)
    g = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(3, 60, (n,), generator=g).tolist()  # noqa: E731
    prompts = [[2] + placeholders(4) + text(5),
               [2] + text(6) + placeholders(4) + text(3) + placeholders(9) + text(4),
               [2] + text(11)]
    imgs = [[image(6, 1)], [image(6, 2), image(9, 3, pad=9)], None]
    canvases = [torch.randint(0, 64, (8,), generator=g) for _ in prompts]
    _parity(ref, model, prompts, imgs, canvases)


@pytest.mark.slow
@pytest.mark.parametrize("layers, bidirectional", [
    (("full_attention",), "vision"),  # the overlay on full-attention layers too: transformers' DiffusionGemma
    (("sliding_attention", "sliding_attention", "full_attention"), "vision"),
    (("sliding_attention", "full_attention"), None),  # no overlay: image tokens plain causal
])
def test_image_groups_per_layer_type_match_transformers(tmp_path, layers, bidirectional):
    ref = multimodal(layer_types=layers, use_bidirectional_attention=bidirectional, seed=5)
    model = dg.load(write_checkpoint(tmp_path / "ck", ref))
    assert model.vision.config.bidirectional_groups == (bidirectional == "vision")
    g = torch.Generator().manual_seed(4)
    prompts = [[2, 7, 8] + placeholders(9) + [12, 13], [2] + placeholders(4) + [5, 6] + placeholders(4) + [9]]
    imgs = [[image(9, 5)], [image(6, 6), image(6, 7)]]
    canvases = [torch.randint(0, 64, (8,), generator=g) for _ in prompts]
    _parity(ref, model, prompts, imgs, canvases)
