"""Serving and generating over tensor-parallel ranks (runtime/parallel.py, dgemma_compile/cli/ranks.py,
docs/parallel.md "Serving").

Fast: rank 0's schedule replayed by a follower engine in the same process (an in-memory host channel, two eager
buckets over the demo model): the follower admits, cancels, stops and steps exactly as the leader, under requests and
cancellations arriving from other threads at any time, and both give `dg.generate`'s tokens; a lost leader ends the
follower with a clear error. Slow: `dgemma generate|serve --tensor-parallel-size 2` as subprocesses on gloo ranks
against the single process, and a killed rank ending the server with an error line.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.cli.ranks import ParallelError, world_size_for
from dgemma_compile.inputs.text import encode_prompt
from dgemma_runtime import Engine, Request
from dgemma_runtime.parallel import ParallelSchedule
from helpers import wait_for_health

SLOTS = 256
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="  # two blocks


class PairChannel:
    """An in-memory `HostChannel` of 2 ranks: what rank 0 sends, rank 1 receives (pickled, as over gloo)."""

    def __init__(self, q: queue.Queue, rank: int, timeout_s: float = 4.0):
        self.q, self.rank, self.world_size, self.timeout_s = q, rank, 2, timeout_s
        self.leader = rank == 0
        self.sent = 0

    def send(self, message=None):
        self.sent += 1
        self.q.put(pickle.dumps(message))
        return message

    def receive(self):
        try:
            return pickle.loads(self.q.get(timeout=self.timeout_s))
        except queue.Empty:
            raise RuntimeError(f"Timed out waiting {self.timeout_s * 1000:.0f}ms for recv operation") from None


def _engine(model, tok, channel, events=None):
    row_table = RowTable(model, (1, 2), max_seq_len=SLOTS, max_denoising_steps=64)
    eng = Engine(model, row_table, tokenizer=tok, schedule=ParallelSchedule(channel))
    if events is not None:  # record every final event by request id
        base = eng._emit

        def emit(req, event):
            if event.finish_reason is not None:
                events[req.id] = (list(req.sequence), event.finish_reason, list(req.stats.steps_per_block),
                                  event.text)
            base(req, event)

        eng._emit = emit
    return eng


def test_world_size_from_the_flag_or_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_size_for(None) == 1 and world_size_for(4) == 4
    with pytest.raises(ParallelError, match="tensor_parallel_size: must be a positive integer, got 0"):
        world_size_for(0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert world_size_for(None) == 2 and world_size_for(2) == 2
    with pytest.raises(ParallelError, match="tensor_parallel_size: 4, but torchrun started WORLD_SIZE=2"):
        world_size_for(4)


@pytest.mark.slow  # ~4-8 s: eager steps of two engines, first use of their shapes
def test_follower_replays_rank_0s_schedule(demo):
    """Requests submitted and cancelled from another thread while rank 0's engine runs (stop strings, a cancel, a
    consumer that fails, more requests than rows): the follower ends every request as rank 0 does, with the same
    tokens, steps and reasons, having stepped the same number of times; uncancelled ones equal `dg.generate`."""
    model, tok = demo
    q: queue.Queue = queue.Queue()
    lead_events, follow_events = {}, {}
    lead = _engine(model, tok, PairChannel(q, 0), lead_events)
    follow = _engine(model, tok, PairChannel(q, 1), follow_events)
    follower = threading.Thread(target=follow.follow, daemon=True)
    follower.start()
    lead.start()
    cfg = model.generation_config
    ids = lambda text: encode_prompt(tok, text, bos_token_id=2)  # noqa: E731

    def broken(event):
        raise ValueError("consumer gone")

    texts = [REV, "sort 3 1 2 9 5=", REV, "dedup 3 1 3 2="]
    reqs = []
    for k, text in enumerate(texts):
        r = Request(prompt=ids(text), config=cfg, seed=k, stops=("7 6",) if k == 2 else (),
                    on_event=broken if k == 3 else (lambda e: None))
        reqs.append(lead.submit(r))
        if k == 1:
            lead.cancel(reqs[0])  # whenever the engine thread sees it
        time.sleep(0.01 * k)
    deadline = time.time() + 60
    while len(lead_events) < len(texts):
        assert time.time() < deadline, "rank 0 did not finish its requests"
        time.sleep(0.02)
    lead.shutdown()
    follower.join(10)
    assert not follower.is_alive()
    assert follow_events == lead_events
    assert follow.stats.forwards == lead.stats.forwards and follow.stats.requests == lead.stats.requests
    assert lead_events[reqs[0].id][1] in ("cancelled", "eos")
    assert lead_events[reqs[2].id][1] == "stop" and "7 6" not in lead_events[reqs[2].id][3]
    assert lead_events[reqs[3].id][1] in ("cancelled", "eos")  # its consumer failed at its first event
    ref = dg.generate(model, [reqs[1].prompt], cfg, seed=1, moe_impl="dense", max_seq_len=SLOTS)
    assert lead_events[reqs[1].id][0] == ref.sequences[0]


def test_follower_without_rank_0_exits_with_a_clear_error(demo):
    """No schedule within the channel's timeout (rank 0 died or stalled): `follow` raises naming the rank and the
    timeout, after `on_fatal` got the same message."""
    model, tok = demo
    fatal = []
    follow = _engine(model, tok, PairChannel(queue.Queue(), 1, timeout_s=0.2))
    follow.on_fatal = fatal.append
    with pytest.raises(RuntimeError, match=r"tensor parallel: rank 1 of 2: .*Timed out waiting 200ms") as e:
        follow.follow()
    assert fatal == [str(e.value)] and "group timeout (0 s)" in fatal[0]
    from dgemma_compile.parallel import ParallelError  # the CLI's rank runner prints it as it is, by its class

    assert isinstance(e.value, ParallelError)


# ----- slow: the CLI on 2 gloo ranks -----------------------------------------------------------------------------
def _cli(*args, stdin=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "dgemma_compile.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _expected(model, tok, prompt: str, seed: int, max_new_tokens: int = 12) -> dict:
    cfg = model.generation_config.replace(max_new_tokens=max_new_tokens)
    out = dg.generate(model, [tok(prompt)["input_ids"]], cfg, seed=seed, max_seq_len=SLOTS)
    st = out.stats[0]
    return {"text": tok.decode(out.sequences[0], skip_special_tokens=True), "num_tokens": st.num_tokens,
            "finish_reason": st.finish_reason, "steps_per_block": st.steps_per_block}


@pytest.mark.slow
@pytest.mark.parametrize("quant", [None, "fp8-weight-only"])
def test_cli_generate_on_2_ranks_equals_one_process(demo, quant):
    """`dgemma generate --tensor-parallel-size 2 --prompts-file -`: rank 0 reads stdin and shares it, both ranks run
    the batch over the sharded model, rank 0 alone writes; every result equals the single-process eager generator's.
    With `--quant`: every rank quantizes the whole model, then shards it (rank 0 alone prints the report); the
    results are the quantized single process's.
    """
    model, tok = demo
    if quant is not None:
        model = dg.load(model.checkpoint.directory)
        dg.quantize(model, quant)
    lines = ["sort 3 1 2 9 5=", '{"prompt": "add 123+045=", "seed": 3}']
    res = _cli("generate", "--prompts-file", "-", "--eager", "--threads", "1", "--max-new-tokens", "12",
               "--tensor-parallel-size", "2", *(["--quant", quant] if quant else []), stdin="\n".join(lines))
    assert res.returncode == 0, res.stderr
    assert res.stderr.count(f"quant {quant} (numerics") == (quant is not None)
    results = [json.loads(r) for r in res.stdout.splitlines()]
    prompts = [("sort 3 1 2 9 5=", 0), ("add 123+045=", 3)]
    assert results == [{"line": i, **_expected(model, tok, p, seed)} for i, (p, seed) in enumerate(prompts, 1)]
    assert res.stderr.count("prompts=2 errors=0") == 1  # rank 0's stats line only


def _children(pid: int) -> list[int]:
    """The started ranks of a `dgemma ... --tensor-parallel-size` process (multiprocessing spawn children)."""
    out = []
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        if "spawn_main" in open(f"/proc/{child}/cmdline").read().replace("\0", " "):
            out.append(int(child))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cli_serve_on_2_ranks_answers_as_one_process_and_ends_when_a_rank_dies(demo):
    """`dgemma serve --tensor-parallel-size 2`: one HTTP front end (rank 0), concurrent completions equal to the
    single-process eager generator (moe "dense": the server's batch-invariant CPU default); then rank 1 is killed
    and the server exits 1 with one error line naming tensor parallel instead of hanging."""
    import httpx

    model, tok = demo
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_compile.cli", "serve", "--eager", "--port", str(port),
                             "--max-batch", "2", "--max-seq-len", str(SLOTS), "--threads", "1",
                             "--tensor-parallel-size", "2", "--group-timeout", "30"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for_health(proc, port, timeout_s=120)
        prompts = [("sort 3 1 2 9 5=", 0), ("add 123+045=", 4)]
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            p, seed = prompts[i]
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "dgemma-demo", "prompt": p, "seed": seed, "max_tokens": 12})
            answers[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        cfg = model.generation_config.replace(max_new_tokens=12)
        for i, (p, seed) in enumerate(prompts):
            from dgemma_runtime.http.server import choice_seed

            ref = dg.generate(model, [tok(p)["input_ids"]], cfg, seed=choice_seed(seed, 0), moe_impl="dense",
                              max_seq_len=SLOTS)
            assert answers[i] == tok.decode(ref.sequences[0], skip_special_tokens=True), p
        (rank1,) = _children(proc.pid)
        os.kill(rank1, signal.SIGKILL)
        try:  # the next iteration (a heartbeat within 30 / 4 s, or this request) finds the peer gone
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "dgemma-demo", "prompt": REV, "seed": 0})
        except httpx.HTTPError:
            pass
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.stderr.read()
    assert "tensor_parallel_size=2" in err
    assert code == 1, err
    errors = [ln for ln in err.splitlines() if ln.startswith("dgemma: error:")]
    assert len(errors) == 1 and re.match(r"dgemma: error: tensor parallel: rank 0 of 2: ", errors[0]), err
