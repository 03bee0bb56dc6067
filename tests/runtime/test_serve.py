"""The serving runtime (`runtime/`, imported as `dgemma_runtime`): the engine against the generators, and the
OpenAI-compatible server on loopback through the official `openai` client.

Fast tier: the engine over the eager step (`row_table.RowTable`, moe "dense": batch-invariant rows) against `dg.generate`, and
the HTTP behaviour (refusals, queue limit, disconnect, metrics) against eager servers. Slow tier: one compiled bucket
of 8 rows shared by the module (`demo_serve`), whose answers must equal `gen.generate`'s on the same bucket alone and
among 16 concurrent requests, and `dgemma serve` as a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import dgemma_compile as dg
from dgemma_compile.demo import tasks
from dgemma_compile.step.row_table import RowTable
from dgemma_runtime import Engine, Request, build_engine
from dgemma_compile.inputs.text import encode_prompt
from helpers import wait_for_health

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from dgemma_runtime.http.metrics import ServeMetrics  # noqa: E402
from dgemma_runtime.http.server import choice_seed, create_app  # noqa: E402

MODEL = "dgemma-demo"
SLOTS = 256
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="  # answer "1 0 9 8 7 6 5 4 3 2 1": blocks "1 0 9 8 7 6 5 4 " and "3 2 1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `create_app(engine, ..., **app_kw)` on a loopback port in a daemon thread, with the engine
    running."""

    def __init__(self, engine: Engine, tokenizer, metrics: ServeMetrics | None = None, **app_kw):
        self.engine, self.tok, self.port = engine, tokenizer, _free_port()
        app = create_app(engine, model_name=MODEL, tokenizer=tokenizer, metrics=metrics, **app_kw)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **kw)


