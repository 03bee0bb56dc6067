"""Images from files to prompts: transformers' PIL image processor (`preprocess.py`), the placeholders of raw and
chat prompts (`text.ImageSlots`: boi + N image tokens + eoi, exactly one BOS), and `dgemma generate --image`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import hf_model, image_token_ids, write_checkpoint

import dgemma_compile as dg
from dgemma_compile import cli
from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.images import image_runs, prepare
from dgemma_compile.inputs.preprocess import num_soft_tokens, preprocess, read_image
from dgemma_compile.inputs.text import ImageSlots, encode_chat, encode_prompt, user_messages

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
PIL = pytest.importorskip("PIL.Image")
IMG, BOI, EOI = image_token_ids()


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    ref = hf_model(image_ids=(IMG, BOI, EOI), use_bidirectional_attention="vision")
    d = write_checkpoint(tmp_path_factory.mktemp("mmtok"), ref, image_tokenizer=True)
    return d, dg.load(d, attention="dense"), dg.load_tokenizer(d)


def png(path, w, h, seed=0):
    rng = np.random.default_rng(seed)
    PIL.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path


def test_preprocess_is_the_processors_and_counts_soft_tokens(ck, tmp_path):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    _, model, _ = ck
    pil = read_image(png(tmp_path / "a.png", 150, 100))
    (im,) = preprocess(model, [pil], max_soft_tokens=70)
    want = Gemma4ImageProcessorPil(max_soft_tokens=70)(images=[pil], return_tensors="pt")
    assert torch.equal(im.pixel_values, want["pixel_values"][0])
    assert torch.equal(im.position_ids, want["image_position_ids"][0])
    n = num_soft_tokens(model, im)
    assert n == int(want["num_soft_tokens_per_image"][0]) and model.vision.features(im.pixel_values,
                                                                                    im.position_ids).shape[0] == n
    with pytest.raises(ConfigError, match=r"max_soft_tokens: must be one of \(70, 140, 280, 560, 1120\), got 100"):
        preprocess(model, [pil], max_soft_tokens=100)


def test_read_image_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"image: .*nope.png: file not found"):
        read_image(tmp_path / "nope.png")
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ConfigError, match=r"image: .*text.png: not an image pillow can read"):
        read_image(tmp_path / "text.png")
    data = png(tmp_path / "full.png", 64, 64).read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"image: .*cut.png: could not decode"):
        read_image(tmp_path / "cut.png")
    with pytest.raises(ConfigError, match=r"bytes, more than the 10 allowed"):
        read_image(tmp_path / "full.png", max_bytes=10)


def test_placeholders_expand_with_one_bos(ck):
    _, model, tok = ck
    slots = ImageSlots.for_model(tok, model, [3, 2])
    raw = encode_prompt(tok, "what is it", bos_token_id=2, images=slots)  # no placeholder: one per image, first
    assert raw[:11] == [2, BOI, IMG, IMG, IMG, EOI, BOI, IMG, IMG, EOI, tok.convert_tokens_to_ids("w")]
    assert raw.count(2) == 1 and image_runs(raw, IMG) == [(2, 3), (7, 2)]
    mid = encode_prompt(tok, "a<|image|>b<|image|>c", bos_token_id=2, images=slots)
    assert image_runs(mid, IMG) == [(3, 3), (9, 2)] and mid.count(2) == 1
    messages = user_messages("x", None)
    messages[-1] = {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "hi"}]}
    chat = encode_chat(tok, messages, bos_token_id=2, images=slots)  # the template renders {{ bos_token }}: not doubled
    assert chat[0] == 2 and chat.count(2) == 1 and image_runs(chat, IMG) == [(2, 3), (7, 2)]
    with pytest.raises(ConfigError, match=r"prompt: 1 image placeholders \(<\|image\|>\) but 2 images"):
        encode_prompt(tok, "a<|image|>b", bos_token_id=2, images=slots)
    with pytest.raises(ConfigError, match=r"chat template: 1 image placeholders"):
        messages[-1]["content"] = messages[-1]["content"][1:]
        encode_chat(tok, messages, bos_token_id=2, images=slots)
    # the generators refuse placeholders without their images
    with pytest.raises(ConfigError, match=r"prompts\[0\]: holds image placeholders \(id 46\) but no images"):
        prepare(model, [raw], None)


@pytest.mark.slow  # CLI runs (tests/cli/test_cli.py's tier)
def test_generate_with_image_flag(ck, tmp_path, capsys):
    d, _, _ = ck
    a, b = png(tmp_path / "a.png", 96, 96, 1), png(tmp_path / "b.png", 48, 96, 2)
    args = ["generate", "--model", str(d), "--eager", "--max-new-tokens", "8", "--max-denoising-steps", "2",
            "--max-soft-tokens", "70", "--image", str(a), "--image", str(b), "--chat", "what"]
    assert cli.main(args) == 0
    first = capsys.readouterr()
    assert "tokens=8" in first.err
    assert cli.main(args) == 0 and capsys.readouterr().out == first.out  # deterministic
    assert cli.main(args[:-2] + ["x<|image|>"]) == 2  # raw prompt with one placeholder, two images
    assert "prompt: 1 image placeholders" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(d), "--eager", "--image", str(tmp_path / "none.png"), "x"]) == 2
    assert "none.png: file not found" in capsys.readouterr().err


@pytest.mark.parametrize("processor_file", ["preprocessor_config.json", "processor_config.json"])
def test_preprocess_honours_the_saved_processor_settings(ck, tmp_path, processor_file):
    """Non-default resample, rescale, normalisation and budget saved with the checkpoint: the pixels equal those of
    transformers' AutoImageProcessor loading the same directory (before, only max_soft_tokens was read: up to 1.0
    apart with mean / std 0.5)."""
    import json
    import shutil

    from transformers import AutoImageProcessor

    d, model, _ = ck
    tower = model.vision.hf_config
    saved = {"image_processor_type": "Gemma4ImageProcessorPil", "resample": 2, "do_normalize": True,
             "image_mean": [0.5, 0.4, 0.3], "image_std": [0.5, 0.6, 0.7], "rescale_factor": 1 / 127.5,
             "max_soft_tokens": 140, "patch_size": tower.patch_size, "pooling_kernel_size": tower.pooling_kernel_size}
    ck2 = tmp_path / "ck"
    shutil.copytree(d, ck2)
    body = {"image_processor": saved, "processor_class": "Gemma4Processor"} if processor_file == "processor_config.json" \
        else saved
    (ck2 / processor_file).write_text(json.dumps(body))
    pil = read_image(png(tmp_path / "a.png", 150, 100, seed=3))
    (im,) = preprocess(model, [pil], directory=ck2)
    want = AutoImageProcessor.from_pretrained(ck2)(images=[pil], return_tensors="pt")
    assert torch.equal(im.pixel_values, want["pixel_values"][0])
    assert torch.equal(im.position_ids, want["image_position_ids"][0])
    assert im.pixel_values.min() < 0  # normalised: not the default [0, 1]
    # patch sizes the tower cannot read are refused, naming the file
    (ck2 / processor_file).write_text(json.dumps({**saved, "patch_size": tower.patch_size * 2}))
    with pytest.raises(ConfigError, match=f"{processor_file}: patch_size"):
        preprocess(model, [pil], directory=ck2)
