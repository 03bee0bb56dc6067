"""`dgemma serve --api-key` (`auth.APIKeyAuth`): every /v1 and tokenizer route, streamed or not, known or not, is
a 401 in OpenAI's error shape without the right `Authorization: Bearer` key, and answers with it; /health and
/metrics stay open; the key is never in a response or a log line."""

from __future__ import annotations

import logging

import httpx
import pytest

from dgemma_runtime import build_engine
from dgemma_runtime.http.auth import APIKeyAuth, Secret, protected
from dgemma_runtime.http.metrics import ServeMetrics

pytest.importorskip("uvicorn")

from test_serve import MODEL, SLOTS, ServerThread  # noqa: E402

KEY = "sk-test-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "add 1+2="}], "max_tokens": 4, "max_denoising_steps": 1}
COMPLETION = {"prompt": "add 1+2=", "max_tokens": 4, "max_denoising_steps": 1}
ROUTES = [  # (method, path, body): every route behind the key, streamed and not
    ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/completions", {**COMPLETION, "stream": True}),
    ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/tokenize", {"prompt": "add"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/tokenizer_info", None),
]


@pytest.fixture(scope="module")
def server(demo):
    model, tok = demo
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    with ServerThread(engine, tok, metrics=ServeMetrics(), api_key=KEY) as srv:
        yield srv


def _send(srv, method: str, path: str, body, key: str | None, scheme: str = "Bearer") -> httpx.Response:
    headers = {} if key is None else {"authorization": f"{scheme} {key}".strip()}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=60)


def test_every_route_needs_the_key(server, caplog):
    caplog.set_level(logging.DEBUG)
    for method, path, body in ROUTES:
        for key, code in ((None, "missing_api_key"), (KEY + "x", "invalid_api_key"), (KEY[:-1], "invalid_api_key"),
                          ("", "missing_api_key"), ("Bearer " + KEY, "invalid_api_key")):
            r = _send(server, method, path, body, key)
            assert r.status_code == 401, (method, path, key, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
            assert KEY not in r.text
        r = _send(server, method, path, body, KEY, scheme="Basic")
        assert r.status_code == 401, (path, r.text)
        r = _send(server, method, path, body, KEY, scheme="bearer")  # the scheme is case-insensitive
        assert r.status_code == 200, (method, path, r.text)
    # unknown /v1 paths too: no probing routes without the key
    assert _send(server, "GET", "/v1/nothing", None, None).status_code == 401
    assert _send(server, "GET", "/v1/nothing", None, KEY).status_code == 404
    # open: health, metrics, the schema
    for path in ("/health", "/metrics", "/openapi.json"):
        assert _send(server, "GET", path, None, None).status_code == 200, path
    assert KEY not in caplog.text
    text = _send(server, "GET", "/metrics", None, None).text  # refusals by status on /metrics
    assert 'dgemma_http_errors_total{status="401"}' in text and 'dgemma_http_errors_total{status="404"} 1.0' in text


def test_the_key_is_never_shown():
    m = APIKeyAuth(None, Secret(KEY))
    assert KEY not in repr(m) and KEY not in repr(Secret(KEY))
    with pytest.raises(ValueError):
        APIKeyAuth(None, "")
    assert protected("/v1") and protected("/v1/models/x") and protected("/tokenize") and protected("/tokenizer_info")
    assert not protected("/health") and not protected("/metrics") and not protected("/v10") and not protected("/")


def test_cli_reads_the_key_from_the_environment(monkeypatch):
    from dgemma_compile.cli import _parser
    from dgemma_compile.cli.serve import _api_key
    from dgemma_compile.model.config import ConfigError

    monkeypatch.delenv("DGEMMA_API_KEY", raising=False)
    assert _api_key(_parser().parse_args(["serve"])) is None
    monkeypatch.setenv("DGEMMA_API_KEY", KEY)
    assert _api_key(_parser().parse_args(["serve"])) == KEY
    assert _api_key(_parser().parse_args(["serve", "--api-key", "other"])) == "other"  # the flag wins
    monkeypatch.setenv("DGEMMA_API_KEY", " ")
    with pytest.raises(ConfigError, match="empty") as e:
        _api_key(_parser().parse_args(["serve"]))
    args = _parser().parse_args(["serve", "--allow-image-urls", "--allowed-media-domains", "Images.Example.com",
                                 "b.org", "--allow-private-image-urls", "--max-image-pixels", "100"])
    assert args.allowed_media_domains == ["Images.Example.com", "b.org"] and args.allow_private_image_urls
    assert args.max_image_pixels == 100
