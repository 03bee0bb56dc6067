"""Logprobs through `dgemma serve` (`server.py`, "Logprobs"): completions `logprobs: k` and chat `logprobs` +
`top_logprobs` in the shapes the official `openai` client parses, with the values of the engine's `BlockEvent.logprobs`
for the same request run directly, covering exactly the tokens `usage.completion_tokens` counts (the eos that ended
the answer has no entry; at a stop string, the tokens behind the returned text); streamed == non-streamed; `n` = 2;
concurrent requests with and without logprobs each equal to the same request alone (a batch mate's never land in
another's); the refusals (echo with logprobs, over `--max-logprobs`, `top_logprobs` without `logprobs`); and
`dgemma serve --max-logprobs` reaching `build_engine`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from dgemma_runtime import Request, build_engine
from dgemma_compile.inputs.text import encode_chat, encode_prompt

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from dgemma_runtime.http.server import choice_seed  # noqa: E402
from test_serve import MODEL, REV, SLOTS, ServerThread, _post  # noqa: E402
from test_serve_protocol import _stream  # noqa: E402

USER = [{"role": "user", "content": REV}]

pytestmark = pytest.mark.slow  # HTTP round trips through an eager server: ~5 s in all


@pytest.fixture(scope="module")
def server(demo):
    model, tok = demo
    engine = build_engine(model, max_batch=4, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    assert engine.max_logprobs == 20  # build_engine's default, vLLM's
    with ServerThread(engine, tok) as srv:
        yield srv


def _direct(srv, prompt: list[int], seed: int, k: int, stops: tuple[str, ...] = (), **changes) -> list:
    """The entries (log p, [(id, log p)] * k) of the same request run directly through the server's engine (its
    config with `changes`): its block events' `logprobs`, cut to the tokens usage counts (without the eos that
    ended it)."""
    events, done = [], threading.Event()

    def on_event(e):
        events.append(e)
        if e.finish_reason is not None:
            done.set()

    srv.engine.submit(Request(prompt=prompt, config=srv.engine.config.replace(**changes), seed=seed, stops=stops,
                              logprobs=k, on_event=on_event))
    assert done.wait(120)
    blocks = [e for e in events if not e.draft]
    entries = [x for e in blocks for x in e.logprobs]
    assert len(entries) == sum(len(e.tokens) for e in blocks)
    last = blocks[-1]
    return entries[:last.completion_tokens - (last.finish_reason == "eos")]


def _ids(demo, text: str) -> list[int]:
    model, tok = demo
    return encode_prompt(tok, text, bos_token_id=model.config.bos_token_id)


def _chat_ids(demo, messages) -> list[int]:
    model, tok = demo
    return encode_chat(tok, messages, bos_token_id=model.config.bos_token_id)


def _s(tok, t: int) -> str:
    return tok.decode([t])


def test_completions_logprobs_openai_client(server, demo):
    """`logprobs=2` through the official client: the legacy shape parses (tokens, token_logprobs, top_logprobs,
    text_offset), one entry per token usage counts (the ending eos has none), the tokens' strings join into the text
    (a character tokenizer), each token is its step's most likely (temperature 1, the argmax committed), and the
    values equal the engine's for the same request."""
    _, tok = demo
    client = server.client(max_retries=0)
    out = client.completions.create(model=MODEL, prompt=REV, seed=0, logprobs=2)
    c = out.choices[0]
    assert c.text == "1 0 9 8 7 6 5 4 3 2 1" and c.finish_reason == "stop"
    lp = c.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == c.text and tok.eos_token not in lp.tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(n)]
    direct = _direct(server, _ids(demo, REV), 0, 2)
    assert len(direct) == n
    for token, logp, top, (want, alternatives) in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, direct):
        assert logp == want <= 0
        assert top == {_s(tok, t): p for t, p in alternatives}  # k = 2 entries, the token itself among them
        assert len(top) == 2 and top[token] == logp == max(top.values())


