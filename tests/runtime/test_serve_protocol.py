"""Protocol conformance of `dgemma serve`, judged by what the field's clients send and parse (offline).

The request bodies of vLLM's bench client (openai, openai-chat), guidellm, aiperf, lm-eval (local-completions,
local-chat-completions) and the `openai` client are recorded under tests/fixtures/clients/ (each names its client,
version and source); each must be accepted (or refused with a 400 naming the field where the server cannot honour
it), and every stream must parse the way vLLM's bench client parses it: events split on "\\n\\n".
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest


pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_serve import MODEL, REV, SLOTS, _post, eager_demo_server  # noqa: E402

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "clients").glob("*.json"))
USER = [{"role": "user", "content": "add 1+2="}]


@pytest.fixture(scope="module")
def server(demo):
    with eager_demo_server(demo) as srv:
        yield srv


def _events(raw: bytes) -> list:
    """SSE events as vLLM's bench client reads them: split on "\\n\\n", comments (pings) skipped, "data: " cut."""
    text = raw.decode()
    assert "\r" not in text
    out = []
    for message in text.split("\n\n"):
        message = message.strip()
        if not message or message.startswith(":"):
            continue
        assert message.startswith("data: "), message
        data = message.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stream(srv, path: str, body: dict) -> list:
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return _events(r.read())


@pytest.mark.slow
@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.stem for f in FIXTURES])
def test_client_bodies(server, fixture):
    """Each recorded body: accepted (a non-streaming answer parses; a stream splits on "\\n\\n" into JSON events,
    the last `[DONE]`, text in the chunks and usage where asked) or refused with a 400 naming the field."""
    case = json.loads(fixture.read_text())
    body, path = case["body"], case["path"]
    if case["expect"] != 200:
        r = _post(server, path, body)
        assert r.status_code == case["expect"], r.text
        assert r.json()["error"]["param"] == case["param"]
        return
    if not body.get("stream"):
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        out = r.json()
        prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        assert len(out["choices"]) == prompts and out["usage"]["total_tokens"] > 0
        for c in out["choices"]:
            assert (c["message"]["content"] if "messages" in body else c["text"])
        return
    events = _stream(server, path, body)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    key = (lambda c: c["delta"].get("content") or "") if "messages" in body else (lambda c: c["text"])
    assert "".join(key(c["choices"][0]) for c in chunks)
    opts = body.get("stream_options") or {}
    if opts.get("include_usage"):
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
    if opts.get("continuous_usage_stats"):
        assert all("usage" in c for c in chunks)


def _vllm_bench(events: list, chat: bool) -> dict:
    """A stream as vLLM's bench client (0.33, endpoint_request_func.py) judges it: a request succeeds iff a chunk
    with choices arrives (chat: one with streamed output, `_choice_has_streamed_output`); the text is their
    `text` / `delta.content` joined; output_tokens and prompt_len come from a choices-less usage chunk."""
    out = {"success": False, "text": "", "output_tokens": None, "prompt_len": None}
    for data in events:
        if data == "[DONE]":
            continue
        choices = data.get("choices")
        if chat:
            delta = choices[0].get("delta") if choices else None
            streamed = isinstance(delta, dict) and bool(delta.get("content") or delta.get("content") == "" and
                                                        "role" not in delta)
        else:
            streamed = bool(choices)
        if streamed:
            out["success"] = True
            out["text"] += (choices[0]["delta"].get("content") if chat else choices[0].get("text")) or ""
        elif not choices and (usage := data.get("usage")):
            out["output_tokens"], out["prompt_len"] = usage.get("completion_tokens"), usage.get("prompt_tokens")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vllm_bench_openai", "vllm_bench_openai_chat", "vllm_bench_openai_custom",
                                  "vllm_bench_openai_chat_custom"])
def test_vllm_bench_counts_success(server, demo, name):
    """vLLM's bench requests (the custom dataset's prompt is chat-templated, so it starts with a literal "<bos>")
    succeed by its own parser, with the known answer, its token count, and the prompt counted with one BOS."""
    _, tok = demo
    case = json.loads((Path(__file__).parents[1] / "fixtures" / "clients" / f"{name}.json").read_text())
    chat = "messages" in case["body"]
    got = _vllm_bench(_stream(server, case["path"], {**case["body"], "seed": 0}), chat)
    prompt = (case["body"]["messages"][0]["content"][0]["text"] if chat else case["body"]["prompt"])
    answer = {"rev 1 2 3 4 5 6 7 8 9 0 1=": "1 0 9 8 7 6 5 4 ", "<bos>sort 3 1 2 9 5=": "1 2 3 5 9"}
    assert got["success"] is True
    assert got["text"] == answer[prompt]  # rev: the 16-token budget ends it after its first block
    assert got["output_tokens"] == len(tok(got["text"], add_special_tokens=False)["input_ids"])
    assert got["prompt_len"] == len(tok(prompt.removeprefix("<bos>"))["input_ids"])


