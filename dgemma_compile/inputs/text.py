"""Text in, text out: prompt assembly (raw text or chat messages -> token ids) and incremental detokenization.

One module for every front end (the CLI now, a server later), so that a prompt reaches the model the same way
whichever door it came through:

- `encode_prompt(tokenizer, text, bos_token_id=...)`: raw text as the tokenizer encodes it (its post-processor
  included), with exactly one BOS at position 0.
- `encode_chat(tokenizer, messages, bos_token_id=...)`: the checkpoint's own chat template (transformers reads
  `chat_template.jinja` first, else the `chat_template` entry of `tokenizer_config.json`), rendered, tokenized
  without special tokens (as `apply_chat_template` does), with exactly one BOS at position 0: added when the
  template does not render `{{ bos_token }}`, never doubled when it does.
- images (`ImageSlots`, the `images=` argument of both): each image placeholder token in the text (the chat
  template renders one per image part) becomes boi + N image tokens + eoi, N the image's soft tokens, as transformers'
  Gemma4Processor writes them; a raw prompt without placeholders gets one per image at its start.
- `Detokenizer`: the text of a growing token sequence as deltas that never need retracting.
- `StopStrings`: stop strings on that text (the text shown never contains one, across blocks too); it decides which
  rows the generator's per-request stop hook ends (`generate(..., stop=...)`).

Gemma-family models expect exactly one BOS at position 0; a prompt without it runs, silently worse.

Every bad input raises `ConfigError` naming the thing: `prompt` (empty, or text the tokenizer encodes as its
unknown token, checked by encoding the text whole: `check_encodable`; the tokenizer's special / added tokens written
literally, e.g. the "<bos>" a chat template renders, are encoded as those tokens, as the tokenizer itself splits
them out), `system`, `messages`, `chat template` (absent, or failing to render).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..model.config import ConfigError

REPLACEMENT = "\ufffd"  # what a decoder renders for the bytes of an incomplete (or invalid) UTF-8 sequence


def user_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The chat of one user turn, preceded by a system turn when `system` is given."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": prompt}]


def check_encodable(tokenizer, text: str, name: str = "prompt", *, add_special_tokens: bool = False
                    ) -> list[int] | None:
    """Raise `ConfigError` naming `name` when `text` is empty or the tokenizer maps part of it to its unknown token
    (byte-level tokenizers, which have none, encode everything). The text is encoded as a whole, as the prompt will
    be (a word-level tokenizer knows words, not their characters); the tokenizer's added / special tokens written
    literally ("<bos>" of a rendered chat template, the unknown token itself) are those tokens, not unknown text.
    The message names the characters (or, where a piece longer than one character is unknown, the pieces) that
    encode as the unknown token. Returns the ids of that encoding (`add_special_tokens` as the tokenizer's call takes
    it), so a caller need not encode again; None where the text was not encoded whole (no unknown token, or a slow
    tokenizer)."""
    if not isinstance(text, str):
        raise ConfigError(name, f"must be a string, got {type(text).__name__}")
    if not text:
        raise ConfigError(name, f"empty {name}")
    unk = tokenizer.unk_token_id
    if unk is None:
        return None
    enc = None
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (python) tokenizer has no offsets: each character alone, as before
        rest = _without_added_tokens(tokenizer, text)
        pieces = [ch for ch in set(rest) if unk in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    else:
        pieces = [text[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                  if t == unk and text[a:b] != tokenizer.unk_token]
    if not pieces:
        return None if enc is None else [int(t) for t in enc["input_ids"]]
    if all(len(p) == 1 for p in pieces):
        raise ConfigError(name, f"characters the model's tokenizer cannot encode: {''.join(sorted(set(pieces)))!r}")
    shown = ", ".join(repr(p[:40]) for p in list(dict.fromkeys(pieces))[:8])
    raise ConfigError(name, f"text the model's tokenizer cannot encode: {shown}")


def _without_added_tokens(tokenizer, text: str) -> str:
    """`text` with every literal occurrence of the tokenizer's added tokens (special ones included) cut out."""
    added = set(getattr(tokenizer, "added_tokens_encoder", None) or ())
    added |= set(getattr(tokenizer, "all_special_tokens", None) or ())
    added = sorted((t for t in added if t), key=len, reverse=True)  # longest first, as the tokenizer matches
    if not added:
        return text
    return "".join(re.split("|".join(re.escape(t) for t in added), text))


def with_one_bos(ids: Sequence[int], bos_token_id: int | None) -> list[int]:
    """`ids` with exactly one BOS at position 0 (a leading run of BOS collapsed, a missing one added); unchanged
    when there is no BOS id. BOS ids further in are the text's own and are kept."""
    ids = [int(t) for t in ids]
    if bos_token_id is None:
        return ids
    start = 0
    while start < len(ids) and ids[start] == bos_token_id:
        start += 1
    return [bos_token_id] + ids[start:]