def test_chat_logprobs_openai_client(server, demo):
    """`logprobs=True, top_logprobs=3` through the official client: OpenAI's ChoiceLogprobs parses (content: token,
    logprob, bytes, top_logprobs of 3; refusal null), one entry per counted token, equal to the engine's."""
    _, tok = demo
    client = server.client(max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=USER, seed=1, logprobs=True, top_logprobs=3)
    c = out.choices[0]
    assert c.message.refusal is None and c.logprobs.refusal is None
    content = c.logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(x.token for x in content) == c.message.content
    direct = _direct(server, _chat_ids(demo, USER), 1, 3)
    assert len(direct) == len(content)
    for x, (want, alternatives) in zip(content, direct):
        assert x.logprob == want and x.bytes == list(x.token.encode())
        assert [(a.token, a.logprob) for a in x.top_logprobs] == [(_s(tok, t), p) for t, p in alternatives]
        assert len(x.top_logprobs) == 3 and x.top_logprobs[0].token == x.token
        assert all(a.bytes == list(a.token.encode()) for a in x.top_logprobs)


def _joined(chunks: list, chat: bool) -> dict:
    """A stream's text and logprobs entries joined (per choice 0), from raw JSON chunks; each chunk's tokens join
    into its own text (a character tokenizer: the entries go with the text they are behind)."""
    text, entries = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    content = []
    for chunk in chunks:
        for c in chunk["choices"]:
            if "draft" in c:
                assert c["logprobs"] is None
                continue
            if chat and "role" in c["delta"]:
                assert c["logprobs"] is None
                continue
            piece = c["delta"]["content"] if chat else c["text"]
            text += piece
            if chat:
                assert c["logprobs"]["refusal"] is None
                content += c["logprobs"]["content"]
                assert "".join(x["token"] for x in c["logprobs"]["content"]) == piece
            else:
                for key in entries:
                    entries[key] += c["logprobs"][key]
                assert "".join(c["logprobs"]["tokens"]) == piece
    return {"text": text, "logprobs": {"content": content, "refusal": None} if chat else entries}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["completions", "completions-stop", "chat"])
def test_streamed_equals_non_streamed(server, demo, case):
    """The entries of a stream's chunks joined equal the non-streamed response's (draft chunks and the role chunk
    carry null). With a stop string spanning the two blocks ("4 3"), the first chunk holds back "4 " and the
    tokens behind it: the entries cover exactly the returned text (= usage's completion_tokens)."""
    chat = case == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2} if chat else {"prompt": REV, "logprobs": 3}
    body["seed"] = 4
    if case == "completions-stop":
        body["stop"] = "4 3"
    plain = _post(server, path, body).json()
    choice = plain["choices"][0]
    events = _stream(server, path, {**body, "stream": True, "draft_every": 2,
                                    "stream_options": {"include_usage": True}})
    chunks = [e for e in events[:-1] if e["choices"]]
    got = _joined(chunks, chat)
    assert got["text"] == (choice["message"]["content"] if chat else choice["text"])
    assert got["logprobs"] == choice["logprobs"]
    n = plain["usage"]["completion_tokens"]
    assert events[-2]["usage"]["completion_tokens"] == n
    assert len(got["logprobs"]["content"] if chat else got["logprobs"]["tokens"]) == n
    if case == "completions-stop":
        assert choice["text"] == "1 0 9 8 7 6 5 " and choice["finish_reason"] == "stop" and n == 14
        first = next(c["choices"][0] for c in chunks if "draft" not in c["choices"][0])
        assert first["text"] == "1 0 9 8 7 6 5 " and len(first["logprobs"]["tokens"]) == 14
        direct = _direct(server, _ids(demo, REV), 4, 3, stops=("4 3",))
        assert choice["logprobs"]["token_logprobs"] == [p for p, _ in direct]


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_n2_each_choice_its_own(server, demo, chat):
    """n=2: each choice's entries are its own row's: equal to its seed's (`choice_seed`) request run directly
    (one denoise step per block, so that the entries differ between the seeds; with converged blocks the demo
    model's last step is the same for both)."""
    _, tok = demo
    client = server.client(max_retries=0)
    if chat:
        out = client.chat.completions.create(model=MODEL, messages=USER, seed=9, n=2, logprobs=True, top_logprobs=1,
                                             extra_body={"max_denoising_steps": 1})
        got = [[(x.logprob, [(a.token, a.logprob) for a in x.top_logprobs]) for x in c.logprobs.content]
               for c in out.choices]
        prompt = _chat_ids(demo, USER)
    else:
        out = client.completions.create(model=MODEL, prompt=REV, seed=9, n=2, logprobs=1,
                                        extra_body={"max_denoising_steps": 1})
        got = [[(p, list(top.items())) for p, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs)]
               for c in out.choices]
        prompt = _ids(demo, REV)
    assert [c.index for c in out.choices] == [0, 1]
    for i, entries in enumerate(got):
        want = [(p, [(_s(tok, t), q) for t, q in top]) for p, top in _direct(server, prompt, choice_seed(9, i), 1,
                                                                      max_denoising_steps=1)]
        assert entries == want, f"choice {i}"
    assert got[0] != got[1]


