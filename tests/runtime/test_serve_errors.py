"""One error shape (issue 36 item 5): every 4xx the server answers -- its own, FastAPI's and Starlette's (unknown
route, wrong method, malformed path), the body limit's, uvicorn's (malformed head, header timeout) -- is OpenAI's
`{"error": {"message", "type", "param", "code"}}` as JSON, echoed values cut; request types are strict where
OpenAI's are; /openapi.json says what the server takes and answers."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgemma_runtime import build_engine
from dgemma_runtime.http.transport import bounded_protocol
from dgemma_runtime.http.metrics import ServeMetrics

uvicorn = pytest.importorskip("uvicorn")

from test_serve import MODEL, SLOTS, ServerThread, _free_port  # noqa: E402

BIG = "x" * 2**20
CASES = [  # (method, path, body (dict, or raw bytes), status, param)
    ("GET", "/nope", None, 404, None),
    ("GET", "/v1/models/%0Ax", None, 404, None),
    ("POST", "/health", None, 405, None),
    ("DELETE", "/v1/completions", None, 405, None),
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"x" * (5 * 2**20), 413, None),
    ("POST", "/v1/completions", {"prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/completions", {"prompt": "a", "n": True}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2.0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "a", "seed": "1"}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": [[False]]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "a", "model": BIG}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": "a", BIG: 1}, 400, "x" * 80),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 1}, 400, "logprobs"),
    ("POST", "/tokenize", {"prompt": "a", "add_special_tokens": "false"}, 400, "add_special_tokens"),
    ("POST", "/tokenize", {}, 400, "prompt"),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": ["1"]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def server(demo):
    model, tok = demo
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    with ServerThread(engine, tok, metrics=ServeMetrics()) as srv:
        yield srv


def _request(srv, method: str, path: str, body) -> httpx.Response:
    kw = {} if body is None else {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.request(method, srv.url + path, timeout=30, **kw)


def assert_error_shape(r: httpx.Response, status: int | None = None) -> dict:
    """`r` is a 4xx in OpenAI's error shape (JSON, exactly the four keys, strings where OpenAI has them, the message
    bounded); returns its error."""
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and isinstance(err["type"], str) and len(err["message"]) < 1000, err
    assert all(err[k] is None or isinstance(err[k], str) and len(err[k]) <= 200 for k in ("param", "code")), err
    return err


@pytest.mark.parametrize("method,path,body,status,param", CASES,
                         ids=[f"{m} {p} {str(b)[:30]}" for m, p, b, *_ in CASES])
def test_every_error_has_the_shape(server, method, path, body, status, param):
    err = assert_error_shape(_request(server, method, path, body), status)
    assert err["param"] == param, err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", f"/v1/models/{MODEL}",
                             "/tokenize", "/detokenize", "/health", "/metrics", "/v1", "/v1/x", "/"]),
       suffix=st.text(alphabet="abc%/?.0A", max_size=6),
       body=st.one_of(st.none(), st.binary(max_size=40),
                      st.dictionaries(st.sampled_from(["prompt", "n", "stream", "temperature", "tokens", "messages",
                                                       "max_tokens", "model", "x"]),
                                      st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4),
                                                st.lists(st.integers(-2, 2), max_size=2)), max_size=3)))
def test_fuzzed_4xx_have_the_shape(server, method, path, suffix, body):
    if isinstance(body, dict):
        body = {**body, "max_tokens": 2, "max_denoising_steps": 1} if "max_tokens" not in body else body
    r = _request(server, method, path + suffix, body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_error_shape(r)


def test_openapi_says_what_is_accepted(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    comps = doc["components"]["schemas"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert comps["ChatCompletionRequest"]["properties"]["prediction"] == {
        "enum": [None], "description": comps["ChatCompletionRequest"]["properties"]["prediction"]["description"]}
    assert comps["CompletionRequest"]["properties"]["top_p"]["enum"] == [1, None]
    assert comps["TokenizeRequest"]["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    assert comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["minimum"] == 0
    assert "HTTPValidationError" not in comps
    so = comps["CompletionRequest"]["properties"]["structured_outputs"]["anyOf"][1]
    assert so["additionalProperties"] == {"enum": [None, False]}  # an unknown key is refused unless unset
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "a", "max_tokens": 2, "structured_outputs": {"grammar": "x"}})
    assert assert_error_shape(r, 400)["param"] == "structured_outputs"
    for ops in doc["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"]
            for code, r in op["responses"].items():
                if code != "200":
                    assert r["content"] == {"application/json": {"schema": {"$ref":
                                                                             "#/components/schemas/ErrorResponse"}}}


class _Bounded:
    """A uvicorn server with `bounded_protocol(timeout_s)` on a trivial app, in a thread."""

    def __init__(self, timeout_s: float):
        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    http=bounded_protocol(timeout_s), lifespan="off"))

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    start, out = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out, time.monotonic() - start
        out += chunk


def test_a_half_sent_head_times_out():
    with _Bounded(0.5) as srv:
        for first in (b"", b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: "):  # nothing at all; half a header block
            with socket.create_connection(("127.0.0.1", srv.port)) as s:
                s.sendall(first)
                out, took = _read_all(s, 5)
            assert out.startswith(b"HTTP/1.1 408 ") and b'"code": "header_timeout"' in out, out
            assert 0.4 < took < 3, took
        # a whole request is answered, and the next head on the same connection is bounded again
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.1)
            s.sendall(b"GET / HTTP/1.1\r\nHost")
            out, took = _read_all(s, 5)
        assert out.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in out, out
        # a malformed head: a JSON 400, not uvicorn's text
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"NOT HTTP\r\n\r\n")
            out, _ = _read_all(s, 5)
        assert out.startswith(b"HTTP/1.1 400 ") and b'"code": "malformed_request"' in out, out


def test_an_unhandled_exception_is_counted_as_a_500():
    """Starlette answers an unhandled exception outside every user middleware, so ErrorCounter counts it itself."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from dgemma_runtime.http.errors import ErrorCounter

    app, registry = FastAPI(), CollectorRegistry()

    @app.get("/boom")
    def boom():
        raise RuntimeError("boom")

    app.add_middleware(ErrorCounter, registry=registry)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/boom").status_code == 500
        assert client.get("/nowhere").status_code == 404
    counts = {s.labels["status"]: s.value for m in registry.collect() for s in m.samples if s.name.endswith("_total")}
    assert counts == {"500": 1.0, "404": 1.0}, counts