@contextlib.contextmanager
def eager_demo_server(demo, max_batch: int = 4):
    """A `ServerThread` over an eager engine of the demo model (`max_seq_len=SLOTS`): the module-scoped server of
    the tests that check the HTTP surface rather than the compiled step."""
    model, tok = demo
    engine = build_engine(model, max_batch=max_batch, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    with ServerThread(engine, tok) as srv:
        yield srv


def _ids(tok, model, text: str) -> list[int]:
    return encode_prompt(tok, text, bos_token_id=model.config.bos_token_id)


def _run_engine(engine: Engine) -> None:
    while not engine.idle():
        engine.step()


# ----- the engine, eager ----------------------------------------------------------------------------------------
def _eager_bucket(model, rows: int, body: str) -> RowTable:
    """An eager bucket of `rows` rows stepping at every batch size 1..rows, commits "separate" or "fused"."""
    return RowTable(model, range(1, rows + 1), max_seq_len=SLOTS, max_denoising_steps=64, fuse_commit=body == "fused")


BODIES = ["separate", pytest.param("fused", marks=pytest.mark.slow)]
"""Commits separate (the CPU default) and fused (rows of 2C tokens), the latter in the slow tier."""


@pytest.mark.slow
@pytest.mark.parametrize("body", BODIES)
def test_engine_staggered_admission_equals_generate(demo, body):
    """Requests admitted at different iterations into 3 rows (7 requests: rows are reused, and the step runs at
    batch sizes 1, 2 and 3 as rows come and go), with different budgets, step limits and temperatures, give exactly
    `dg.generate`'s tokens and steps per block of each request run alone; with commit fusion the reference is
    `generate(fuse_commit=True)` (a 1-step budget makes a fused commit end its block at once)."""
    model, tok = demo
    base = model.generation_config
    specs = [(REV, base, 0), ("sort 3 1 2 9 5=", base.with_temperature(0), 1), ("add 123+045=", base, 2),
             ("dedup 3 1 3 2=", base.replace(max_new_tokens=3), 3), (REV, base.replace(max_denoising_steps=3), 4),
             ("rev 4 4 1=", base.with_temperature(2.0), 5), (REV, base.replace(max_denoising_steps=1), 6)]
    engine = Engine(model, _eager_bucket(model, 3, body), tokenizer=tok)
    reqs = []
    for k, (text, cfg, seed) in enumerate(specs):
        reqs.append(engine.submit(Request(prompt=_ids(tok, model, text), config=cfg, seed=seed)))
        for _ in range(k % 3):
            engine.step()
    _run_engine(engine)
    fused = body == "fused"
    fused_commits = 0
    for r, (text, cfg, seed) in zip(reqs, specs):
        ref = dg.generate(model, [r.prompt], cfg, seed=seed, moe_impl="dense", max_seq_len=SLOTS, fuse_commit=fused)
        assert r.sequence == ref.sequences[0], text
        assert r.stats.steps_per_block == ref.stats[0].steps_per_block
        assert r.stats.finish_reason == ref.stats[0].finish_reason
        fused_commits += ref.fused_commits
    st = engine.stats
    assert st.flag_reads == st.forwards and st.requests == {"eos": 6, "length": 1}
    assert st.tokens == sum(r.stats.num_tokens for r in reqs)
    assert st.forwards <= st.iterations and len(st.forwards_by_size) > 1  # sizes change as rows come and go
    assert engine.row_table.tokens_per_row == (2 if fused else 1) * model.config.canvas_length
    assert fused_commits == (3 if fused else 0)  # the references fused (or not) as many commits


@pytest.mark.parametrize("body", BODIES)
def test_engine_events_stop_cancel_and_refusals(demo, body):
    """One event per finished block, text never holding a stop string across the block boundary; a cancelled
    request frees its row at the next iteration; a bad request is refused at submit and changes nothing. Mixed: the
    host retires a row the device would have committed (stop string, cancel)."""
    model, tok = demo
    cfg = model.generation_config
    engine = Engine(model, _eager_bucket(model, 2, body), tokenizer=tok)
    events = []
    stop = engine.submit(Request(prompt=_ids(tok, model, REV), config=cfg, seed=0, stops=("4 3",),
                                 on_event=events.append))
    with pytest.raises(dg.ConfigError, match="max_seq_len"):
        engine.submit(Request(prompt=_ids(tok, model, "sort 1 2="), config=cfg.replace(max_new_tokens=400), seed=0))
    with pytest.raises(dg.ConfigError, match="context"):
        engine.submit(Request(prompt=[2] + [5] * 600, config=cfg, seed=0))
    gone = engine.submit(Request(prompt=_ids(tok, model, REV), config=cfg, seed=1))
    engine.step()
    engine.cancel(gone)
    engine.step()
    assert gone.stats.finish_reason == "cancelled" and engine.running == 1
    _run_engine(engine)
    assert [e.text for e in events] == ["1 0 9 8 7 6 5 ", ""]
    assert [e.finish_reason for e in events] == [None, "stop"]
    assert events[-1].completion_tokens == len("1 0 9 8 7 6 5 ")
    assert engine.stats.requests == {"stop": 1, "cancelled": 1}


@pytest.mark.parametrize("body", BODIES)
def test_engine_draft_events(demo, body):
    """draft_every=1: a draft event after every denoise step of each block still in flight (its step and block, the
    canvas cut at eos), before that block's own event; drafts change nothing else (same tokens and block events as
    without them); a bad draft_every is refused at submit."""
    model, tok = demo
    cfg = model.generation_config
    runs = {}
    for k in (0, 1):
        engine = Engine(model, _eager_bucket(model, 2, body), tokenizer=tok)
        events = []
        req = engine.submit(Request(prompt=_ids(tok, model, REV), config=cfg, seed=0, draft_every=k,
                                    on_event=events.append))
        _run_engine(engine)
        runs[k] = req, events
    (plain, plain_events), (req, events) = runs[0], runs[1]
    assert req.sequence == plain.sequence
    finals = [e for e in events if not e.draft]
    assert [(e.text, e.finish_reason) for e in finals] == [(e.text, e.finish_reason) for e in plain_events]
    drafts = [e for e in events if e.draft]
    assert drafts and not any(e.draft for e in plain_events)
    for block, steps in enumerate(req.stats.steps_per_block):
        mine = [e for e in drafts if e.block == block]
        assert [e.step for e in mine] == list(range(1, steps)), (block, steps)
        last = max(i for i, e in enumerate(events) if e.block == block and e.draft) if mine else None
        assert last is None or not events[last + 1].draft  # the block's own event follows its drafts
    for e in drafts:
        assert e.finish_reason is None and len(e.tokens) <= model.config.canvas_length
        assert not set(e.tokens) & set(cfg.resolved(model.config).eos_token_ids)
        assert e.text == tok.decode(e.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    engine = Engine(model, RowTable(model, (1,), max_seq_len=SLOTS, max_denoising_steps=64), tokenizer=tok)
    with pytest.raises(dg.ConfigError, match="draft_every"):
        engine.submit(Request(prompt=_ids(tok, model, REV), config=cfg, seed=0, draft_every=-1))


# ----- HTTP over eager steps --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eager_server(demo):
    model, tok = demo
    metrics = ServeMetrics()
    engine = build_engine(model, max_batch=4, max_seq_len=SLOTS, eager=True, tokenizer=tok, metrics=metrics)
    with ServerThread(engine, tok, metrics) as srv:
        yield srv


class SlowBucket(RowTable):
    """The eager step slowed down, so that requests are still running when a test acts on them."""

    def __init__(self, *a, delay: float, **kw):
        super().__init__(*a, **kw)
        self.delay = delay

    def view(self, size: int):
        view = super().view(size)
        if not getattr(view, "slowed", False):
            step = view.step
            view.step, view.slowed = (lambda: (time.sleep(self.delay), step())), True
        return view


@pytest.fixture
def slow_server(demo):
    """One row, one queue slot, 0.3 s per denoise step."""
    model, tok = demo
    engine = Engine(model, SlowBucket(model, (1,), max_seq_len=SLOTS, max_denoising_steps=64, delay=0.3),
                    tokenizer=tok, max_queue=1)
    with ServerThread(engine, tok) as srv:
        yield srv


def _post(srv, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "sort 1 2=", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "sort 1 2=", "logprobs": 1, "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "sort 1 2=", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "sort 1 2=", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "sort 1 2=", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "sort 1 2=", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "sort 1 2=", "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "1 " * 300}, 400, "prompt"),
    ("/v1/completions", {"prompt": "sort 1 2=", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "sort 1 2=", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"prompt": "sort 1 2=", "max_denoising_steps": 999}, 400, "max_denoising_steps"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "sort 1 2=", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "add 1+2="}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "add 1+2="}],
                              "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "add 1+2="}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": "sort 1 2=", "draft_every": 2}, 400, "draft_every"),
    ("/v1/completions", {"prompt": "sort 1 2=", "draft_every": 0, "stream": True}, 400, "draft_every"),
])
def test_refusals(eager_server, path, body, status, param):
    """Each refusal is OpenAI-shaped, and the server keeps serving (the last request of the module checks that)."""
    r = _post(eager_server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    if status == 400 and path.endswith("completions") and "300" in json.dumps(body):
        assert err["code"] == "context_length_exceeded"


def test_refusals_speak_the_requests_terms(eager_server):
    """A context-length refusal names max_tokens (a chat's max_completion_tokens when it set that) and counts in
    the request's terms (not the library's max_new_tokens / prompts[0]); a chat text the tokenizer refuses is named by its message, messages[i].content
    (the demo's tokenizer has no 'é'), on /v1/chat/completions and /tokenize alike."""
    prompt = "sort 1 2="
    n = len(eager_server.tok(prompt)["input_ids"])
    err = _post(eager_server, "/v1/completions", {"prompt": prompt, "max_tokens": 300}).json()["error"]
    limit = eager_server.engine.max_seq_len
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert f"context is {limit} tokens" in err["message"] and f"needs {n + 300}: {n} prompt tokens + max_tokens 300" \
        in err["message"] and "max_new_tokens" not in err["message"] and "prompts[0]" not in err["message"]
    # the engine decides: the last block takes no slot, so a request may end within one canvas of the limit
    over = limit - n + 1
    C = eager_server.engine.model.config.canvas_length
    assert n + (math.ceil(over / C) - 1) * C <= limit  # the slots the engine asks for
    r = _post(eager_server, "/v1/completions", {"prompt": prompt, "max_tokens": over})
    assert r.status_code == 200, r.text
    chat = [{"role": "user", "content": "add 1+2="}, {"role": "assistant", "content": "0003"},
            {"role": "user", "content": [{"type": "text", "text": "add 1+\u00e9="}]}]
    for path, body in (("/v1/chat/completions", {"messages": chat}), ("/tokenize", {"messages": chat})):
        r = _post(eager_server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[2].content", (path, r.text)
    r = _post(eager_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    # a chat that sets its budget as max_completion_tokens (OpenAI's newer name) hears that name back
    user = [{"role": "user", "content": prompt}]
    for body, words in (({"max_completion_tokens": 300}, "+ max_completion_tokens 300"),
                        ({"max_completion_tokens": 0}, "must be a positive integer"),
                        ({"max_completion_tokens": 8, "max_tokens": 16}, "differs from max_tokens")):
        err = _post(eager_server, "/v1/chat/completions", {"messages": user, **body}).json()["error"]
        assert err["param"] == "max_completion_tokens" and words in err["message"], (body, err)


def test_openai_client_errors_and_routes(eager_server):
    client = eager_server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="sort 1 2=", logprobs=21)
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(eager_server.url + "/health").json()
    assert health["status"] == "ok" and health["buckets"] == [
        dict(rows=b, tokens_per_row=16, fuse_commit=False, kv="static", unit=f"step[B{b}_P1_stop]", compiled=None,
             step="eager")
        for b in (1, 2, 4)]
    out = client.completions.create(model=MODEL, prompt="sort 3 1 2 9 5=", max_tokens=16, seed=0)
    assert out.choices[0].text == "1 2 3 5 9" and out.choices[0].finish_reason == "stop"
    # usage as a client's tokenizer counts: the prompt with its BOS, the text without the eos that ended it
    assert out.usage.completion_tokens == len(eager_server.tok("1 2 3 5 9", add_special_tokens=False)["input_ids"])
    assert out.usage.prompt_tokens == len(eager_server.tok("sort 3 1 2 9 5=")["input_ids"])
    metrics = httpx.get(eager_server.url + "/metrics").text
    for name in ("dgemma_queue_depth", "dgemma_running_rows", "dgemma_tokens_per_second", "dgemma_tokens_per_forward",
                 "dgemma_steps_per_block", 'dgemma_requests_total{reason="eos"}'):
        assert name in metrics
    assert eager_server.engine.recompiles() == {}


@pytest.mark.parametrize("kw,error", [
    (dict(extra_body={"frobnicate": 1}), "BadRequestError"),
    (dict(max_tokens=0), "BadRequestError"),
    (dict(max_tokens=300), "BadRequestError"),
    (dict(temperature=-1.0), "BadRequestError"),
    (dict(stop=""), "BadRequestError"),
    (dict(extra_body={"max_denoising_steps": 999}), "BadRequestError"),
    (dict(prompt="1 " * 300), "BadRequestError"),
    (dict(model="gpt-4"), "NotFoundError"),
    (dict(echo=True), "BadRequestError"),
    (dict(chat=True, response_format={"type": "xml"}), "BadRequestError"),
    (dict(chat=True, tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"),
     "BadRequestError"),
    (dict(chat=True, top_logprobs=2), "BadRequestError"),
    (dict(logprobs=2, echo=True), "BadRequestError"),
])
def test_openai_client_refusals(eager_server, kw, error):
    """The refusals through the official client: each raises the client's error class for its status, with the
    server's OpenAI-shaped body."""
    client = eager_server.client(max_retries=0)
    kw = {"model": MODEL, **kw}
    with pytest.raises(getattr(openai, error)) as info:
        if kw.pop("chat", False):
            client.chat.completions.create(messages=[{"role": "user", "content": "add 1+2="}], **kw)
        else:
            client.completions.create(**{"prompt": "sort 1 2=", **kw})
    assert info.value.body["message"] and info.value.body["type"]


def test_openai_client_draft_events(eager_server):
    """Streaming with draft_every (an extension through extra_body): draft chunks carry `draft` {text, block, step}
    beside an empty text, so the joined text is the answer's; chat the same; without stream a 400."""
    client = eager_server.client(max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt=REV, seed=0, stream=True,
                                            extra_body={"draft_every": 1}))
    drafts = [c.choices[0].model_extra["draft"] for c in chunks if (c.choices[0].model_extra or {}).get("draft")]
    assert drafts and all(set(d) == {"text", "block", "step"} for d in drafts)
    assert {d["block"] for d in drafts} <= {0, 1} and all(d["step"] >= 1 for d in drafts)
    assert "".join(c.choices[0].text for c in chunks) == "1 0 9 8 7 6 5 4 3 2 1"
    parts = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": REV}], seed=0,
                                                stream=True, extra_body={"draft_every": 1}))
    assert any((p.choices[0].model_extra or {}).get("draft") for p in parts)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "1 0 9 8 7 6 5 4 3 2 1"
    with pytest.raises(openai.BadRequestError, match="draft_every"):
        client.completions.create(model=MODEL, prompt=REV, extra_body={"draft_every": 1})


