"""Per-request work that ends with its request (issue 36, docs/serving.md "Bounded work"): grammar compiles run in
worker processes bounded in size, time and memory (`runtime/http/grammars.py`); hostile constraints are refused naming
the limit while a good request keeps its solo answer, and the server's memory and threads return to idle."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

import dgemma_compile as dg
from dgemma_runtime import build_engine
from dgemma_runtime.http.grammars import GrammarLimits
from dgemma_runtime.http.metrics import ServeMetrics

pytest.importorskip("uvicorn")

from test_serve import SLOTS, ServerThread, _post  # noqa: E402

GOOD = {"prompt": "sort 1 2=", "max_tokens": 8, "seed": 0, "guided_regex": "[0-9]( [0-9])*"}
RSS_BOUND = 300 * 2**20
"""Bytes the server process may keep over its idle size after the hostile requests."""


def _schema(n: int) -> dict:
    props = {f"p{i:06d}_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx": {"type": "integer"} for i in range(n)}
    return {"messages": [{"role": "user", "content": "sort 1 2="}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": props}}}}


HOSTILE = [("/v1/chat/completions", _schema(2000)), ("/v1/chat/completions", _schema(18000)),
           ("/v1/completions", {"prompt": "x", "max_tokens": 8,
                                "guided_regex": "|".join(f"w{i:05d}" for i in range(20000))})]


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def _native_threads() -> int:
    """Threads of this process that Python did not start (xgrammar's compile threads were such, before issue 36).
    Python's own threads are pools that keep idle threads by design (asyncio's default executor, anyio's workers,
    one child watcher per live grammar worker), bounded by their caps, so they are not counted."""
    os_threads = int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])
    return os_threads - threading.active_count()


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from helpers import write_byte_tokenizer, write_checkpoint

    d = write_checkpoint(tmp_path_factory.mktemp("bytes"), vocab_size=264, canvas_length=8,
                         generation={"max_denoising_steps": 2})
    write_byte_tokenizer(d)
    return dg.load(d), dg.load_tokenizer(d)


def _server(byte_model, limits: GrammarLimits, metrics=None) -> ServerThread:
    model, tok = byte_model
    return ServerThread(build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok,
                        metrics=metrics, grammar_limits=limits)


def _app(srv):
    return srv.server.config.app


def test_a_grammar_over_the_size_limit_is_refused_before_compiling(byte_model):
    metrics = ServeMetrics()
    with _server(byte_model, GrammarLimits(max_bytes=1000), metrics) as srv:
        r = _post(srv, *HOSTILE[0])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "grammar_too_large" and err["param"] == "response_format", err
        assert "--max-grammar-bytes" in err["message"]
        assert _app(srv).state.grammars.workers == 0  # nothing started, nothing compiled
        assert 'dgemma_refused_total{limit="grammar_too_large"} 1.0' in metrics.text().decode()


def test_a_disconnected_request_kills_its_compile(byte_model):
    with _server(byte_model, GrammarLimits(max_bytes=4 * 2**20, timeout_s=60, workers=1)) as srv:
        grammars = _app(srv).state.grammars
        body = json.dumps(HOSTILE[1][1]).encode()
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body)
            deadline = time.time() + 30
            while not grammars._busy:  # the compile started in a worker
                assert time.time() < deadline
                time.sleep(0.05)
            proc = next(iter(grammars._busy)).proc
        deadline = time.time() + 10
        while proc.returncode is None:  # the client went away: its worker is killed
            assert time.time() < deadline, "the compile outlived its request"
            time.sleep(0.05)
        assert grammars.workers == 0
        r = _post(srv, "/v1/completions", GOOD)  # a fresh worker serves the next
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_hostile_grammars_end_with_their_requests(byte_model):
    limits = GrammarLimits(max_bytes=4 * 2**20, timeout_s=2.0, memory_bytes=512 * 2**20, workers=2)
    with _server(byte_model, limits) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        solo = _post(srv, "/v1/completions", GOOD).json()["choices"][0]["text"]
        grammars = _app(srv).state.grammars

        def hostile_round() -> list[httpx.Response]:
            with concurrent.futures.ThreadPoolExecutor(len(HOSTILE) + 1) as pool:
                bad = [pool.submit(client.post, path, json=body) for path, body in HOSTILE]
                grammars.cache.clear()  # the good request compiles too, beside them
                good = pool.submit(client.post, "/v1/completions", json=GOOD)
                assert good.result().status_code == 200 and good.result().json()["choices"][0]["text"] == solo
                return [f.result() for f in bad]

        hostile_round()  # the first round starts the server's worker threads (body parsing) and grammar workers
        idle_rss, idle_native = _rss(), _native_threads()
        answers = hostile_round()
        for r in answers:
            if r.status_code != 200:  # refused naming the limit
                err = r.json()["error"]
                assert r.status_code == 400 and err["code"] in ("grammar_timeout", "grammar_memory"), r.text
        assert any(r.status_code == 400 for r in answers)
        deadline = time.time() + 10
        while _native_threads() > idle_native:  # no compile thread outlives its request in this process
            assert time.time() < deadline, f"native threads {_native_threads()} > idle {idle_native}"
            time.sleep(0.1)
        assert _rss() <= idle_rss + RSS_BOUND
        assert grammars.workers <= limits.workers
        r = _post(srv, "/v1/completions", GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo


def test_cli_grammar_flags_reach_the_app(monkeypatch):
    """`dgemma serve --max-grammar-bytes/--grammar-timeout/--grammar-memory/--grammar-workers/--grammar-cache-bytes`
    become the app's `GrammarLimits`; bad values are refused before loading."""
    import dgemma_runtime.http.server as server
    from dgemma_compile.cli import ServeArgs, _parser, main, serve_command

    seen = {}

    class Stop(Exception):
        pass

    def fake_create_app(engine, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(server, "create_app", fake_create_app)
    with pytest.raises(Stop):
        serve_command(ServeArgs.from_namespace(_parser().parse_args(
            ["serve", "--eager", "--max-grammar-bytes", "100", "--grammar-timeout", "1.5", "--grammar-memory", "1000",
             "--grammar-workers", "3", "--grammar-cache-bytes", "0"])))
    assert seen["grammar_limits"] == GrammarLimits(max_bytes=100, timeout_s=1.5, memory_bytes=1000, workers=3,
                                                   cache_bytes=0)
    assert main(["serve", "--grammar-timeout", "0"]) == 2
    assert main(["serve", "--grammar-workers", "0"]) == 2