@dataclass(frozen=True)
class ImageSlots:
    """The placeholders of a prompt's images: the tokenizer's strings of the image, boi and eoi tokens and each
    image's soft tokens, in order (`preprocess.num_soft_tokens`). `for_model` reads the strings from the model's
    vision config through the tokenizer."""

    image_token: str
    boi_token: str
    eoi_token: str
    soft_tokens: tuple[int, ...]

    @classmethod
    def for_model(cls, tokenizer, model, soft_tokens: Sequence[int]) -> "ImageSlots":
        """Raises ConfigError when the model has no vision encoder or the tokenizer lacks one of the ids."""
        vision = model.vision
        if vision is None:
            raise ConfigError("image", "this model has no vision encoder")
        c = vision.config
        names = []
        for name, i in (("image_token_id", c.image_token_id), ("boi_token_id", c.boi_token_id),
                        ("eoi_token_id", c.eoi_token_id)):
            tok = tokenizer.convert_ids_to_tokens(i) if i is not None and i < len(tokenizer) else None
            if tok is None:
                raise ConfigError(name, f"{i} is not a token of the checkpoint's tokenizer")
            names.append(tok)
        return cls(*names, soft_tokens=tuple(int(n) for n in soft_tokens))

    def expand(self, text: str, name: str = "prompt", *, prepend: bool = False) -> str:
        """`text` with each image placeholder replaced by boi + N image tokens + eoi (the processor's
        `replace_image_token`); `prepend`: a text without placeholders gets one per image at its start first.
        Raises ConfigError naming `name` when placeholders and images differ in number."""
        found = text.count(self.image_token)
        if found == 0 and prepend:
            text, found = self.image_token * len(self.soft_tokens) + text, len(self.soft_tokens)
        if found != len(self.soft_tokens):
            raise ConfigError(name, f"{found} image placeholders ({self.image_token}) but {len(self.soft_tokens)} "
                              f"images")
        parts = text.split(self.image_token)
        out = parts[0]
        for n, part in zip(self.soft_tokens, parts[1:]):
            out += self.boi_token + self.image_token * n + self.eoi_token + part
        return out


def encode_prompt(tokenizer, text: str, *, bos_token_id: int | None, images: ImageSlots | None = None) -> list[int]:
    """Token ids of raw text: the tokenizer's own encoding (special tokens as its post-processor adds them), with
    exactly one BOS at position 0 when `bos_token_id` is not None (pass the model's `config.bos_token_id`).
    `images`: the text's image placeholders expanded (`ImageSlots.expand`; without any, one per image is put first).

    Raises:
        ConfigError: `prompt` is empty or holds characters the tokenizer cannot encode; placeholders and images that
            differ in number.
    """
    ids = check_encodable(tokenizer, text, "prompt", add_special_tokens=True)
    if images is not None:
        text, ids = images.expand(text, "prompt", prepend=True), None
    return with_one_bos(tokenizer(text)["input_ids"] if ids is None else ids, bos_token_id)


def chat_template(tokenizer) -> str:
    """The tokenizer's default chat template. transformers loads it from `chat_template.jinja` (which wins) or the
    `chat_template` entry of `tokenizer_config.json`; a `chat_templates/` folder gives named ones (`default` used).

    Raises:
        ConfigError: the checkpoint has no chat template.
    """
    where = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    if not template:
        raise ConfigError("chat template", f"{where} has none (no chat_template.jinja, no \"chat_template\" in "
                          f"tokenizer_config.json); give a raw prompt instead")
    return template