def test_nonstreaming_disconnect_frees_row(slow_server):
    """A non-streaming client (the official client) that gives up mid-request: the server notices the closed
    connection (it polls every 0.5 s) and cancels the request, which frees its row at the next iteration."""
    engine = slow_server.engine
    client = slow_server.client(max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt=REV, seed=0)
    deadline = time.time() + 10
    while engine.stats.requests["cancelled"] == 0 or engine.running:
        assert time.time() < deadline, engine.stats
        time.sleep(0.05)
    assert engine.stats.requests == {"cancelled": 1} and engine.stats.iterations < 30


@pytest.mark.slow
def test_queue_full_429_and_disconnect_frees_row(slow_server):
    """A full queue answers 429 (and disturbs no one); a client that disconnects mid-stream has its request cancelled
    and its row freed at the next iteration."""
    engine = slow_server.engine
    with httpx.stream("POST", slow_server.url + "/v1/completions", timeout=30,
                      json={"prompt": REV, "stream": True, "seed": 0}) as r:
        lines = r.iter_lines()
        while engine.running == 0:
            time.sleep(0.01)
        queued = threading.Thread(target=_post, args=(slow_server, "/v1/completions", {"prompt": "sort 2 1=",
                                                                                         "seed": 0}))
        queued.start()
        while engine.queue_depth == 0:
            time.sleep(0.01)
        full = slow_server.client(max_retries=0)
        with pytest.raises(openai.RateLimitError):
            full.completions.create(model=MODEL, prompt="sort 1 2=")
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["text"] == "1 0 9 8 7 6 5 4 "
    # the stream is closed after its first block: the request is cancelled, the queued one then runs
    queued.join(30)
    deadline = time.time() + 10
    while engine.stats.requests["cancelled"] == 0 or engine.running:
        assert time.time() < deadline, engine.stats
        time.sleep(0.05)
    assert engine.stats.requests == {"cancelled": 1, "eos": 1}


