"""No 500 from a valid JSON body (issue 36 item 2): a lone surrogate escape ("\\ud800", valid JSON, not Unicode
text) anywhere in a body is a 400 naming its field (`limits.parse_json`), and a client error never closes the
keep-alive connection it came on; a Hypothesis fuzz over request bodies with surrogates and control characters finds
no 5xx (eager steps over the demo model)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgemma_runtime import build_engine

pytest.importorskip("uvicorn")

from test_serve import SLOTS, ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def server(demo):
    model, tok = demo
    with ServerThread(build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok) as srv:
        yield srv


def _send(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes a lone surrogate as its \\ud800 escape: valid JSON
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "sort \ud800 1=", "max_tokens": 8}, "prompt"),
    ("/v1/completions", {"prompt": ["sort 1=", "\udc00"], "max_tokens": 8}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 8},
     "messages[0].content"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": "sort 1=", "stop": ["\ud800"], "max_tokens": 8}, "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays(server, path, body, param):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = _send(client, path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "invalid_unicode" and "surrogate" in err["message"]
        assert r.headers.get("connection") != "close"
        ok = client.get("/health")  # the same keep-alive connection serves the next request
        assert ok.status_code == 200 and r.extensions["network_stream"] is ok.extensions["network_stream"]


TEXT = st.text(st.characters(codec=None, categories=("Cs", "Cc", "Ll", "Nd", "Zs")), max_size=12)
BODIES = st.one_of(
    st.builds(lambda p, s: ("/v1/completions", {"prompt": p, "max_tokens": 4, "max_denoising_steps": 2, "stop": s}),
              st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=2)), st.lists(TEXT, max_size=2)),
    st.builds(lambda c, r: ("/v1/chat/completions", {"messages": [{"role": r, "content": c}], "max_tokens": 4,
                                                     "max_denoising_steps": 2}),
              TEXT, st.sampled_from(["user", "system", "\ud800"])),
    st.builds(lambda p: ("/tokenize", {"prompt": p}), TEXT),
    st.builds(lambda k, v: ("/v1/completions", {"prompt": "1", "max_tokens": 4, k: v}), TEXT, TEXT),
)


@settings(max_examples=40, suppress_health_check=list(HealthCheck), deadline=None)
@given(BODIES)
def test_fuzzed_text_never_gets_a_5xx(server, case):
    path, body = case
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = _send(client, path, body)
        assert r.status_code < 500, (body, r.text)
        assert client.get("/health").status_code == 200
