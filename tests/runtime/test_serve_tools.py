"""Tool calls (issue 26 item 5; runtime/http/tool_syntax.py, runtime/http/tool_calls.py, docs/constrained.md "Tool calls"):
Gemma4's call syntax parsed into OpenAI `tool_calls` (streamed and not), tools rendered by a Gemma4-shaped chat
template fixture (tests/fixtures/gemma4_tools), `tool_choice` "required" / named enforced through the constraint
machinery on a random-weight checkpoint with a byte-level tokenizer (every call parses and its arguments validate
against the function's schema, `jsonschema`), "none" / "auto" as vLLM, and every refusal a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

import dgemma_compile as dg
from dgemma_compile.inputs.constraint import GrammarLibrary
from dgemma_compile.inputs.text import encode_chat
from dgemma_runtime.http.tool_syntax import ToolCall, ToolCallScanner, parse_arguments, split_tool_calls
from dgemma_runtime import build_engine

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import MODEL, ServerThread, _post  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    "where": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "[a-z]{1,3}"}},
              "required": ["zone"], "additionalProperties": False}},
    "required": ["city", "days", "where"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
WX = {"type": "object", "properties": {"c": {"type": "string", "enum": ["P", "O"]},
                                      "d": {"type": "integer", "minimum": 1, "maximum": 7},
                                      "a": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
      "required": ["c", "d"]}
NOW = [{"type": "function", "function": {"name": "now", "parameters": TIME}}]
SMALL = [{"type": "function", "function": {"name": "wx", "parameters": WX}}, *NOW]
"""The server tests' tools: short declarations and calls (the eager prefill of a long prompt dominates a request's
time, and a random model keeps about one token per block, so each token of a call costs a block)."""
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "wx": WX, "now": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]
LONG = 512  # cache slots: prompt (the declarations: 130-330 byte tokens) + max_tokens


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    """The byte-level tokenizer with Gemma4's markers and the Gemma4-shaped tools template alone (no model)."""
    from helpers import write_byte_tokenizer

    d = tmp_path_factory.mktemp("tools_tok")
    write_byte_tokenizer(d, tools=True)
    return dg.load_tokenizer(d)


@pytest.fixture(scope="module")
def tool_checkpoint(tmp_path_factory):
    """(model, tokenizer): random weights (vocabulary 272, canvas 8, 2 denoise steps) and the byte-level tokenizer
    with Gemma4's markers as special tokens and the Gemma4-shaped tools template."""
    from helpers import write_byte_tokenizer, write_checkpoint

    d = write_checkpoint(tmp_path_factory.mktemp("tools"), vocab_size=272, canvas_length=8,
                         generation={"max_denoising_steps": 2})
    write_byte_tokenizer(d, tools=True)
    return dg.load(d), dg.load_tokenizer(d)


@pytest.fixture(scope="module")
def tool_server(tool_checkpoint):
    model, tok = tool_checkpoint
    with ServerThread(build_engine(model, max_batch=2, max_seq_len=LONG, eager=True, tokenizer=tok), tok) as srv:
        srv.model = model
        yield srv


# ----- the syntax, no model ----------------------------------------------------------------------------------------
def test_parse_arguments_values():
    text = '{city:<|"|>San Francisco, "CA"<|"|>,n:-4,x:1.5e2,ok:true,no:false,z:null,l:[1,<|"|>a]b<|"|>,[]],o:{k:{}}}'
    assert parse_arguments(text) == {"city": 'San Francisco, "CA"', "n": -4, "x": 150.0, "ok": True, "no": False,
                                     "z": None, "l": [1, "a]b", []], "o": {"k": {}}}
    assert parse_arguments("{ a : 1 , b:word }") == {"a": 1, "b": "word"}
    for bad in ("{a:1", "a:1}", '{a:<|"|>x}', "{a:1}x", "{:1}", "{a:}"):
        with pytest.raises(ValueError, match="tool call arguments"):
            parse_arguments(bad)