# ----- one compiled bucket ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_serve(demo):
    """(server, gen, references): one compiled bucket of 8 rows stepping at batch sizes 1 and 8, serving the demo;
    `references[(prompt, seed, kw)]` is the eager oracle's text for that request alone (`dg.generate` with the
    generator's experts implementation), and `gen.generate` of each request alone on the same bucket must agree."""
    from dgemma_compile.compile import CompileOptions, build
    from dgemma_compile.inputs.text import Detokenizer

    model, tok = demo
    gen = build(model, CompileOptions(batch_buckets=(1, 8), max_seq_len=SLOTS, fuse_commit=False))
    cases = _cases()
    refs = {}
    for text, seed, kw in cases:
        cfg = _config(model, **kw)
        out = dg.generate(model, [_ids(tok, model, text)], cfg, seed=seed, moe_impl=gen.moe_impl, max_seq_len=SLOTS)
        assert gen.generate([_ids(tok, model, text)], cfg, seed=seed).sequences == out.sequences, text
        detok = Detokenizer(tok)
        detok.push(out.sequences[0])
        detok.finish()
        refs[(text, seed, tuple(sorted(kw.items())))] = (detok.text, out.stats[0])
    metrics = ServeMetrics()
    engine = build_engine(model, max_batch=8, max_seq_len=SLOTS, tokenizer=tok, metrics=metrics, generator=gen)
    with ServerThread(engine, tok, metrics) as srv:
        yield srv, gen, refs
    assert engine.recompiles() == {}
    assert dict(gen.ready) == {"step[B1_P1_stop]": 1, "step[B8_P1_stop]": 1}
    # one forward per iteration, at batch 1 while a lone request runs and at 8 under concurrency
    assert 0 < engine.stats.forwards <= engine.stats.iterations and set(engine.stats.forwards_by_size) == {1, 8}


