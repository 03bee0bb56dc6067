"""Live canvas frames: what a request's block in flight looks like after each denoise step (issue 40, item 2).

A block-diffusion model fixes a canvas's positions in any order; a frame shows the draft converging: after denoise
step `step` of block `block`, the block's argmax canvas (what would be committed if the block ended now), which
positions the step accepted (entropy-bound acceptance, `sampler.entropy_bound_accept`; the others were renoised)
and the mean entropy of the step's scaled distribution.

Opt-in per request: the driver reads frames only for the rows whose request asked (`driver.Driver.step`, one host
read per iteration for all of them, after the step's report), so a request without frames costs nothing more;
frames are a read of what the step wrote anyway (`mixed_step.DenoiseState.accepted` / `entropy`), so they never change
tokens. Users: `generate(..., on_frame=...)` (both generators), `dgemma generate --live` (cli/run.py), and the server's
`stream_options.include_canvas_frames` (runtime/http/server.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CanvasFrame:
    """One denoise step of one request's block in flight.

    block: the block, 0-based per request; step: denoise steps of that block so far (1 after its first step); tokens:
    C token ids (int), the block's argmax canvas after the step (the block's last frame holds exactly the canvas its
    commit is taken from: `finish.finalize` then cuts it at eos and at the token budget); accepted: C bools, the
    positions the step accepted (True) or renoised (False); mean_entropy: float, nats, the mean over the C positions
    of the entropy of the step's temperature-scaled distribution (0 for greedy rows).
    """

    block: int
    step: int
    tokens: list[int]
    accepted: list[bool]
    mean_entropy: float

    @property
    def accepted_count(self) -> int:
        """Positions the step accepted."""
        return sum(self.accepted)

    def text(self, tokenizer) -> str:
        """The canvas as text (`tokenizer.decode`, special tokens skipped, as the committed text is decoded)."""
        return tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def pieces(self, tokenizer) -> list[str]:
        """Each position's token decoded alone (special tokens as their strings): C strings, to style per position."""
        return [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for t in self.tokens]

    def as_dict(self, tokenizer=None) -> dict:
        """{block, step, text (with a tokenizer; else absent), tokens, accepted, mean_entropy}: the server's
        `canvas_frame` object."""
        out = {"block": self.block, "step": self.step}
        if tokenizer is not None:
            out["text"] = self.text(tokenizer)
        out.update(tokens=list(self.tokens), accepted=list(self.accepted), mean_entropy=self.mean_entropy)
        return out


FrameCallback = Callable[[int, CanvasFrame], None]
"""on_frame(i, frame): request i of the call (its index) took a denoise step; called after the step, before the
block's `on_block` when that step ended the block."""


def frame_rows(values: list[list[float]], C: int) -> list[tuple[list[int], list[bool], float]]:
    """Rows of one host read [tokens (C), accepted (C), mean entropy] as float64 (`Driver.step`) -> per row
    (tokens, accepted, mean entropy). Token ids are exact in float64."""
    return [([int(t) for t in v[:C]], [bool(a) for a in v[C:2 * C]], float(v[2 * C])) for v in values]


def frame_callbacks(on_frame, n: int) -> list[FrameCallback | None]:
    """`generate(on_frame=...)` resolved per request: one `FrameCallback` for every request, or one (or None: no
    frames) per request, or None (no request asks). Raises `config.ConfigError` (naming `on_frame`) for a list of the
    wrong length or an entry that is not callable."""
    from ..model.config import ConfigError

    if on_frame is None or callable(on_frame):
        return [on_frame] * n
    cbs = list(on_frame) if isinstance(on_frame, (list, tuple)) else None
    if cbs is None or len(cbs) != n or any(c is not None and not callable(c) for c in cbs):
        raise ConfigError("on_frame", f"give one callable, or one callable or None per prompt ({n}), got {on_frame!r}")
    return cbs
