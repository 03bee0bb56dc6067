"""Admission that one request cannot flood (issue 36 item 3): a request whose choices (prompts x n) can never fit
the queue is a 400 before anything is queued; one that could fit later is queued whole or refused whole (429), never
in part, so nothing is cancelled and the "cancelled" counter counts only real cancellations (eager demo model)."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from dgemma_runtime import QueueFullError, Request, build_engine
from dgemma_runtime.http.metrics import ServeMetrics

pytest.importorskip("uvicorn")

from test_serve import SLOTS, ServerThread, _ids, _post  # noqa: E402

QUEUE = 8


@pytest.fixture(scope="module")
def server(demo):
    model, tok = demo
    metrics = ServeMetrics()
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok, max_queue=QUEUE,
                          metrics=metrics)
    with ServerThread(engine, tok, metrics) as srv:
        srv.metrics = metrics
        yield srv


def _cancelled(srv) -> float:
    return srv.metrics.requests.labels("cancelled")._value.get()


@pytest.mark.parametrize("body,param", [({"prompt": ["sort 1 2="] * 300}, "prompt"),
                                        ({"prompt": "sort 1 2=", "n": QUEUE + 1}, "n")])
def test_a_request_that_can_never_fit_is_a_400_and_queues_nothing(server, body, param):
    before = _cancelled(server)
    r = _post(server, "/v1/completions", {**body, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_choices" and err["param"] == param and "--max-queue" in err["message"]
    assert _cancelled(server) == before and server.engine.queue_depth == 0
    assert server.metrics.refusals.labels("too_many_choices")._value.get() >= 1


def test_the_300_prompt_request_in_a_loop_beside_ordinary_clients(server):
    stop = threading.Event()

    def flood() -> int:
        sent = 0
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                c.post("/v1/completions", json={"prompt": ["sort 1 2="] * 300, "max_tokens": 4})
                sent += 1
        return sent

    def ordinary(seed: int) -> list[int]:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return [c.post("/v1/completions", json={"prompt": "sort 3 1 2=", "max_tokens": 8, "seed": seed + i,
                                                    "n": 2}).status_code for i in range(4)]

    before = _cancelled(server)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        flooding = pool.submit(flood)
        codes = [pool.submit(ordinary, s) for s in (0, 100)]
        codes = [c for f in codes for c in f.result()]
        stop.set()
        assert flooding.result() >= 1
    assert codes == [200] * len(codes)
    assert _cancelled(server) == before


def test_a_request_is_queued_whole_or_refused_whole(demo):
    model, tok = demo
    metrics = ServeMetrics()
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok, max_queue=QUEUE,
                          metrics=metrics)  # not started: nothing leaves the queue

    def reqs(k: int) -> list[Request]:
        return [Request(prompt=_ids(tok, model, "sort 1 2="), config=engine.config.replace(max_new_tokens=4),
                        seed=i) for i in range(k)]

    engine.submit_all(reqs(QUEUE - 2))
    with pytest.raises(QueueFullError, match="room for 2 of these 3"):
        engine.submit_all(reqs(3))  # could fit later: refused whole now
    assert engine.queue_depth == QUEUE - 2 and engine.stats.requests["cancelled"] == 0
    engine.submit_all(reqs(2))
    assert engine.queue_depth == QUEUE
    engine.shutdown()
