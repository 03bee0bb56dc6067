"""Structured outputs over HTTP (runtime/http/structured.py, docs/constrained.md): `response_format` json_schema /
json_object and vLLM's `guided_regex` / `guided_choice` / `guided_json` / `structured_outputs` on both routes; the
answer is the eager oracle's constrained tokens; refusals are 400s naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import dgemma_compile as dg
from dgemma_compile.inputs.constraint import Constraint
from dgemma_compile.inputs.text import encode_prompt
from dgemma_runtime import build_engine

pytest.importorskip("uvicorn")

from test_serve import SLOTS, ServerThread, _post  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "sort 3 1 2="}]


@pytest.fixture(scope="module")
def demo_server(demo):
    model, tok = demo
    with ServerThread(build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok) as srv:
        yield srv


@pytest.fixture(scope="module")
def byte_server(tmp_path_factory):
    from helpers import write_byte_tokenizer, write_checkpoint

    d = write_checkpoint(tmp_path_factory.mktemp("bytes"), vocab_size=264, canvas_length=8,
                         generation={"max_denoising_steps": 2})
    write_byte_tokenizer(d)
    model, tok = dg.load(d), dg.load_tokenizer(d)
    with ServerThread(build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok) as srv:
        srv.model = model
        yield srv


def _text(r, chat: bool) -> tuple[str, str]:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return (c["message"]["content"] if chat else c["text"]), c["finish_reason"]


@pytest.mark.slow
def test_guided_regex_and_choice_match_the_oracle(demo_server, demo):
    model, tok = demo
    body = {"prompt": "sort 3 1 2 9 5=", "max_tokens": 24, "seed": 3, "max_denoising_steps": 8}
    text, finish = _text(_post(demo_server, "/v1/completions", {**body, "guided_regex": "[0-9]( [0-9])*"}), False)
    ids = encode_prompt(tok, body["prompt"], bos_token_id=model.config.bos_token_id)
    cfg = model.generation_config.replace(max_new_tokens=24, max_denoising_steps=8)
    ref = dg.generate(model, [ids], cfg, seed=3, moe_impl="dense", max_seq_len=SLOTS,
                      constraint=Constraint.regex("[0-9]( [0-9])*"), tokenizer=tok)
    assert text == tok.decode(ref.sequences[0], skip_special_tokens=True) and finish == "stop"
    assert re.fullmatch("[0-9]( [0-9])*", text)
    choices = ["1 2 3", "no"]
    text, finish = _text(_post(demo_server, "/v1/chat/completions",
                               {"messages": USER, "max_tokens": 8, "seed": 1, "guided_choice": choices}), True)
    assert text in choices and finish == "stop"
    text, _ = _text(_post(demo_server, "/v1/completions",
                          {**body, "structured_outputs": {"choice": choices}}), False)
    assert text in choices


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_response_format_json_schema_and_object_on_random_weights(byte_server, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "{"}]} if chat else {"prompt": "{"}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    finishes = []
    for seed, field in ((0, {"response_format": fmt}), (1, {"response_format": fmt}),
                        (2, {"response_format": {"type": "json_object"}}), (2, {"guided_json": json.dumps(SCHEMA)})):
        text, finish = _text(_post(byte_server, path, {**base, "max_tokens": 48, "seed": seed, **field}), chat)
        finishes.append(finish)
        assert finish in ("stop", "length")
        if finish == "stop":  # complete: valid JSON (under the schema); "length": the budget ran out first
            value = json.loads(text)
            if "guided_json" in field or field["response_format"]["type"] == "json_schema":
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)
    assert finishes.count("stop") >= 2


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "([0-9]"}, "guided_regex", "cannot compile this regex"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_object"}}, "response_format", "no token of the model's vocabulary"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "not supported"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["1"]}, "guided_choice", "only one"),
    ({"guided_regex": "[0-9]+", "ignore_eos": True}, "guided_regex", "ignore_eos"),
])
def test_refusals_name_the_field(demo_server, body, param, words):
    r = _post(demo_server, "/v1/completions", {"prompt": "sort 1 2=", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_serves_after_the_refusals(demo_server):
    r = _post(demo_server, "/v1/completions", {"prompt": "sort 1 2=", "max_tokens": 8, "seed": 0,
                                               "guided_regex": "[0-9]( [0-9])*"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "1 2"
