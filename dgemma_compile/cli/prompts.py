"""`--prompts-file` lines (`PromptLine`: JSON lines or plain text, one prompt each) and a prompt's encoding."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .args import GenerateArgs


# --prompts-file JSONL keys: the keys a line may set
LINE_KEYS = ("prompt", "seed", "max_new_tokens", "entropy_bound", "temperature", "stop")


def _encode(tokenizer, model, prompt: str, args: "GenerateArgs", images=None) -> list[int]:
    """Token ids of one prompt: raw, or through the chat template with --chat/--system; `images` (`images.Image`,
    --image) become the prompt's placeholder runs (`text.ImageSlots`). Raises ConfigError."""
    from ..inputs.preprocess import num_soft_tokens
    from ..inputs.text import ImageSlots, encode_chat, encode_prompt, user_messages

    bos = model.config.bos_token_id
    slots = ImageSlots.for_model(tokenizer, model, [num_soft_tokens(model, im) for im in images]) if images else None
    if args.chat or args.system is not None:
        messages = user_messages(prompt, args.system)
        if images:
            messages[-1] = {"role": "user", "content": [{"type": "image"} for _ in images]
                            + [{"type": "text", "text": prompt}]}
        return encode_chat(tokenizer, messages, bos_token_id=bos, images=slots)
    return encode_prompt(tokenizer, prompt, bos_token_id=bos, images=slots)


@dataclass
class PromptLine:
    """One line of a prompts file: its 1-based number and either the request's parts or the error."""

    line: int
    prompt: str | None = None
    changes: dict | None = None  # GenerationConfig changes the line asks for
    seed: int | None = None
    error: str | None = None
    ids: list[int] | None = None
    config: object = None
    stop: object = None  # the line's "stop" (a string or a list), None: --stop
    stops: tuple[str, ...] = ()


def read_prompts_file(name: str) -> list[PromptLine]:
    """The prompt lines of FILE (or stdin for '-'); blank lines are skipped (line numbers still count them).

    A line whose first non-blank character is `{` is a JSON object; any other line is the prompt itself (without
    its line ending). Raises ConfigError when the file cannot be read or holds no prompt.
    """
    from ..model.config import ConfigError

    if name == "-":
        data = sys.stdin.buffer.read()
    else:
        path = Path(name)
        if not path.exists():
            raise ConfigError("--prompts-file", f"{name}: no such file")
        if path.is_dir():
            raise ConfigError("--prompts-file", f"{name}: is a directory")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError("--prompts-file", f"{name}: {e.strerror or e}") from None
    lines = [parse_prompt_line(i, raw) for i, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    if not lines:
        raise ConfigError("--prompts-file", f"{name}: no prompts")
    return lines


def parse_prompt_line(number: int, raw: bytes) -> PromptLine:
    """One prompts-file line -> `PromptLine` (with `error` set when the line is bad)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return PromptLine(number, error=f"not UTF-8 text (byte {e.start + 1})")
    if not text.lstrip().startswith("{"):
        return PromptLine(number, prompt=text, changes={})
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return PromptLine(number, error=f"not a valid JSON object: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return PromptLine(number, error="not a valid JSON object")
    for key in obj:
        if key not in LINE_KEYS:
            return PromptLine(number, error=f"{key}: unknown key (a line may set {', '.join(LINE_KEYS)})")
    if "prompt" not in obj:
        return PromptLine(number, error="prompt: missing")
    if not isinstance(obj["prompt"], str):
        return PromptLine(number, error=f"prompt: must be a string, got {json.dumps(obj['prompt'])}")
    changes = {k: obj[k] for k in ("max_new_tokens", "entropy_bound", "temperature") if k in obj}
    return PromptLine(number, prompt=obj["prompt"], changes=changes, seed=obj.get("seed"), stop=obj.get("stop"))


def _read_inputs(args: "GenerateArgs") -> tuple[list[PromptLine] | None, list | None]:
    """The prompts file's lines (or None) and the --image files (or None). Raises ConfigError."""
    lines = read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    images = None
    if args.image:
        from ..inputs.preprocess import read_image

        images = [read_image(p) for p in args.image]
    return lines, images