def _config(model, temperature=None, max_tokens=None, max_denoising_steps=None):
    cfg = model.generation_config
    if max_tokens is not None:
        cfg = cfg.replace(max_new_tokens=max_tokens)
    if max_denoising_steps is not None:
        cfg = cfg.replace(max_denoising_steps=max_denoising_steps)
    return cfg.with_temperature(temperature) if temperature is not None else cfg


def _cases() -> list[tuple[str, int, dict]]:
    prompts = [tasks.sample(tasks.TASKS[i % 4], random.Random(i))[0] for i in range(13)] + [REV, "sort 3 1 2 9 5="]
    variants = [{}, {"temperature": 0}, {"max_tokens": 4}, {"max_denoising_steps": 4}, {"temperature": 0.5}]
    return [(p, 100 + i, variants[i % len(variants)]) for i, p in enumerate(prompts)] + \
        [(p, 7, {}) for p in prompts[:1]]


def _complete(client, text, seed, kw, **extra):
    body = {k: v for k, v in kw.items() if k in ("temperature", "max_tokens")}
    extra_body = {k: v for k, v in kw.items() if k == "max_denoising_steps"} or None
    return client.completions.create(model=MODEL, prompt=text, seed=seed, extra_body=extra_body, **body, **extra)


@pytest.mark.slow
def test_compiled_bucket(demo_serve):
    """Every check on the compiled bucket in one test, so that pytest-xdist never compiles it in two workers."""
    _alone_and_concurrent_equal_generate(*demo_serve)
    _streaming_chat_n_and_stop(*demo_serve)