def test_split_and_stream_agree():
    text = ('Sure. <|tool_call>call:get_time{utc:true}<tool_call|><|tool_call>call:bad name{}<tool_call|>'
            '<|tool_call>call:get_weather{city:<|"|><tool<|"|>,days:2}<tool_call|> done <|tool_call>call:open{')
    content, calls = split_tool_calls(text)
    assert calls == [ToolCall("get_time", {"utc": True}), ToolCall("get_weather", {"city": "<tool", "days": 2})]
    assert content == "Sure. <|tool_call>call:bad name{}<tool_call|> done <|tool_call>call:open{"
    for step in (1, 3, 7):  # streamed in pieces: content never retracted, the same calls and content
        scanner, shown, got = ToolCallScanner(), "", []
        for end in range(step, len(text), step):
            c, new = scanner.push(text[:end])
            shown, got = shown + c, got + new
            assert not text[:end].endswith("<|tool_call>") or not shown.endswith("<|tool_")
        c, new = scanner.finish(text)
        assert (shown + c, got + new) == (content, calls)
    assert split_tool_calls("no calls <|tool") == ("no calls <|tool", [])


def test_template_renders_tools_and_turns(tool_tokenizer):
    tok = tool_tokenizer
    msgs = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"utc": True}}}]},
        {"role": "tool", "name": "get_time", "tool_call_id": "c1", "content": "12:00"}]
    ids = encode_chat(tok, msgs, bos_token_id=2, tools=TOOLS)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<bos><|turn>system\n<|tool>declaration:get_weather{description:<|\"|>The weather<|\"|>,"
                           "parameters:{type:<|\"|>object<|\"|>,properties:{city:{type:<|\"|>string<|\"|>,enum:[")
    assert "<|tool>declaration:get_time{parameters:" in text and text.count("<tool|>") == 2
    assert ('<|turn>model\n<|tool_call>call:get_time{utc:true}<tool_call|><turn|>\n'
            '<|tool_response>response:get_time{value:<|"|>12:00<|"|>}<tool_response|><|turn>model\n') in text
    marker = tok.convert_tokens_to_ids("<|tool_call>")
    assert marker in ids and ids.count(marker) == 1  # the markers are single special tokens, as in the release
    assert encode_chat(tok, USER, bos_token_id=2) != encode_chat(tok, USER, bos_token_id=2, tools=TOOLS)


def test_enforced_grammar_accepts_calls_and_refuses_others(tool_tokenizer):
    """The structural tag of "required" accepts one or more valid calls and nothing else; the named one exactly one
    call of its function (the grammar side the server's guarantee rests on)."""
    from dgemma_runtime.http.tool_calls import resolve_tools

    tok = tool_tokenizer
    lib = GrammarLibrary(tok, 272, [1])

    def accepts(constraint, text: str) -> bool:
        ids = tok(text, add_special_tokens=False)["input_ids"] + [1]
        return lib.matcher(constraint).accept(ids) == len(ids)

    req = resolve_tools(TOOLS, "required", None).constraint
    one = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:7,where:{zone:<|"|>ab<|"|>}}<tool_call|>'
    two = one + '<|tool_call>call:get_time{utc:false}<tool_call|>'
    assert accepts(req, one) and accepts(req, two)
    for bad in ("hello", "", one.replace("Oslo", "Rome"), one.replace("days:7", "days:8"),
                one.replace("ab", "abcd"), one.replace("get_weather", "get_weathr"), "text " + one):
        assert not accepts(req, bad), bad
    named = resolve_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None).constraint
    assert accepts(named, '<|tool_call>call:get_time{utc:true}<tool_call|>')
    assert not accepts(named, one) and not accepts(named, '<|tool_call>call:get_time{utc:true}<tool_call|>' * 2)
    single = resolve_tools(TOOLS, "required", False).constraint
    assert accepts(single, one) and not accepts(single, two)


