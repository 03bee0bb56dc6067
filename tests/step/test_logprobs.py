"""Log-probabilities of the committed tokens (`mixed_step.logprobs`, `Engine` with `Request.logprobs`): taken from the
denoise step whose argmax canvas was committed, at temperature 1, aligned with each event's tokens, and never a
batch mate's (vLLM issue 45689's class): each request's logprobs in a mixed batch equal its run alone, bitwise."""

import math

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_runtime import Engine, Request
from dgemma_compile.step.mixed_step import logprobs
from dgemma_compile.inputs.text import encode_prompt

SLOTS = 256
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="


def test_logprobs_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 30, generator=g) * 4
    tokens = torch.randint(0, 30, (2, 5), generator=g)
    token, ids, top = logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(token, ref.gather(-1, tokens[..., None])[..., 0])
    want_top, want_ids = ref.topk(3, dim=-1)
    torch.testing.assert_close(top, want_top)
    assert torch.equal(ids, want_ids)
    assert logprobs(logits, tokens, 0)[1].shape == (2, 5, 0)


def _run(model, tok, specs, rows: int):
    engine = Engine(model, RowTable(model, range(1, rows + 1), max_seq_len=SLOTS, max_denoising_steps=64,
                                  max_logprobs=5), tokenizer=tok)
    events = {}
    reqs = []
    for k, (text, cfg, seed, lp) in enumerate(specs):
        events[k] = []
        reqs.append(engine.submit(Request(prompt=encode_prompt(tok, text, bos_token_id=model.config.bos_token_id),
                                          config=cfg, seed=seed, logprobs=lp, on_event=events[k].append)))
        engine.step()
    while not engine.idle():
        engine.step()
    return reqs, events


@pytest.mark.slow
def test_engine_logprobs_are_each_requests_own(demo):
    """Four requests (two with logprobs: top 5 and top 2, one without, one at temperature 0) staggered into 3 rows:
    each event's logprobs align with its tokens, the committed token is the step's most likely one (argmax of the
    scaled logits = argmax at temperature 1), alternatives are sorted and below 1 in total; each request's logprobs
    equal its run alone, bitwise."""
    model, tok = demo
    base = model.generation_config
    specs = [(REV, base, 0, 5), ("sort 3 1 2 9 5=", base.with_temperature(0), 1, 2), ("add 123+045=", base, 2, None),
             (REV, base.replace(max_denoising_steps=2), 3, 5)]
    reqs, events = _run(model, tok, specs, rows=3)
    for k, (r, spec) in enumerate(zip(reqs, specs)):
        lp = spec[3]
        blocks = [e for e in events[k] if not e.draft]
        if lp is None:
            assert all(e.logprobs is None for e in blocks)
            continue
        got = [x for e in blocks for x in e.logprobs]
        assert len(got) == len(r.sequence) == sum(len(e.tokens) for e in blocks)
        for token, (logp, top) in zip(r.sequence, got):
            assert len(top) == lp and top[0][0] == token and top[0][1] == logp <= 0
            assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
            assert sum(math.exp(p) for _, p in top) <= 1 + 1e-5
        alone, alone_events = _run(model, tok, [spec], rows=1)
        assert alone[0].sequence == r.sequence
        assert [x for e in alone_events[0] if not e.draft for x in e.logprobs] == got, f"request {k}"


def test_logprobs_above_the_bucket_are_refused(demo):
    model, tok = demo
    engine = Engine(model, RowTable(model, (1,), max_seq_len=SLOTS, max_denoising_steps=64, max_logprobs=2))
    with pytest.raises(dg.ConfigError, match=r"top_logprobs: must be an integer in \[0, 2\]"):
        engine.submit(Request(prompt=[2, 5], config=model.generation_config, seed=0, logprobs=3))
    assert engine.queue_depth == 0
