"""Seeded toy task suite with exact answers for the demo DiffusionGemma model.

Pure Python (no torch). Every prompt is plain text over a tiny alphabet and ends with the
separator ``=``; the answer starts right after it. Lists are single digits separated by one
space.

Tasks and formats (``prompt`` -> ``answer``):

- ``sort``:  ``sort 3 1 2=``        -> ``1 2 3``        2..10 digits, ascending order
- ``rev``:   ``rev 3 1 2=``         -> ``2 1 3``        2..12 digits, reversed
  (answers of 9+ items are 17..23 characters, so with the 16-token canvas they span two canvases)
- ``dedup``: ``dedup 3 1 3 2=``     -> ``3 1 2``        2..12 digits drawn from a random pool of
  2..6 distinct digits; keep the first occurrence of each digit, in order
- ``add``:   ``add 123+045=``       -> ``0168``         two numbers 0..999 written with three digits,
  their decimal sum with four (both zero-padded)

Why fixed widths: trained on unpadded numbers, the 2.3 M demo model was right on sums of two
three-digit numbers but wrong on nearly every sum whose second operand or result had fewer digits
(about 10% and 0.5% of uniform draws), while it answered the padded form of the same operands. It
appears to read digits at fixed distances before the answer and to write digit places at fixed
canvas positions; fixed widths make both hold for every prompt.

``check(prompt, completion)`` recomputes the answer from the prompt and compares it with the
completion after stripping whitespace on both sides.

Splits: ``make_split("train", n, seed)`` and ``make_split("heldout", n, seed)`` draw from different
seed streams; the held-out split never contains a prompt of the train split
``make_split("train", train_n, seed)`` (``train_n`` defaults to ``DEFAULT_TRAIN_N``). Tasks are
interleaved round-robin, so every split is balanced across tasks. The held-out stream is used in two
parts: prompts ``[0, 500)`` are the test set (the README's table), prompts from
``VALIDATION_OFFSET = 500`` on are for choosing checkpoints and generation settings
(``make_split("heldout", n, seed, offset=VALIDATION_OFFSET)``).
"""

from __future__ import annotations

import functools
import random
import re

TASKS: tuple[str, ...] = ("sort", "rev", "dedup", "add")

#: Every character a prompt or answer can contain (the tokenizer is built over exactly this).
ALPHABET: str = "0123456789 =+" + "".join(sorted(set("".join(TASKS))))

SEPARATOR = "="
DEFAULT_TRAIN_N = 400_000
VALIDATION_OFFSET = 500

__all__ = [
    "TASKS",
    "ALPHABET",
    "SEPARATOR",
    "DEFAULT_TRAIN_N",
    "VALIDATION_OFFSET",
    "sample",
    "answer",
    "check",
    "task_of",
    "make_split",
]


def _digits(rng: random.Random, n: int, pool: str = "0123456789") -> list[str]:
    return [rng.choice(pool) for _ in range(n)]


def sample(task: str, rng: random.Random) -> tuple[str, str]:
    """Draw one ``(prompt, answer)`` pair of ``task`` using ``rng``."""
    if task == "sort":
        xs = _digits(rng, rng.randint(2, 10))
        return f"sort {' '.join(xs)}=", " ".join(sorted(xs))
    if task == "rev":
        xs = _digits(rng, rng.randint(2, 12))
        return f"rev {' '.join(xs)}=", " ".join(reversed(xs))
    if task == "dedup":
        pool = "".join(rng.sample("0123456789", rng.randint(2, 6)))
        xs = _digits(rng, rng.randint(2, 12), pool)
        return f"dedup {' '.join(xs)}=", " ".join(dict.fromkeys(xs))
    if task == "add":
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return f"add {a:03d}+{b:03d}=", f"{a + b:04d}"
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def task_of(prompt: str) -> str:
    """The task name of a prompt (its first word)."""
    return prompt.strip().split(" ", 1)[0]


_ADD = re.compile(r"add (\d{3})\+(\d{3})=")
_LIST = re.compile(r"(sort|rev|dedup) (\d(?: \d)*)=")


def answer(prompt: str) -> str:
    """The exact answer of a prompt, recomputed from the prompt text (surrounding whitespace ignored).

    Raises ``ValueError`` for anything but a prompt in the suite's format (e.g. ``add 5+7=``, ``sort 12 3=``).
    """
    p = prompt.strip()
    if m := _ADD.fullmatch(p):
        return f"{int(m[1]) + int(m[2]):04d}"
    if m := _LIST.fullmatch(p):
        xs = m[2].split(" ")
        return " ".join({"sort": sorted(xs), "rev": xs[::-1], "dedup": list(dict.fromkeys(xs))}[m[1]])
    raise ValueError(f"not a prompt of the task suite ({', '.join(TASKS)}; see demo/tasks.py): {prompt!r}")


def check(prompt: str, completion: str) -> bool:
    """Exact match of ``completion`` against the prompt's answer, after stripping both."""
    try:
        return completion.strip() == answer(prompt).strip()
    except (ValueError, IndexError):
        return False


def _stream(name: str, seed: int) -> random.Random:
    # str seeds are hashed with sha512 by `random`, so this is stable across runs and platforms.
    return random.Random(f"dgemma-demo/{name}/{seed}")


@functools.lru_cache(maxsize=4)
def _train_prompts(train_n: int, seed: int) -> frozenset[str]:
    """The prompts of ``make_split("train", train_n, seed)``, which every "heldout" call excludes (cached: building
    them is most of a held-out split's cost)."""
    return frozenset(p for _, p, _ in make_split("train", train_n, seed))


def make_split(
    name: str,
    n: int,
    seed: int = 0,
    *,
    train_n: int = DEFAULT_TRAIN_N,
    offset: int = 0,
) -> list[tuple[str, str, str]]:
    """``n`` examples ``(task, prompt, answer)`` of split ``name`` ("train" or "heldout").

    Tasks cycle round-robin. "heldout" uses its own seed stream, has no duplicate prompts and
    excludes every prompt of ``make_split("train", train_n, seed)``; it returns the stream's
    examples ``[offset, offset + n)``, so non-overlapping slices never share a prompt.
    Raises ``ValueError`` for an unknown split name, a negative ``n`` or ``offset``, or an
    ``offset`` with the "train" split.
    """
    if name not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {name!r}")
    if n < 0 or offset < 0:
        raise ValueError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    if offset and name != "heldout":
        raise ValueError("offset applies to the 'heldout' split only")
    if name == "train":
        rng = _stream("train", seed)
        out = []
        for i in range(n):
            task = TASKS[i % len(TASKS)]
            prompt, ans = sample(task, rng)
            out.append((task, prompt, ans))
        return out
    if name == "heldout":
        banned = _train_prompts(train_n, seed)
        rng = _stream("heldout", seed)
        out, seen = [], set()
        i = 0
        while len(out) < offset + n:
            task = TASKS[i % len(TASKS)]
            for _ in range(10_000):
                prompt, ans = sample(task, rng)
                if prompt not in banned and prompt not in seen:
                    break
            else:  # pragma: no cover - the prompt spaces are far larger than the train split
                raise RuntimeError(f"could not draw a fresh held-out prompt for {task}")
            seen.add(prompt)
            out.append((task, prompt, ans))
            i += 1
        return out[offset:]
