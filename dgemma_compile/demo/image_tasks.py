"""The demo task suite asked about an image: the operands of each task are drawn in a PIL image, not typed.

Pure Python + pillow (no torch). A text task ``sort 3 1 2=`` becomes the prompt ``sort <image>=`` with an image
showing ``3 1 2``; ``add 123+045=`` becomes ``add <image>=`` with an image showing ``123+045``. The answer is the
text task's answer (`tasks.answer`), so `tasks.check` scores it.

The image is a grid of ``ROWS x COLS`` cells of ``CELL`` px (480 x 336 px): the operand text is right-aligned on
the grid's last cells, read row-major, one character per cell (spaces included), each glyph drawn with pillow's
default FreeType font at a random size, offset, ink and paper shade. The grid is exactly what transformers' Gemma4
image processor keeps at a budget of ``SOFT_TOKENS`` = 70 soft tokens with 48 px per soft token (the image demo's
tower: patches of 48 px, no pooling; the resize factor is exactly 1), so soft token ``i`` sees cell ``i`` and the
prompt holds 70 image tokens.

Splits use the text suite's (`tasks.make_split`), so the held-out image prompts are the held-out text prompts and
never a train one; the drawing of each example is seeded from its split, index and prompt, so a split's images are
the same on every run.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from . import tasks as T

ROWS, COLS, CELL = 7, 10, 48
SOFT_TOKENS = ROWS * COLS
WIDTH, HEIGHT = COLS * CELL, ROWS * CELL
FONT_SIZES = (35, 37)  # glyph sizes drawn (px, inclusive)
SHIFT = 1  # most px a glyph moves off its cell's centre, each axis
IMAGE_TOKEN = "<image>"
"""The tokenizer's image placeholder string (the image demo's tokenizer: `<boi>`, `<image>`, `<eoi>` after the text
demo's 27 tokens)."""

__all__ = ["ROWS", "COLS", "CELL", "SOFT_TOKENS", "WIDTH", "HEIGHT", "IMAGE_TOKEN", "ImageExample", "split_prompt",
           "render", "example", "make_split"]


@dataclass(frozen=True)
class ImageExample:
    """One image task: `prompt` holds one `IMAGE_TOKEN` placeholder; `shown` is the text drawn in the image;
    `text_prompt` the text task it stands for; `answer` its exact answer."""

    task: str
    prompt: str
    shown: str
    answer: str
    text_prompt: str


def split_prompt(text_prompt: str) -> tuple[str, str]:
    """``("sort <image>=", "3 1 2")`` for ``"sort 3 1 2="``. Raises ValueError for a prompt outside the suite."""
    T.answer(text_prompt)  # validates the format
    task, rest = text_prompt.split(" ", 1)
    return f"{task} {IMAGE_TOKEN}{T.SEPARATOR}", rest.removesuffix(T.SEPARATOR)


def render(shown: str, rng: random.Random):
    """A 480 x 336 RGB PIL image of `shown` (at most ``ROWS * COLS`` characters of the suite's alphabet),
    right-aligned on the last cells of the grid. Raises ValueError for text too long or off the alphabet."""
    from PIL import Image, ImageDraw

    if len(shown) > SOFT_TOKENS:
        raise ValueError(f"shown: {len(shown)} characters, the grid holds {SOFT_TOKENS}")
    if bad := set(shown) - set(T.ALPHABET):
        raise ValueError(f"shown: characters outside the demo alphabet: {sorted(bad)}")
    paper = rng.randint(215, 255)
    im = Image.new("RGB", (WIDTH, HEIGHT), (paper, paper, paper))
    draw = ImageDraw.Draw(im)
    start = SOFT_TOKENS - len(shown)
    for k, ch in enumerate(shown):
        if ch == " ":
            continue
        cell = start + k
        r, c = divmod(cell, COLS)
        font = _font(rng.randint(*FONT_SIZES))
        x0, y0, x1, y1 = draw.textbbox((0, 0), ch, font=font)
        slack_x, slack_y = max(0, CELL - (x1 - x0)), max(0, CELL - (y1 - y0))
        dx = slack_x // 2 + rng.randint(-min(SHIFT, slack_x // 2), min(SHIFT, slack_x // 2))
        dy = slack_y // 2 + rng.randint(-min(SHIFT, slack_y // 2), min(SHIFT, slack_y // 2))
        ink = rng.randint(0, 70)
        draw.text((c * CELL + dx - x0, r * CELL + dy - y0), ch, fill=(ink, ink, ink), font=font)
    return im


@functools.lru_cache(maxsize=None)
def _font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def example(task: str, text_prompt: str, answer: str, seed: str) -> tuple[ImageExample, object]:
    """The image version of one text example and its image (drawn from a stream seeded by `seed`)."""
    prompt, shown = split_prompt(text_prompt)
    im = render(shown, random.Random(f"dgemma-image-demo/{seed}/{text_prompt}"))
    return ImageExample(task, prompt, shown, answer, text_prompt), im


def make_split(name: str, n: int, seed: int = 0, *, offset: int = 0) -> list[tuple[ImageExample, object]]:
    """``n`` image examples of the text split ``name`` (`tasks.make_split`, same arguments) with their images."""
    rows = T.make_split(name, n, seed, offset=offset) if name == "heldout" else T.make_split(name, n, seed)
    return [example(task, p, a, f"{name}/{seed}/{offset + i}") for i, (task, p, a) in enumerate(rows)]