@pytest.mark.slow
def test_compiled_fused_mixed_step(demo):
    """The mixed step compiled with commit fusion (a generator built with `fuse_commit=True`: its bucket's cache has
    2C block slots, the unit runs rows of 2C tokens) over two rows, staggered requests of the demo: each request's
    tokens and steps per block equal its solo eager `generate(fuse_commit=True)` run with the generator's experts
    implementation (the compiled generator equals eager token for token on the demo); no recompile after the first
    call."""
    from dgemma_compile.compile import CompileOptions, build

    model, tok = demo
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=SLOTS, fuse_commit=True))
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, tokenizer=tok, generator=gen)
    assert engine.row_table.fuse_commit and [v.name for v in engine.row_table.views()] == ["step[B2_P1_stop]"]
    base = model.generation_config
    specs = [(REV, base, 0), ("sort 3 1 2 9 5=", base.with_temperature(0), 1), (REV, base.with_temperature(2.0), 2),
             ("dedup 3 1 3 2=", base.replace(max_new_tokens=3), 3), (REV, base.replace(max_denoising_steps=1), 4)]
    reqs = []
    for k, (text, cfg, seed) in enumerate(specs):
        reqs.append(engine.submit(Request(prompt=_ids(tok, model, text), config=cfg, seed=seed)))
        engine.step()
    _run_engine(engine)
    fused_commits = 0
    for r, (text, cfg, seed) in zip(reqs, specs):
        ref = dg.generate(model, [r.prompt], cfg, seed=seed, moe_impl=gen.moe_impl, max_seq_len=SLOTS,
                          fuse_commit=True)
        assert (r.sequence, r.stats.steps_per_block) == (ref.sequences[0], ref.stats[0].steps_per_block), text
        fused_commits += ref.fused_commits
    assert fused_commits >= 3 and engine.recompiles() == {}