MIXED = [  # one denoise step per block where the entries would otherwise not tell the seeds apart
    ("/v1/completions", {"prompt": REV, "seed": 11, "logprobs": 2, "max_denoising_steps": 1}),
    ("/v1/completions", {"prompt": "sort 3 1 2 9 5=", "seed": 12}),
    ("/v1/chat/completions", {"messages": USER, "seed": 13, "logprobs": True, "top_logprobs": 3,
                              "max_denoising_steps": 1}),
    ("/v1/completions", {"prompt": "add 123+045=", "seed": 14, "logprobs": 0, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 3 1 2 9 5="}], "seed": 15}),
    ("/v1/completions", {"prompt": REV, "seed": 16, "logprobs": 5, "stream": True, "max_denoising_steps": 1}),
    ("/v1/completions", {"prompt": REV, "seed": 17, "logprobs": 2, "n": 2, "max_denoising_steps": 1}),
]


def _answer(srv, path: str, body: dict):
    if body.get("stream"):
        events = _stream(srv, path, body)
        return _joined([e for e in events[:-1] if e["choices"]], "messages" in body)
    r = _post(srv, path, body)
    assert r.status_code == 200, r.text
    out = r.json()
    return {"choices": out["choices"], "usage": out["usage"]}


@pytest.mark.slow
def test_mixed_batch_each_request_its_own(server):
    """Concurrent requests with and without logprobs (k 0, 2, 3, 5; chat and completions; n=2; a stream) share the
    engine's rows; each answer, logprobs included, equals the same request sent alone."""
    with ThreadPoolExecutor(len(MIXED)) as pool:
        together = list(pool.map(lambda case: _answer(server, *case), MIXED))
    alone = [_answer(server, *case) for case in MIXED]
    same_prompt = [a["choices"][0]["logprobs"]["token_logprobs"] for a, (_, b) in zip(alone, MIXED)
                   if b.get("prompt") == REV and "choices" in a]
    assert len(same_prompt) == 2 and same_prompt[0] != same_prompt[1]  # a swap would show
    for (path, body), a, b in zip(MIXED, together, alone):
        assert a == b, (path, body)
        if "choices" in a:
            asked = body.get("logprobs") is not None and body["logprobs"] is not False  # k = 0 asks too
            assert all((c["logprobs"] is not None) == asked for c in a["choices"])


@pytest.mark.slow
@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/completions", {"prompt": REV, "logprobs": 1, "echo": True}, "echo", "causally"),
    ("/v1/completions", {"prompt": REV, "logprobs": 0, "echo": True}, "echo", "prompt's logprobs"),
    ("/v1/completions", {"prompt": REV, "logprobs": 21}, "logprobs", "0 to 20"),
    ("/v1/completions", {"prompt": REV, "logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": REV, "logprobs": True}, "logprobs", "integer"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs",
     "logprobs: true"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 1}, "logprobs", "boolean"),
])
def test_refusals(server, path, body, param, says):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and says in err["message"]