@pytest.mark.parametrize("tools,choice,param,words", [
    ("x", None, "tools", "must be a list"),
    ([{"type": "function"}], None, "tools[0]", "each tool must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name", "letters"),
    ([{"type": "function", "function": {"name": "f", "x": 1}}], None, "tools[0].function", "unknown field"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters", "object"),
    ([TOOLS[1], TOOLS[1]], None, "tools[1].function.name", "twice"),
    (TOOLS, "sometimes", "tool_choice", "must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not among the tools"),
    (TOOLS, {"type": "function"}, "tool_choice", "named tool choice"),
    (None, "required", "tool_choice", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}}}], "required",
     "tools[0].function.parameters.properties.s", "maxLength"),
])
def test_resolve_tools_refusals_name_the_field(tools, choice, param, words):
    from dgemma_runtime.http.protocol import APIError
    from dgemma_runtime.http.tool_calls import resolve_tools

    with pytest.raises(APIError) as info:
        resolve_tools(tools, choice, None)
    assert info.value.status == 400 and info.value.param == param and words in info.value.message


# ----- the server ------------------------------------------------------------------------------------------------
def _check_calls(calls, names=None):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and (names is None or c.function.name in names)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.slow
def test_required_and_named_calls_always_parse_and_validate(tool_server):
    """Random weights: "required" and a named function give calls whose arguments validate, through the official
    client, non-streaming and streaming (the stream's deltas accumulate to the same message). One call each
    (`parallel_tool_calls` false: the grammar then ends after it; with several allowed, a random model may chain
    calls past any budget, which the grammar test covers)."""
    client = tool_server.client(max_retries=0)
    kw = dict(model=MODEL, messages=USER, tools=NOW, tool_choice="required", seed=0, max_tokens=48,
              parallel_tool_calls=False)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    _check_calls(c.message.tool_calls)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        assert not ch.delta.content
        for d in ch.delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            assert d.id is None or slot["id"] is None  # the id once, in the call's first delta
            slot["id"] = d.id or slot["id"]
            slot["name"] = d.function.name or slot["name"]
            slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert all(s["id"].startswith("call_") for s in calls.values())
    named = {"type": "function", "function": {"name": "now"}}  # among two tools
    c = client.chat.completions.create(**{**kw, "seed": 2, "tools": SMALL, "tool_choice": named}).choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1  # OpenAI's finish for a named function
    _check_calls(c.message.tool_calls, {"now"})


@pytest.mark.slow
def test_none_and_auto_follow_vllm(tool_server, tool_checkpoint):
    """"none": the tools are rendered (prompt_tokens count the declarations) and the answer is plain text, the eager
    oracle's on that prompt; "auto" on the same seed: the same tokens, parsed (a random model writes no call, so
    the content is that text and no tool_calls)."""
    model, tok = tool_checkpoint
    base = {"messages": USER, "tools": NOW, "seed": 4, "max_tokens": 12}
    none = _post(tool_server, "/v1/chat/completions", {**base, "tool_choice": "none"}).json()
    ids = encode_chat(tok, USER, bos_token_id=model.config.bos_token_id, tools=NOW)
    assert none["usage"]["prompt_tokens"] == len(ids)
    cfg = model.generation_config.replace(max_new_tokens=12)
    ref = dg.generate(model, [ids], cfg, seed=4, moe_impl="dense", max_seq_len=LONG).sequences[0]
    msg = none["choices"][0]["message"]
    assert msg["content"] == tok.decode(ref, skip_special_tokens=True) and "tool_calls" not in msg
    auto = _post(tool_server, "/v1/chat/completions", base).json()["choices"][0]
    content, calls = split_tool_calls(tok.decode([t for t in ref if t != 1], skip_special_tokens=False))
    assert not calls and auto["message"]["content"] == content and "tool_calls" not in auto["message"]
    assert auto["finish_reason"] == none["choices"][0]["finish_reason"]


@pytest.fixture(scope="module")
def demo_server(demo):
    """The demo model's server (cheap to start, for the refusals: each is decided before the engine runs)."""
    model, tok = demo
    with ServerThread(build_engine(model, max_batch=2, max_seq_len=256, eager=True, tokenizer=tok), tok) as srv:
        yield srv


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function"}]}, "tools[0]", "each tool must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": TOOLS, "stop": "x"}, "stop", "not supported together"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs", "not supported together"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"messages": [{"role": "tool", "content": "1"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
])
def test_http_refusals_name_the_field(demo_server, body, param, words):
    r = _post(demo_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "add 1+2="}],
                                                    "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"