def _alone_and_concurrent_equal_generate(srv, gen, refs):
    """Each request alone, then all 16 at once (more than the 8 rows: some wait and are admitted mid-flight), gives
    exactly the reference's text; the demo's answers are right."""
    client = srv.client()
    cases = _cases()
    expected = [refs[(t, s, tuple(sorted(kw.items())))][0] for t, s, kw in cases]
    alone = [_complete(client, t, s, kw).choices[0].text for t, s, kw in cases]
    assert alone == expected
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda c: _complete(client, *c).choices[0].text, cases))
    assert together == expected
    for (t, _, kw), text in zip(cases, together):
        if not kw or kw.get("temperature") == 0:
            assert tasks.check(t, text), (t, text)


def _streaming_chat_n_and_stop(srv, gen, refs):
    client = srv.client()
    # streaming: one event per block, the same text as the reference
    chunks = list(client.completions.create(model=MODEL, prompt=REV, seed=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == ["1 0 9 8 7 6 5 4 ", "3 2 1"]
    assert chunks[-1].usage.completion_tokens == len("1 0 9 8 7 6 5 4 3 2 1")  # the eos not counted
    # a stop string across the block boundary never shows, streamed or not
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=REV, seed=0, stop=["4 3"], stream=stream)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == "1 0 9 8 7 6 5 "
    # chat through the demo's template (BOS + the messages' text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sort 3 1 2 9 5="}],
                                          seed=3)
    assert chat.choices[0].message.content == "1 2 3 5 9" and chat.choices[0].finish_reason == "stop"
    parts = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": REV}], seed=3,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "1 0 9 8 7 6 5 4 3 2 1"
    # n > 1: each choice its own stream; the same seed repeats every choice; choice 0 is the n=1 request
    # (an unpadded sum, outside the demo's training format, and one step per block: answers that vary with the seed)
    kw = dict(model=MODEL, prompt="add 9+9=", seed=11, temperature=3.0, max_tokens=6,
              extra_body={"max_denoising_steps": 1})
    a, b = client.completions.create(n=3, **kw), client.completions.create(n=3, **kw)
    one = client.completions.create(**kw)
    ca = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert ca == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert ca[0] == one.choices[0].text and len(set(ca)) > 1
    assert choice_seed(11, 0) == 11


@pytest.mark.slow
def test_cli_serve_subprocess(tmp_path):
    """`dgemma serve` (eager steps: HTTP behaviour only; commit fusion asked for) answers the openai client, prints
    its bucket table and exits on SIGINT."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_compile.cli", "serve", "--eager", "--port", str(port),
                             "--max-batch", "2", "--max-seq-len", str(SLOTS), "--fuse-commit", "on"],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(proc, port, timeout_s=60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        out = client.completions.create(model=MODEL, prompt="add 123+045=", seed=0)
        assert out.choices[0].text == "0168"
    finally:
        proc.send_signal(2)
        _, err = proc.communicate(timeout=30)
    assert "serving dgemma-demo" in err
    assert "bucket rows=1 tokens_per_row=32 fuse_commit=on kv=static unit=step[B1_P1_stop] compiled=eager" in err
    assert "bucket rows=2 tokens_per_row=32 fuse_commit=on kv=static unit=step[B2_P1_stop] compiled=eager" in err