def test_openai_client_echo_refused(server):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=REV, logprobs=2, echo=True)
    assert info.value.body["param"] == "echo" and "causally" in info.value.body["message"]


def test_neutral_values_give_no_logprobs(server):
    """`logprobs` null / false and `top_logprobs` 0 without logprobs: accepted, no logprobs in the answer."""
    for path, body in [("/v1/completions", {"prompt": REV, "logprobs": None}),
                       ("/v1/chat/completions", {"messages": USER, "logprobs": False, "top_logprobs": 0}),
                       ("/v1/chat/completions", {"messages": USER, "top_logprobs": 0})]:
        r = _post(server, path, {**body, "seed": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None


@pytest.fixture(scope="module")
def server0(demo):
    """A server with --max-logprobs 0: the returned tokens' own logprobs only."""
    model, tok = demo
    engine = build_engine(model, max_batch=1, max_seq_len=SLOTS, eager=True, tokenizer=tok, max_logprobs=0)
    with ServerThread(engine, tok) as srv:
        yield srv


def test_max_logprobs_zero(server0, demo):
    """--max-logprobs 0: any k > 0 is a 400 naming the field and the limit; k = 0 gives the tokens' own log p
    (completions: each top_logprobs dict the token alone, as vLLM; chat: empty top_logprobs lists)."""
    assert server0.engine.max_logprobs == 0
    for path, body, param in [("/v1/completions", {"prompt": REV, "logprobs": 1}, "logprobs"),
                              ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 1},
                               "top_logprobs")]:
        r = _post(server0, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "--max-logprobs is 0" in err["message"] and "0 to 0" in err["message"]
    out = _post(server0, "/v1/completions", {"prompt": REV, "logprobs": 0, "seed": 0}).json()["choices"][0]
    lp = out["logprobs"]
    assert "".join(lp["tokens"]) == out["text"]
    assert lp["top_logprobs"] == [{t: p} for t, p in zip(lp["tokens"], lp["token_logprobs"])]
    assert lp["token_logprobs"] == [p for p, _ in _direct(server0, _ids(demo, REV), 0, 0)]
    chat = _post(server0, "/v1/chat/completions", {"messages": USER, "logprobs": True, "seed": 0}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(x["top_logprobs"] == [] for x in content)


def test_ignore_eos_special_tokens_as_strings(server, demo):
    """With ignore_eos the eos ids are ordinary tokens: they have entries, as their token string ("<eos>"), and
    the entries still match usage (the text skips them)."""
    _, tok = demo
    out = _post(server, "/v1/completions", {"prompt": "add 123+045=", "max_tokens": 40, "seed": 3,
                                            "ignore_eos": True, "logprobs": 1}).json()
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == out["usage"]["completion_tokens"] == 40
    assert tok.eos_token in lp["tokens"]
    assert "".join(t for t in lp["tokens"] if t not in tok.all_special_tokens) == out["choices"][0]["text"]


def test_cli_max_logprobs_reaches_build_engine(monkeypatch):
    """`dgemma serve --max-logprobs K` passes K to build_engine; out of [0, 64] it is refused before loading."""
    import dgemma_runtime as runtime
    from dgemma_compile.cli import ServeArgs, _parser, main, serve_command

    seen = {}

    class Stop(Exception):
        pass

    def fake_build_engine(model, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(runtime, "build_engine", fake_build_engine)
    assert _parser().parse_args(["serve"]).max_logprobs == 20
    with pytest.raises(Stop):
        serve_command(ServeArgs.from_namespace(_parser().parse_args(["serve", "--eager", "--max-logprobs", "3"])))
    assert seen["max_logprobs"] == 3
    assert main(["serve", "--max-logprobs", "-1"]) == 2
    assert main(["serve", "--max-logprobs", "65"]) == 2
