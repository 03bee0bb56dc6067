"""The image demo model (`dgemma_compile/demo/image_model`): it loads in transformers' DiffusionGemma and in ours with
its vision encoder, and answers held-out image prompts (operands drawn in the image) through the user path, with
transformers' own generate giving the same tokens."""

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.demo import IMAGE_DEMO_MODEL
from dgemma_compile.demo import image_tasks as IT
from dgemma_compile.demo import tasks
from dgemma_compile.preprocess import num_soft_tokens, preprocess
from dgemma_compile.text import ImageSlots, encode_prompt

pytestmark = pytest.mark.skipif(not (IMAGE_DEMO_MODEL / "model.safetensors").is_file(),
                                reason="the image demo checkpoint is not shipped")


def test_image_demo_config_and_processor():
    """Loads with its tower (image ids inside the vocabulary); the processor keeps the 480 x 336 grid at 70 soft
    tokens, one per cell."""
    model = dg.load(IMAGE_DEMO_MODEL, attention="dense")
    assert model.vision is not None and model.vision.config.image_token_id == 29
    (ex, im), = IT.make_split("heldout", 1)
    (img,) = preprocess(model, [im])
    assert num_soft_tokens(model, img) == IT.SOFT_TOKENS


@pytest.mark.slow
def test_image_demo_answers_and_matches_transformers():
    from transformers import DiffusionGemmaForBlockDiffusion

    model, tok = dg.load(IMAGE_DEMO_MODEL, attention="dense"), dg.load_tokenizer(IMAGE_DEMO_MODEL)
    ref, info = DiffusionGemmaForBlockDiffusion.from_pretrained(IMAGE_DEMO_MODEL, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    examples = IT.make_split("heldout", 4)  # one per task
    prompts, images = [], []
    for ex, im in examples:
        imgs = preprocess(model, [im])
        slots = ImageSlots.for_model(tok, model, [num_soft_tokens(model, x) for x in imgs])
        prompts.append(encode_prompt(tok, ex.prompt, bos_token_id=model.config.bos_token_id, images=slots))
        images.append(imgs)
    out = dg.generate(model, prompts, seed=0, images=images)
    texts = [tok.decode(s[:s.index(1)] if 1 in s else s, skip_special_tokens=True) for s in out.sequences]
    assert [tasks.check(ex.text_prompt, t) for (ex, _), t in zip(examples, texts)] == [True] * 4, texts
    # transformers' generate on the same ids and pixels: the same answer
    ids, im = prompts[0], images[0][0]
    with torch.no_grad():
        theirs = ref.eval().generate(torch.tensor([ids]), pixel_values=im.pixel_values[None],
                                     image_position_ids=im.position_ids[None], generation_config=ref.generation_config)
    seq = (theirs.sequences if hasattr(theirs, "sequences") else theirs)[0, len(ids):].tolist()
    assert tok.decode(seq[:seq.index(1)], skip_special_tokens=True) == texts[0]
