"""Constrained outputs: the `Constraint` type, its grammar (compiled by xgrammar), and the host matcher of one row.

The canvas side is ours, the grammar side is the kept library's (xgrammar): docs/constrained.md gives the design and
why it is sound. In short, per block of a constrained row:
- on the device, the step masks the logits of the canvas's FIRST position (the next token after everything
  committed) with the matcher's next-token bitmask (`StepInputs.allowed`, int32 [B, W]; `sampler.mask_first`), so
  the block's argmax there is always a token the grammar allows;
- on the host, when the block finishes, `RowGrammar.accept` runs the matcher left to right over the argmax canvas
  and keeps its longest accepted prefix (at least one token, by the mask); only that prefix is returned and
  committed (`RowState.commit_len`), the rest is denoised again as the next block, whose first position is masked
  with the bitmask after the prefix (`RowGrammar.bitmask`).
The host work per block is up to C `accept_token` calls, one `fill_next_token_bitmask` and one [W] int32 copy.

Legend: V vocab (the model's), W = ceil(V / 32) bitmask words, C canvas.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..model.config import ConfigError

KINDS = ("regex", "choice", "json_schema", "json_object", "structural_tag")


class ConstraintError(ConfigError):
    """A constraint the grammar library cannot compile (its message names the kind and the library's reason)."""


def bitmask_words(vocab_size: int) -> int:
    """W: int32 words of a next-token bitmask over `vocab_size` ids (bit v % 32 of word v // 32 allows id v)."""
    return math.ceil(vocab_size / 32)


def pack_bitmask(allowed_V: torch.Tensor) -> torch.Tensor:
    """bool [V] -> the int32 [W] bitmask allowing exactly those ids (xgrammar's layout, `bitmask_words`)."""
    V = allowed_V.shape[0]
    W = bitmask_words(V)
    bits = torch.zeros(W * 32, dtype=torch.long)
    bits[:V] = allowed_V.long()
    words = (bits.view(W, 32) << torch.arange(32)).sum(-1)  # each word's 32 bits as an unsigned value
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass(frozen=True)
class Constraint:
    """What a constrained request's text must be: a regex's full match (`regex`), one of the strings in `choice`,
    a JSON value valid under a JSON schema (`json_schema`, the schema as JSON text), any JSON object
    (`json_object`) or the text an xgrammar structural tag describes (`structural_tag`, its JSON text: Gemma4's tool
    calls, `runtime/http/tool_syntax.py`). Build with the class methods; `spec` is the pattern, the choices (a tuple of strings),
    the schema or tag text (None for `json_object`). Raises ConfigError (naming `constraint`) for a malformed one."""

    kind: str
    spec: Any = None

    def __post_init__(self) -> None:
        k, s = self.kind, self.spec
        if k not in KINDS:
            raise ConfigError("constraint", f"kind must be one of {KINDS}, got {k!r}")
        if k == "regex" and (not isinstance(s, str) or not s):
            raise ConfigError("constraint", f"a regex must be a non-empty string, got {s!r}")
        if k == "choice" and (not isinstance(s, tuple) or not s or
                              any(not isinstance(c, str) or not c for c in s)):
            raise ConfigError("constraint", f"choice must be a non-empty list of non-empty strings, got {s!r}")
        if k == "json_schema":
            if not isinstance(s, str):
                raise ConfigError("constraint", f"a json_schema must be JSON text, got {type(s).__name__}")
            try:
                value = json.loads(s)
            except ValueError as e:
                raise ConfigError("constraint", f"the json_schema is not valid JSON ({e})") from None
            if not isinstance(value, (dict, bool)):
                raise ConfigError("constraint", f"a json_schema must be an object or a boolean, got {s[:40]!r}")
        if k == "structural_tag":
            try:
                value = json.loads(s) if isinstance(s, str) else None
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ConfigError("constraint", f"a structural_tag must be the JSON text of an object, got {s!r:.60}")
        if k == "json_object" and s is not None:
            raise ConfigError("constraint", "json_object takes no spec")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """The text is a full match of `pattern` (xgrammar's regex dialect: ECMAScript-like)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Constraint":
        """The text equals one of `options`."""
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ConfigError("constraint", f"choice must be a list of strings, got {options!r}")
        return cls("choice", tuple(options))

    @classmethod
    def json_schema(cls, schema: Mapping | str | bool) -> "Constraint":
        """The text is JSON valid under `schema` (a dict, a boolean or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """The text is any JSON object."""
        return cls("json_object")

    @classmethod
    def structural_tag(cls, tag: Mapping | str) -> "Constraint":
        """The text matches an xgrammar structural tag (a dict or its JSON text; `tool_syntax.tool_call_constraint`
        builds the one of Gemma4's tool calls)."""
        return cls("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))


def _choice_ebnf(options: tuple[str, ...]) -> str:
    # EBNF string literals: JSON's escapes (quote, backslash, control characters) are the grammar's too
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def compile_constraint(compiler, constraint: Constraint):
    """`constraint` compiled by an xgrammar `GrammarCompiler` (`GrammarLibrary.compile`'s work, and a server's grammar
    worker process's: `dgemma_runtime.http.grammars`). Raises ConstraintError naming the kind and the library's reason."""
    import xgrammar as xgr

    if not isinstance(constraint, Constraint):
        raise ConfigError("constraint", f"must be a dgemma_compile Constraint, got {type(constraint).__name__}")
    try:
        if constraint.kind == "regex":
            return compiler.compile_regex(constraint.spec)
        if constraint.kind == "choice":
            return compiler.compile_grammar(xgr.Grammar.from_ebnf(_choice_ebnf(constraint.spec)))
        if constraint.kind == "structural_tag":
            return compiler.compile_structural_tag(constraint.spec)
        # json_object: xgrammar's builtin JSON grammar admits any value; an object is the schema {"type": "object"}
        schema = constraint.spec if constraint.kind == "json_schema" else '{"type": "object"}'
        return compiler.compile_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        reason = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", reason)  # xgrammar's "[time] file.cc:line: " prefix
        raise ConstraintError("constraint", f"the grammar library cannot compile this {constraint.kind}: "
                              f"{reason}") from None


class GrammarLibrary:
    """Compiles constraints for one tokenizer and vocabulary (xgrammar's `TokenizerInfo` + `GrammarCompiler`, which
    caches compiled grammars).

    Args: tokenizer: a transformers tokenizer (the checkpoint's, `dg.load_tokenizer`); vocab_size: V, the model's
    (>= the tokenizer's; ids beyond it are never allowed); eos_token_ids: the ids that end a text (the grammar's stop
    tokens: the only ids allowed once the grammar is complete).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(self.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info)
        # ids no grammar accepts (the model's padding rows past the tokenizer, special tokens other than eos):
        # rejected here, without asking the matcher (which logs a warning for each)
        self.tokenizer_size = min(len(tokenizer), vocab_size)
        self.special = frozenset(self.info.special_token_ids) - set(self.eos_token_ids)
        self._json_banned: frozenset | None = None
        self._unbanned: dict[bool, torch.Tensor] = {}

    def json_banned(self) -> frozenset:
        """Ids whose text holds a control character (U+0000-U+001F): strict JSON allows none unescaped inside a
        string, and outside strings only as whitespace, which our JSON grammars (no free whitespace) never emit;
        xgrammar's JSON string rule lets them through, so JSON constraints ban them."""
        if self._json_banned is None:
            vocab = self.info.decoded_vocab
            self._json_banned = frozenset(i for i in range(min(len(vocab), self.vocab_size))
                                          if i not in self.eos_token_ids and any(b < 0x20 for b in vocab[i]))
        return self._json_banned

    @classmethod
    def for_model(cls, tokenizer, model, eos_token_ids: Sequence[int]) -> "GrammarLibrary":
        """The library of `tokenizer` at `model`'s vocabulary, kept on the tokenizer per (V, eos ids) so that a
        grammar compiles once per process."""
        V = model.config.vocab_size
        cache = tokenizer.__dict__.setdefault("_dgemma_grammar_libraries", {})
        key = (V, tuple(sorted(eos_token_ids)))
        if key not in cache:
            cache[key] = cls(tokenizer, V, eos_token_ids)
        return cache[key]

    def compile(self, constraint: Constraint):
        """xgrammar's compiled grammar of `constraint` (in this process; `compile_constraint`). Raises
        ConstraintError naming the kind and the library's reason (an unsupported schema feature, a regex it cannot
        parse)."""
        return compile_constraint(self.compiler, constraint)

    def matcher(self, constraint: Constraint, compiled=None) -> "RowGrammar":
        """A fresh `RowGrammar` (empty prefix) for one request; `compiled`: its xgrammar `CompiledGrammar` made
        elsewhere (a server's grammar worker, `dgemma_runtime.http.grammars`; for this library's tokenizer info), else
        compiled here. Raises ConstraintError as `compile`."""
        json_kind = constraint.kind.startswith("json")
        banned = self.special | (self.json_banned() if json_kind else frozenset())
        if json_kind not in self._unbanned:  # the bitmask of every id not banned, once per library and kind
            allowed = torch.ones(self.vocab_size, dtype=torch.bool)
            allowed[list(banned)] = False
            self._unbanned[json_kind] = pack_bitmask(allowed)
        grammar = compiled if compiled is not None else self.compile(constraint)
        return RowGrammar(self._xgr.GrammarMatcher(grammar), self.vocab_size,
                          self.tokenizer_size, banned, self._unbanned[json_kind])


class RowGrammar:
    """The host matcher of one constrained request: the grammar's state after the tokens committed so far."""

    def __init__(self, matcher, vocab_size: int, tokenizer_size: int | None = None, banned: frozenset = frozenset(),
                 unbanned: torch.Tensor | None = None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tokenizer_size = vocab_size if tokenizer_size is None else tokenizer_size
        self.banned = banned
        """Ids refused whatever the matcher says (special tokens other than eos; for JSON, control characters)."""
        self._unbanned = unbanned if unbanned is not None else pack_bitmask(
            torch.tensor([i not in banned for i in range(vocab_size)]))
        self.terminated = False
        self._mask: torch.Tensor | None = None
        self.host_seconds = 0.0
        """Seconds of host work spent in this matcher (accept + bitmask), for the per-block cost in the docs."""

    def bitmask(self) -> torch.Tensor:
        """int32 [W] (CPU): the tokens allowed at the next position (computed once per state). All zeros once the
        grammar terminated, or at a dead end (`dead_end`)."""
        if self._mask is None:
            t0 = time.perf_counter()
            mask = torch.zeros(1, bitmask_words(self.vocab_size), dtype=torch.int32)
            if not self.terminated:
                self.matcher.fill_next_token_bitmask(mask)
            self._mask = mask[0] & self._unbanned
            self.host_seconds += time.perf_counter() - t0
        return self._mask

    @property
    def dead_end(self) -> bool:
        """The grammar is not complete and no id of the vocabulary can continue it (a grammar that needs characters
        the tokenizer cannot spell)."""
        return not self.terminated and not bool(self.bitmask().any())

    def accept(self, tokens: Sequence[int]) -> int:
        """Advance over `tokens` left to right, stopping at the first the grammar rejects or after the stop token that
        completes it (`terminated`); returns how many were accepted (the state then follows exactly those)."""
        t0 = time.perf_counter()
        n = 0
        self._mask = None
        for t in tokens:
            t = int(t)
            if self.terminated or t >= self.tokenizer_size or t in self.banned or not self.matcher.accept_token(t):
                break
            n += 1
            self.terminated = self.matcher.is_terminated()
        self.host_seconds += time.perf_counter() - t0
        return n

    def peek(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` `accept` would accept, leaving the state as it is (accept, then roll back): what of
        a block in flight is valid so far (the engine's draft events)."""
        terminated, mask = self.terminated, self._mask
        n = self.accept(tokens)
        if n:
            self.matcher.rollback(n)
        self.terminated, self._mask = terminated, mask
        return n


def resolve_constraints(constraint: Constraint | Sequence[Constraint | None] | None, n: int) -> list:
    """One `Constraint` or None per request: `constraint` is one for every request, one (or None) per request, or
    None. Raises ConfigError for a list of the wrong length or an entry that is not a Constraint."""
    if constraint is None or isinstance(constraint, Constraint):
        return [constraint] * n
    if isinstance(constraint, (str, bytes)) or not isinstance(constraint, Sequence) or len(constraint) != n:
        raise ConfigError("constraint", f"give one Constraint, or one (or None) per prompt ({n}), got {constraint!r}")
    for c in constraint:
        if c is not None and not isinstance(c, Constraint):
            raise ConfigError("constraint", f"entries must be Constraint or None, got {type(c).__name__}")
    return list(constraint)


def row_grammars(model, constraints: list, cfgs, tokenizer, compiled: list | None = None) -> list[RowGrammar | None]:
    """A fresh `RowGrammar` per constrained request (None for the others), compiled with the tokenizer's
    `GrammarLibrary` at the model's vocabulary and the requests' eos ids; `compiled`: per request, its grammar
    compiled elsewhere (`GrammarLibrary.matcher`) or None.

    Raises: ConfigError: constraints without a `tokenizer`, or with `ignore_eos` (a grammar ends on eos);
    ConstraintError: a constraint the library cannot compile, or whose first token no id of the vocabulary spells."""
    if all(c is None for c in constraints):
        return [None] * len(constraints)
    if tokenizer is None:
        raise ConfigError("tokenizer", "a constraint needs the checkpoint's tokenizer (generate(..., tokenizer=...))")
    out: list[RowGrammar | None] = []
    for c, cfg, done in zip(constraints, cfgs, compiled or [None] * len(constraints)):
        if c is not None and cfg.ignore_eos:
            raise ConfigError("ignore_eos", "a constrained request ends with the grammar's eos; ignore_eos is refused")
        g = None if c is None else GrammarLibrary.for_model(tokenizer, model, cfg.eos_token_ids).matcher(c, done)
        if g is not None and g.dead_end:
            raise ConstraintError("constraint", f"no token of the model's vocabulary can begin this {c.kind}")
        out.append(g)
    return out
