"""bench/ar.py's autoregressive baseline: greedy tokens against a reference loop over the public passes
(`dg.encode` one token at a time, `model.logits`, argmax), eagerly and compiled (its units compile a forward over
plans held in buffers, whose mask tensors are graph inputs)."""

from __future__ import annotations

import pytest
import torch

import dgemma_compile as dg
from bench.ar import ARBaseline


def _reference(model, prompts: list[list[int]], n: int, S: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        cache = model.new_cache(1, S)
        hidden = dg.encode(model, torch.tensor([prompt]), cache)
        seq = []
        for _ in range(n):
            tok = int(model.logits(hidden[:, -1]).argmax(-1))
            seq.append(tok)
            hidden = dg.encode(model, torch.tensor([[tok]]), cache)
        out.append(seq)
    return out


PROMPTS = [[2, 5, 9, 11, 3, 7], [2, 8, 4]]


@pytest.fixture(scope="module")
def tiny16_dir(tmp_path_factory):
    """The tiny checkpoint with a 16-token canvas: the AR prefill chunk is one canvas, and torch 2.13's CPU
    FlexAttention template computes 8-token chunks wrong (NaN) on AVX2-only hosts, not on every run
    (docs/testing.md, 2026-12-07); no DiffusionGemma canvas is 8 tokens."""
    from helpers import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tiny16"), vocab_size=48, canvas_length=16,
                            layer_types=("sliding_attention", "sliding_attention", "full_attention"))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_ar_baseline_is_greedy_decoding(tiny16_dir, compiled):
    model = dg.load(tiny16_dir)
    S = 64
    ar = ARBaseline(model, batch=len(PROMPTS), max_seq_len=S, compiled=compiled)
    with torch.no_grad():
        got = ar.generate(PROMPTS, max_new_tokens=5)
        expected = _reference(model, PROMPTS, 5, S)
    assert got == expected
    assert ar.compiles == (2 if compiled else 0)