def test_a_config_error_maps_to_the_400_by_its_fields():
    """Issue 41 item 4: the 400 of a `ConfigError` takes its `param` (the engine's name mapped to the request's) and
    its `code` from the error's fields: a context-length refusal is one by its code, whatever its text says; a message
    that merely mentions the context is not; the fields survive a pickle (a rank or a worker may send one)."""
    import pickle

    from dgemma_compile.model.config import CONTEXT_LENGTH, ConfigError
    from dgemma_runtime.http.server import _config_error

    err = _config_error(ConfigError("max_seq_len", "this request needs 9 KV pages, more than 8", code=CONTEXT_LENGTH))
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert err.message == "max_seq_len: this request needs 9 KV pages, more than 8"
    err = _config_error(ConfigError("stop", "mentions the context and max_seq_len in its text"))
    assert (err.param, err.code) == ("stop", None)
    err = _config_error(ConfigError("a problem naming no single parameter"))
    assert (err.param, err.code, err.message) == (None, None, "a problem naming no single parameter")
    back = pickle.loads(pickle.dumps(ConfigError("prompts[0]", "empty prompt", code=CONTEXT_LENGTH)))
    assert (back.param, back.problem, back.code, str(back)) == ("prompts[0]", "empty prompt", CONTEXT_LENGTH,
                                                                "prompts[0]: empty prompt")