def _texts(content: Any) -> list[str]:
    """The text parts of a message's content (a string, or a list of {"type": "text", "text": ...} parts)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        return [p["text"] for p in content if p.get("type") == "text" and isinstance(p.get("text"), str)]
    raise ConfigError("messages", f"content must be a string or a list of parts, got {type(content).__name__}")


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, bos_token_id: int | None,
                add_generation_prompt: bool = True, images: ImageSlots | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None,
                name_of: Callable[[int, str], str] | None = None) -> list[int]:
    """Token ids of a chat through the checkpoint's own template, with exactly one BOS at position 0 when
    `bos_token_id` is not None. The rendered text is tokenized without special tokens, as `apply_chat_template`
    does, so a template that writes `{{ bos_token }}` gives the only BOS and one that does not gets it prepended.

    Every message's text is checked as `encode_prompt` checks a prompt, named by role (`prompt` for the user,
    `system`, ...), or by `name_of(index, role)` when given (an HTTP server names the request's field,
    `messages[i].content`). `images`: the images of the messages' `{"type": "image"}` parts, in order; the placeholders the
    template renders for them are expanded (`ImageSlots.expand`). `tools`: OpenAI function tool specs, given to the
    template as `tools` (a Gemma4 template declares them in its system turn); an assistant message may carry
    `tool_calls` instead of text.

    Raises:
        ConfigError: no template, a template error (e.g. a role it refuses), empty or unencodable text, a template
            that renders another number of image placeholders than there are images (named `chat template`).
    """
    try:
        import jinja2
    except ImportError:  # transformers renders templates with jinja2 but does not require it
        raise ConfigError("chat template", "rendering one needs jinja2 (pip install jinja2)") from None
    if not messages:
        raise ConfigError("messages", "no message given")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ConfigError("messages", f"each message needs a role and a content, got {m!r}")
        label = "prompt" if m["role"] == "user" else str(m["role"])
        name = label if name_of is None else name_of(i, str(m["role"]))
        texts = _texts(m["content"])
        if not any(texts) and not m.get("tool_calls"):
            raise ConfigError(name, f"empty {label}")
        for t in texts:
            if t:
                check_encodable(tokenizer, t, name)
    template = chat_template(tokenizer)
    try:
        extra = {} if tools is None else {"tools": [dict(t) for t in tools]}
        rendered = tokenizer.apply_chat_template([dict(m) for m in messages], chat_template=template,
                                                 add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    except jinja2.TemplateError as e:
        raise ConfigError("chat template", str(e)) from None
    if images is not None:
        rendered = images.expand(rendered, "chat template")
    return with_one_bos(tokenizer(rendered, add_special_tokens=False)["input_ids"], bos_token_id)


class Detokenizer:
    """Incremental detokenization of one generated sequence: `push(new_ids)` returns the text to show now.

    Guarantees (tested with a byte-level BPE that splits characters across tokens):
    - the text emitted so far (`text`, the concatenation of every returned delta) is always a prefix of the final
      text, `tokenizer.decode(all ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, and after
      `finish()` equals it;
    - bytes of an incomplete character (the decoder's trailing U+FFFD) are held back until it completes;
    - special tokens (eos, pad, bos...) produce no text.

    Every delta is final (nothing is ever retracted), so a server streams the deltas as they come and a stop-string
    matcher can run on them (or on `text`) holding back only its own partial matches. `tokens` is every id pushed,
    for mapping a cut back to a token count.

    Each push decodes the whole sequence once (the decoder's treatment of the first token and of bytes split
    across tokens then needs no special case): O(tokens) per push, pushes come once per committed block.
    Tokenization-space clean-up is off: it rewrites text across token boundaries ("do n" + "'t" -> "don't") and
    cannot be streamed.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.finished = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the newly final text ("" while only incomplete bytes arrived)."""
        if self.finished:
            raise ValueError("Detokenizer.push after finish()")
        self.tokens.extend(int(t) for t in new_ids)
        full = self._decode()
        stable = len(full.rstrip(REPLACEMENT))
        return self._emit(full[:stable])

    def finish(self) -> str:
        """End of the sequence: return what was held back (an incomplete last character shows as U+FFFD, as the
        tokenizer's full decode shows it)."""
        self.finished = True
        return self._emit(self._decode())

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta


def check_stop_strings(stops: Sequence[str] | str | None, name: str = "stop") -> tuple[str, ...]:
    """Normalise stop strings (one string, a list, or None) to a tuple. Raises ConfigError naming `name` for an empty
    string or a non-string."""
    if stops is None:
        return ()
    items = [stops] if isinstance(stops, str) else list(stops) if isinstance(stops, (list, tuple)) else None
    if items is None or any(not isinstance(x, str) for x in items):
        raise ConfigError(name, f"must be a string or a list of strings, got {stops!r}")
    if any(x == "" for x in items):
        raise ConfigError(name, "empty stop string")
    return tuple(items)


class StopStrings:
    """Stop strings over one request's incremental text: `push(new_ids)` returns the text to show now and sets
    `stopped` once a stop string appeared; the text shown never contains a stop string, also when one spans two
    blocks (the longest tail that could begin one is held back until the next block decides).

    `text` is everything shown so far; after `stopped` it is the final text (up to, not including, the earliest
    stop string). `finish()` releases what was held back when the request ended for another reason.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.detok = Detokenizer(tokenizer)
        self.stops = check_stop_strings(stops)
        self.seen = ""  # every character the detokenizer released
        self.text = ""
        self.stopped = False

    def push(self, new_ids: Sequence[int]) -> str:
        """Append a block's token ids; return the newly shown text."""
        if self.stopped:
            return ""
        self.seen += self.detok.push(new_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of the request: release the held-back tail (nothing after a stop)."""
        if self.stopped:
            return ""
        self.seen += self.detok.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        start = len(self.text)  # no stop string begins before what was shown (its start would have been held)
        hits = [i for i in (self.seen.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            hold = 0 if final else max((k for s in self.stops for k in range(1, len(s))
                                        if self.seen.endswith(s[:k])), default=0)
            end = max(len(self.seen) - hold, start)
        delta = self.seen[start:end]
        self.text += delta
        return delta


__all__ = ["Detokenizer", "ImageSlots", "StopStrings", "check_stop_strings", "chat_template", "check_encodable", "encode_chat", "encode_prompt", "user_messages",
           "with_one_bos"]
