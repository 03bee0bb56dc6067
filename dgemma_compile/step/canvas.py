"""Seeded and pinned canvases: a request's start canvas over its first output positions (issue 40).

A request may give the canvases of its blocks: per output position a token id (seeded) or nothing (free). Seeded
positions start the block with their token instead of the request's random start token (`rng.start_canvas`); pinned
ones (every seeded position of a pinned canvas, the default) also hold it through every denoise step: never
renoised, their argmax the token, counted as accepted with entropy 0, their self-conditioning input the soft embedding
of the token's one-hot (its table row, selected at D width: `DiffusionGemma.self_conditioning_embedding`), and the
commit writes it (`sampler.pin`). A block whose every position
is pinned finishes in its first step. Free positions denoise as without a canvas, and the end rule is unchanged: an
eos the model writes at a free position before the canvas ends ends the request there (`ignore_eos` runs on). A canvas longer than one block is split over consecutive blocks: the
block that starts at output position p takes positions [p, p + C) (p = the tokens the request kept so far, so a
constrained request's shorter commits shift it as they shift its text). With a constraint the grammar wins: a pinned
token the grammar does not allow at a block's first position is left free there (`Canvas.block_slice`), and the
grammar keeps only the valid prefix of each block, so a template the grammar contradicts is not followed there.

The device holds the current block's slice per row (`mixed_step.StepInputs.canvas_ids` / `seeded` / `pinned`, [B, C]),
written by the host when the row is admitted and when its previous block is finalised (`block_slice`), as a grammar
bitmask is: data, never a recompile; a row without a canvas has every position free, and its tokens are bit for bit
those it gets without this module.

Text canvases: `BLANK` ("_") is one free token position; a literal underscore is written `\\_`; every other run of
text is tokenized on its own (no special tokens) and pinned. E.g. "name: ____, age: __" is "name: " (its tokens),
four free positions, ", age: ", two free positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model.config import ConfigError, GenerationConfig

BLANK = "_"
"""The blank marker of a text canvas: one free token position per underscore (`\\_` is a literal underscore)."""


@dataclass(frozen=True)
class Canvas:
    """A request's canvas over its output positions 0 .. len(ids) - 1 (later positions are free).

    ids: per position a token id (seeded) or None (free); pinned: the seeded positions hold their tokens through the
    block's denoise steps (True, the default) or only start there (False: a warm start, renoised like any position).
    """

    ids: tuple[int | None, ...]
    pinned: bool = True

    def block_slice(self, start: int, C: int, allowed_W=None) -> tuple[list[int], list[bool], list[bool]]:
        """The block that starts at output position `start`: (token ids, seeded, pinned), C each (free: id 0).

        `allowed_W`: a constrained request's next-token bitmask (int32 [W], `constraint.RowGrammar.bitmask`): the
        grammar wins, so a first position whose token it does not allow is left free (the grammar's mask picks it);
        the text stays valid, and the canvas stays aligned to output positions."""
        part = list(self.ids[start:start + C])
        part += [None] * (C - len(part))
        if allowed_W is not None and part[0] is not None and not (int(allowed_W[part[0] // 32]) >> (part[0] % 32)) & 1:
            part[0] = None
        seeded = [t is not None for t in part]
        return [t if t is not None else 0 for t in part], seeded, [s and self.pinned for s in seeded]


def parse_template(text: str, tokenizer) -> list[int | None]:
    """A text canvas as ids: each `BLANK` is one free position (None), `\\_` a literal underscore, every other run of
    text its tokens (`tokenizer.encode(run, add_special_tokens=False)`)."""
    out: list[int | None] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            out.extend(int(t) for t in tokenizer.encode("".join(run), add_special_tokens=False))
            run.clear()

    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and text[i + 1:i + 2] == BLANK:
            run.append(BLANK)
            i += 2
            continue
        if ch == BLANK:
            flush()
            out.append(None)
        else:
            run.append(ch)
        i += 1
    flush()
    return out


def resolve_canvases(canvas, n: int, cfgs: Sequence[GenerationConfig], vocab_size: int, tokenizer=None
                     ) -> list[Canvas | None]:
    """One `Canvas` (or None) per request from `canvas`: None (no request has one), a text template (every request
    gets it), or one entry per request, each None or what `canvas_of` takes. Raises `ConfigError` naming `canvas`
    (a list of the wrong length) or `canvas[i]` (as `canvas_of`)."""
    if canvas is None:
        return [None] * n
    if isinstance(canvas, (str, Canvas)):
        canvas = [canvas] * n
    if not isinstance(canvas, (list, tuple)) or len(canvas) != n:
        raise ConfigError("canvas", f"give a text template, or one canvas (or None) per prompt ({n}), got "
                          f"{canvas!r:.80}")
    return [None if c is None else canvas_of(c, cfg, vocab_size, tokenizer, name=f"canvas[{i}]")
            for i, (c, cfg) in enumerate(zip(canvas, cfgs))]


def canvas_of(c, cfg: GenerationConfig, vocab_size: int, tokenizer=None, *, pinned: bool = True,
              name: str = "canvas") -> Canvas:
    """A request's `Canvas` from a text template (`parse_template`, needs `tokenizer`), a sequence of token ids and
    None (free), or a `Canvas` (kept as it is); `pinned`: whether the seeded positions of the others are held.
    Raises `ConfigError` naming `name`: an empty canvas or one with no given position, ids outside the vocabulary
    or not integers, a canvas longer than `cfg.max_new_tokens`; naming `tokenizer`: text without one."""
    if isinstance(c, Canvas):
        ids, pin = list(c.ids), c.pinned
    elif isinstance(c, str):
        if tokenizer is None:
            raise ConfigError("tokenizer", f"{name} is text; a text canvas needs the checkpoint's tokenizer")
        ids, pin = parse_template(c, tokenizer), pinned
    elif isinstance(c, (list, tuple)):
        ids, pin = list(c), pinned
    else:
        raise ConfigError(name, "a canvas is text, a list of token ids and None, or a Canvas; got "
                          f"{type(c).__name__}")
    if not isinstance(pin, bool):
        raise ConfigError(name, f"pinned must be a bool, got {pin!r}")
    if not ids:
        raise ConfigError(name, "an empty canvas")
    bad = [t for t in ids if t is not None and (not isinstance(t, int) or isinstance(t, bool)
                                                or not 0 <= t < vocab_size)]
    if bad:
        raise ConfigError(name, f"token ids must be integers in [0, {vocab_size}) or None (free), got {bad[0]!r}")
    if all(t is None for t in ids):
        raise ConfigError(name, "no position is given (every position is free: leave the canvas out)")
    if len(ids) > cfg.max_new_tokens:
        raise ConfigError(name, f"{len(ids)} positions, more than max_new_tokens={cfg.max_new_tokens} (a canvas "
                          f"covers the request's first output positions)")
    return Canvas(tuple(ids), pin)
