"""The image demo's task suite (`dgemma_compile.demo.image_tasks`): prompts and answers are the text suite's, the
drawing is seeded, and transformers' Gemma4 image processor keeps the 7 x 10 grid: 70 soft tokens, soft token i over
cell i (ink exactly where a character is drawn)."""

import random

import pytest
import torch

from dgemma_compile.demo import image_tasks as IT
from dgemma_compile.demo import tasks


def test_split_prompt_and_splits():
    assert IT.split_prompt("sort 3 1 2=") == ("sort <image>=", "3 1 2")
    assert IT.split_prompt("add 123+045=") == ("add <image>=", "123+045")
    with pytest.raises(ValueError, match="not a prompt of the task suite"):
        IT.split_prompt("sort 12 3=")
    rows = IT.make_split("train", 4)  # (the held-out split draws the same way, excluding the train prompts)
    assert [ex.text_prompt for ex, _ in rows] == [p for _, p, _ in tasks.make_split("train", 4)]
    assert all(tasks.check(ex.text_prompt, ex.answer) for ex, _ in rows)
    again = IT.make_split("train", 4)
    assert all(a[1].tobytes() == b[1].tobytes() for a, b in zip(rows, again))  # the drawing is seeded
    with pytest.raises(ValueError, match="characters outside the demo alphabet"):
        IT.render("3 x", random.Random(0))


def test_processor_keeps_one_soft_token_per_cell():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    shown = "9 0 1 2 3 4 5 6 7 8 9 0"
    im = IT.render(shown, random.Random(3))
    assert im.size == (IT.WIDTH, IT.HEIGHT)
    proc = Gemma4ImageProcessorPil(patch_size=IT.CELL // 2, pooling_kernel_size=2, max_soft_tokens=IT.SOFT_TOKENS)
    enc = proc(images=[im], return_tensors="pt")
    assert int(enc["num_soft_tokens_per_image"][0]) == IT.SOFT_TOKENS
    pv, pos = enc["pixel_values"][0], enc["image_position_ids"][0]
    cell = pos[:, 0] // 2 + IT.COLS * (pos[:, 1] // 2)  # the pooler's kernel index: row-major over the grid
    paper = pv.max(-1).values.max()
    ink = torch.zeros(IT.SOFT_TOKENS).index_add_(0, cell, (pv < paper - 0.2).float().sum(-1))
    drawn = [False] * (IT.SOFT_TOKENS - len(shown)) + [c != " " for c in shown]
    assert (ink > 0).tolist() == drawn
