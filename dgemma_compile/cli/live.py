"""`dgemma generate --live`: the block in flight redrawn at every denoise step in the terminal (rich), from the
request's live canvas frames (`frames.py`).

Each redraw shows the text committed so far, then the block in flight position by position: accepted positions in
one style (bold green), renoised ones in another (dim red, on a grey background so that a renoised space shows),
and a status line with the block, its step count out of the step budget, the accepted positions and the step's
mean entropy. The view is transient: when generation ends it is erased and the CLI prints the committed text
exactly as it does without --live. The CLI uses it only when stdout is a terminal (`cli.generate._generate_one`).
"""

from __future__ import annotations

import sys

from ..step.frames import CanvasFrame

ACCEPTED = "bold green"
RENOISED = "dim red on grey23"
COMMITTED = ""


class LiveView:
    """A rich `Live` region on `file` (default stdout) fed by `frame` (an `on_frame` callback: `frames.FrameCallback`)
    and `commit` (the text of each committed block). `max_steps`: the step budget shown beside the step count.
    Use as a context manager; nothing is left on the screen after it."""

    def __init__(self, tokenizer, max_steps: int, file=None):
        from rich.console import Console
        from rich.live import Live

        self.tokenizer, self.max_steps = tokenizer, max_steps
        self.committed = ""
        self.frames = 0
        self.console = Console(file=file or sys.stdout)
        self.live = Live(console=self.console, transient=True, auto_refresh=False, redirect_stdout=False,
                         redirect_stderr=False)

    def __enter__(self) -> "LiveView":
        self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.live.stop()

    def commit(self, text: str) -> None:
        """A block was committed: its text joins the committed text (the next frame shows it)."""
        self.committed += text

    def frame(self, _: int, frame: CanvasFrame) -> None:
        """Redraw with `frame`, the request's block in flight after a denoise step."""
        self.frames += 1
        self.live.update(self.render(frame), refresh=True)

    def render(self, frame: CanvasFrame):
        """The renderable of one frame: committed text, the styled canvas, the status line (`rich.text.Text`)."""
        from rich.text import Text

        out = Text(self.committed, style=COMMITTED)
        for piece, ok in zip(frame.pieces(self.tokenizer), frame.accepted):
            out.append(piece, style=ACCEPTED if ok else RENOISED)
        C = len(frame.tokens)
        out.append(f"\nblock {frame.block} · step {frame.step}/{self.max_steps} · accepted "
                   f"{frame.accepted_count}/{C} · mean entropy {frame.mean_entropy:.3f} nats", style="dim")
        return out