def test_literal_special_tokens_in_prompt(server, demo):
    """A prompt with the tokenizer's special tokens written literally encodes them as the tokenizer does (a leading
    "<bos>" collapses into the one BOS: same answer and prompt_tokens as without it); unknown characters around
    them are still refused, naming the prompt and the characters."""
    _, tok = demo
    plain = _post(server, "/v1/completions", {"prompt": "sort 3 1 2 9 5=", "seed": 0}).json()
    lit = _post(server, "/v1/completions", {"prompt": "<bos>sort 3 1 2 9 5=", "seed": 0}).json()
    assert lit["choices"][0]["text"] == plain["choices"][0]["text"] == "1 2 3 5 9"
    assert lit["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(tok("sort 3 1 2 9 5=")["input_ids"])
    r = _post(server, "/v1/completions", {"prompt": "<bos>sort <bo 3="})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt" and "'<b'" in r.json()["error"]["message"]


def test_chat_stream_shape(server, demo):
    """OpenAI's chunk shapes: one role chunk per choice, first, before any draft; later deltas carry no role key;
    `logprobs` null; the joined content equals the non-streaming message, whose `refusal` is null."""
    body = {"messages": [{"role": "user", "content": REV}], "seed": 3, "n": 2}
    events = _stream(server, "/v1/chat/completions", {**body, "stream": True, "draft_every": 1})
    chunks = [e for e in events if e != "[DONE]"]
    first = [c["choices"][0] for c in chunks[:2]]
    assert [(c["index"], c["delta"]) for c in first] == [(0, {"role": "assistant", "content": ""}),
                                                        (1, {"role": "assistant", "content": ""})]
    rest = [c["choices"][0] for c in chunks[2:]]
    assert rest and all("role" not in c["delta"] and c["logprobs"] is None for c in rest)
    assert any("draft" in c for c in rest)
    out = _post(server, "/v1/chat/completions", body).json()
    for i in range(2):
        text = "".join(c["delta"]["content"] for c in rest if c["index"] == i and "draft" not in c)
        assert text == out["choices"][i]["message"]["content"]
        assert out["choices"][i]["message"]["refusal"] is None


def test_continuous_usage_counts(server, demo):
    """continuous_usage_stats: usage in every chunk, completion_tokens growing to the final count, which equals
    the client tokenizer's count of the text (the eos not counted); prompt_tokens = the tokenizer's ids."""
    _, tok = demo
    body = {"prompt": REV, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _stream(server, "/v1/completions", body)
    chunks = [e for e in events[:-1] if e["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and len(counts) == 2  # two committed blocks
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "1 0 9 8 7 6 5 4 3 2 1"
    final = events[-2]["usage"]
    assert final["completion_tokens"] == counts[-1] == len(tok(text, add_special_tokens=False)["input_ids"])
    assert final["prompt_tokens"] == len(tok(REV)["input_ids"])


def test_prompt_forms(server, demo):
    """`prompt` as text, a list of ints and a list of token-id lists gives the same answers for the same seed."""
    _, tok = demo
    ids = tok("sort 3 1 2 9 5=")["input_ids"]
    texts = []
    for prompt in ("sort 3 1 2 9 5=", ids, [ids, ids]):
        r = _post(server, "/v1/completions", {"prompt": prompt, "seed": 0})
        assert r.status_code == 200, r.text
        texts.append([c["text"] for c in r.json()["choices"]])
        assert r.json()["usage"]["prompt_tokens"] == len(ids) * (2 if prompt == [ids, ids] else 1)
    assert texts == [["1 2 3 5 9"]] * 2 + [["1 2 3 5 9"] * 2]


_PLAIN: dict[str, dict] = {}  # the answer without the field, per path (same body, same seed)


@pytest.mark.slow
@pytest.mark.parametrize("field,value", [
    ("logit_bias", {}), ("best_of", 1), ("store", False), ("metadata", {"k": "v"}), ("service_tier", "auto"),
    ("user", "u"), ("top_k", -1), ("top_k", 0), ("top_p", 1.0), ("min_tokens", 0), ("repetition_penalty", 1),
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("ignore_eos", False), ("logprobs", None),
    ("chat:response_format", {"type": "text"}), ("chat:tools", []), ("chat:tool_choice", "none"),
    ("chat:parallel_tool_calls", False), ("chat:logprobs", False), ("chat:top_logprobs", 0),
])
def test_neutral_values_accepted(server, field, value):
    """A neutral value of a field the server does not implement changes nothing: the same answer as without it."""
    chat = field.startswith("chat:")
    field = field.removeprefix("chat:")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": USER} if chat else {"prompt": "add 1+2="}
    base["seed"] = 5
    if path not in _PLAIN:
        _PLAIN[path] = _post(server, path, base).json()
    plain = _PLAIN[path]
    r = _post(server, path, {**base, field: value})
    assert r.status_code == 200, r.text
    pick = (lambda o: o["choices"][0]["message"]["content"]) if chat else (lambda o: o["choices"][0]["text"])
    assert pick(r.json()) == pick(plain)


def test_ignore_eos_runs_to_the_token_budget(server, demo):
    """vLLM's `ignore_eos`: the answer runs to `max_tokens` (finish "length", usage = max_tokens), its eos ids kept
    as ordinary tokens, the tokens of `dg.generate` with `GenerationConfig.ignore_eos`; without it, the same request
    ends at its eos."""
    import dgemma_compile as dg
    from dgemma_compile.inputs.text import encode_prompt

    model, tok = demo
    body = {"prompt": "add 123+045=", "max_tokens": 40, "seed": 3}
    out = _post(server, "/v1/completions", {**body, "ignore_eos": True}).json()
    plain = _post(server, "/v1/completions", body).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["choices"][0]["text"] == "0168"
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 40
    ids = encode_prompt(tok, body["prompt"], bos_token_id=model.config.bos_token_id)
    cfg = model.generation_config.replace(max_new_tokens=40, ignore_eos=True)
    ref = dg.generate(model, [ids], cfg, seed=3, moe_impl="dense", max_seq_len=SLOTS)
    assert len(ref.sequences[0]) == 40 and set(ref.sequences[0]) & set(model.config.eos_token_ids)
    text = tok.decode(ref.sequences[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert out["choices"][0]["text"] == text and text.startswith("0168")


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"prompt": "add 1+2=", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "add 1+2=", "min_tokens": 4}, "min_tokens"),
    ({"prompt": "add 1+2=", "repetition_penalty": 1.1}, "repetition_penalty"),
    ({"prompt": "add 1+2=", "top_k": 5}, "top_k"),
    ({"prompt": "add 1+2=", "top_p": 0.9}, "top_p"),
    ({"prompt": "add 1+2=", "best_of": 2}, "best_of"),
    ({"prompt": "add 1+2=", "best_of": True}, "best_of"),
    ({"prompt": "add 1+2=", "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": "add 1+2=", "logprobs": 21}, "logprobs"),
    ({"prompt": "add 1+2=", "logprobs": 1, "echo": True}, "echo"),
    ({"prompt": "add 1+2=", "store": True}, "store"),
    ({"prompt": "add 1+2=", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "add 1+2="},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}]},
     "messages"),
])
def test_non_neutral_refused(server, body, param):
    """Non-neutral values are refused with a 400 naming the field (and, for logprobs, the limit or the rule)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    if param == "messages[0].content[1]":  # the demo model takes no images
        assert "image_url parts need a model with a vision encoder" in err["message"]
    if param == "messages":
        assert "text and image_url only" in err["message"]
    if param == "logprobs":
        assert "--max-logprobs is 20" in err["message"]
    if param == "top_logprobs":
        assert "needs logprobs: true" in err["message"]
    if param == "echo":
        assert "causally" in err["message"]


def test_models_tokenize_detokenize_openapi(server, demo):
    """GET /v1/models/{id} (404 otherwise), /tokenize and /detokenize as vLLM serves them, /tokenizer_info, and an
    /openapi.json that documents the request bodies and the error responses."""
    _, tok = demo
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(server.url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    t = _post(server, "/tokenize", {"prompt": "sort 3 1 2=", "return_token_strs": True}).json()
    assert t["tokens"] == tok("sort 3 1 2=")["input_ids"] and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == SLOTS and t["token_strs"] == tok.convert_ids_to_tokens(t["tokens"])
    bare = _post(server, "/tokenize", {"prompt": "sort 3 1 2=", "add_special_tokens": False}).json()
    assert bare["tokens"] == t["tokens"][1:]
    chat = _post(server, "/tokenize", {"messages": USER}).json()
    usage = _post(server, "/v1/chat/completions", {"messages": USER, "seed": 0}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    d = _post(server, "/detokenize", {"tokens": bare["tokens"]}).json()
    assert d == {"prompt": "sort 3 1 2="}
    assert _post(server, "/detokenize", {"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    spec = httpx.get(server.url + "/openapi.json").json()
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert {"400", "404", "413", "429", "500"} <= set(post["responses"])
    schemas = spec["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"] and "ErrorResponse" in schemas
    assert "prompt" in schemas["CompletionRequest"]["properties"]
