"""Live canvas frames (`frames.py`, issue 40 item 2): `generate(on_frame=...)` on both generators, the engine's frame
events, the server's `stream_options.include_canvas_frames` and `dgemma generate --live`.

- Each framed request gets one frame per denoise step of each block (steps 1..n), the last one holding the canvas
  its block committed; with a hot schedule the accepted positions grow over a block's steps.
- Frames never change tokens: a framed request's tokens equal its unframed run's (same seed), on the eager oracle
  and on the driver (the compiled generator's eager step; slow tier: its compiled step, whose frames are the
  oracle's), and a batch mate without frames gets no frame.
- The server: without the option a stream is byte for byte the stream recorded before frames existed
  (tests/fixtures/frames/*.sse, recorded on main at a2f4c90 by the same bodies, `id` and `created` normalised); with
  it, `canvas_frame` chunks come before each block's own chunk and the text is unchanged; without `stream` the
  option is a 400 naming it.
- The CLI: `--live` with stdout not a terminal prints exactly what it prints without, and says so on stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.step.frames import CanvasFrame
from dgemma_compile.inputs.text import encode_prompt

FIXTURES = Path(__file__).parents[1] / "fixtures" / "frames"
SORT = "sort 5 3 9 1 2="
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="  # two blocks: "1 0 9 8 7 6 5 4 " and "3 2 1"
SLOTS = 256


def _ids(tok, model, text: str) -> list[int]:
    return encode_prompt(tok, text, bos_token_id=model.config.bos_token_id)


def _hot(model, max_new_tokens: int = 24):
    """A schedule hot enough that the entropy bound renoises positions for several steps on the demo."""
    return model.generation_config.replace(max_new_tokens=max_new_tokens).with_temperature(3.0)


def _collect(frames: dict):
    return lambda i, f: frames.setdefault(i, []).append(f)


def _check_frames(frames: list[CanvasFrame], out, r: int, C: int) -> None:
    """Request r's frames: steps 1..n of each block, the block's last frame is the canvas it committed."""
    seq, st = out.sequences[r], out.stats[r]
    assert [(f.block, f.step) for f in frames] == [(b, k) for b, n in enumerate(st.steps_per_block)
                                                   for k in range(1, n + 1)]
    at = 0
    for b, n in enumerate(st.steps_per_block):
        last = [f for f in frames if f.block == b][-1]
        assert len(last.tokens) == len(last.accepted) == C and last.step == n
        kept = seq[at:at + C]
        assert last.tokens[:len(kept)] == kept  # the commit is the last frame's canvas (cut at eos / budget)
        at += len(kept)


def test_eager_frames(demo):
    """The eager oracle: one frame per step, the last of each block its committed canvas, accepted positions
    growing over the block's steps, and the same tokens as without frames."""
    model, tok = demo
    C, cfg = model.config.canvas_length, _hot(model)
    prompts = [_ids(tok, model, SORT), _ids(tok, model, REV)]
    frames: dict[int, list[CanvasFrame]] = {}
    out = dg.generate(model, prompts, cfg, seed=[1, 2], on_frame=_collect(frames), max_seq_len=SLOTS)
    plain = dg.generate(model, prompts, cfg, seed=[1, 2], max_seq_len=SLOTS)
    assert out.sequences == plain.sequences and [s.steps_per_block for s in out.stats] == \
        [s.steps_per_block for s in plain.stats]
    for r in range(2):
        _check_frames(frames[r], out, r, C)
    first = [f for f in frames[0] if f.block == 0]
    assert len(first) >= 3 and first[-1].accepted_count > first[0].accepted_count
    assert first[-1].mean_entropy < first[0].mean_entropy
    assert first[-1].text(tok) == tok.decode(first[-1].tokens, skip_special_tokens=True)


def test_driver_frames_equal_the_oracles(demo):
    """The driver (the compiled generator over its eager step): a framed request's frames are the oracle's (tokens,
    accepted positions, steps; entropy to float tolerance), its tokens and its unframed batch mate's are those of the
    run without frames, and only the request that asked gets frames."""
    model, tok = demo
    cfg = _hot(model)
    prompts = [_ids(tok, model, REV), _ids(tok, model, SORT)]
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=SLOTS))
    gen.defer(None)  # the step runs eagerly: no compile in the fast tier
    frames: dict[int, list[CanvasFrame]] = {}
    out = gen.generate(prompts, cfg, seed=[3, 4], on_frame=[_collect(frames), None])
    plain = gen.generate(prompts, cfg, seed=[3, 4])
    assert out.sequences == plain.sequences
    assert set(frames) == {0}
    _check_frames(frames[0], out, 0, model.config.canvas_length)
    oracle: dict[int, list[CanvasFrame]] = {}
    dg.generate(model, prompts[:1], cfg, seed=3, on_frame=_collect(oracle), max_seq_len=SLOTS, moe_impl=gen.moe_impl)
    assert [(f.block, f.step, f.tokens, f.accepted) for f in frames[0]] == \
        [(f.block, f.step, f.tokens, f.accepted) for f in oracle[0]]
    assert [f.mean_entropy for f in frames[0]] == pytest.approx([f.mean_entropy for f in oracle[0]], abs=1e-4)


@pytest.mark.slow  # compiles the demo's step (the session's `demo_gen`, shared with other slow tests)
def test_compiled_frames_equal_the_oracles(demo, demo_gen):
    """The compiled step writes the frames the eager oracle reads (tokens and accepted positions exactly, entropy to
    float tolerance), and a framed request's tokens are its unframed run's."""
    model, tok = demo
    cfg = _hot(model)
    prompts = [_ids(tok, model, REV), _ids(tok, model, SORT)]
    frames: dict[int, list[CanvasFrame]] = {}
    out = demo_gen.generate(prompts, cfg, seed=[3, 4], on_frame=_collect(frames))
    plain = demo_gen.generate(prompts, cfg, seed=[3, 4])
    assert out.sequences == plain.sequences
    for r in range(2):
        _check_frames(frames[r], out, r, model.config.canvas_length)
        oracle: dict[int, list[CanvasFrame]] = {}
        ref = dg.generate(model, prompts[r:r + 1], cfg, seed=3 + r, on_frame=_collect(oracle), max_seq_len=SLOTS,
                          moe_impl=demo_gen.moe_impl)
        assert ref.sequences[0] == out.sequences[r]
        assert [(f.block, f.step, f.tokens, f.accepted) for f in frames[r]] == \
            [(f.block, f.step, f.tokens, f.accepted) for f in oracle[0]]
        assert [f.mean_entropy for f in frames[r]] == pytest.approx([f.mean_entropy for f in oracle[0]], abs=1e-3)


def test_on_frame_is_checked(demo):
    model, tok = demo
    with pytest.raises(dg.ConfigError, match="on_frame"):
        dg.generate(model, [_ids(tok, model, SORT)], seed=0, on_frame=[print, print])
    with pytest.raises(dg.ConfigError, match="on_frame"):
        dg.generate(model, [_ids(tok, model, SORT)], seed=0, on_frame=[3])


def test_engine_frame_events(demo):
    """The engine: with `frames` a frame event per denoise step, the block's frames before its own event, the block
    events and tokens those without frames."""
    from dgemma_runtime import Engine, Request

    model, tok = demo
    cfg = _hot(model).resolved(model.config)
    runs = {}
    for frames in (False, True):
        engine = Engine(model, RowTable(model, (1, 2), max_seq_len=SLOTS, max_denoising_steps=64), tokenizer=tok)
        events = []
        req = engine.submit(Request(prompt=_ids(tok, model, REV), config=cfg, seed=5, frames=frames,
                                    on_event=events.append))
        while not engine.idle():
            engine.step()
        runs[frames] = req, events
    (plain, plain_events), (req, events) = runs[False], runs[True]
    assert req.sequence == plain.sequence and not any(e.frame for e in plain_events)
    blocks = [e for e in events if e.frame is None]
    assert [(e.tokens, e.text, e.finish_reason) for e in blocks] == \
        [(e.tokens, e.text, e.finish_reason) for e in plain_events]
    for b, n in enumerate(req.stats.steps_per_block):
        mine = [i for i, e in enumerate(events) if e.frame is not None and e.frame.block == b]
        assert [events[i].frame.step for i in mine] == list(range(1, n + 1))
        assert events[mine[-1] + 1] is blocks[b]  # the block's own event right after its last frame
        assert events[mine[-1]].text == tok.decode(events[mine[-1]].frame.tokens, skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)


# ----- the server ---------------------------------------------------------------------------------------------------
BODIES = {  # the bodies tests/fixtures/frames/*.sse were recorded with
    "completions": ("/v1/completions", {"model": "dgemma-demo", "prompt": REV, "max_tokens": 24, "seed": 7,
                                        "stream": True}),
    "chat": ("/v1/chat/completions", {"model": "dgemma-demo", "messages": [{"role": "user", "content": SORT}],
                                      "max_tokens": 24, "seed": 7, "stream": True, "temperature": 3.0,
                                      "stream_options": {"include_usage": True}}),
}


def _normalize(raw: bytes) -> bytes:
    raw = re.sub(rb'"id": "(cmpl|chatcmpl)-[0-9a-f]+"', rb'"id": "\1-X"', raw)
    return re.sub(rb'"created": [0-9]+', rb'"created": 0', raw)


@pytest.fixture(scope="module")
def frames_server(demo):
    from test_serve import eager_demo_server

    with eager_demo_server(demo) as srv:
        yield srv


def _raw(srv, path: str, body: dict) -> bytes:
    with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.read()


def _chunks(raw: bytes) -> list:
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
    return [json.loads(e) for e in events if e != "[DONE]"]


@pytest.mark.parametrize("name", sorted(BODIES))
def test_stream_without_frames_is_todays(frames_server, name):
    """Without the option, the stream's bytes are the ones recorded before frames existed."""
    path, body = BODIES[name]
    assert _normalize(_raw(frames_server, path, body)) == (FIXTURES / f"{name}.sse").read_bytes()


@pytest.mark.parametrize("name", sorted(BODIES))
def test_stream_with_frames(frames_server, demo, name):
    """With `include_canvas_frames`: a `canvas_frame` chunk per denoise step (empty regular text), each block's
    frames before its own chunk, the last frame's text the block's; the regular chunks are those without frames."""
    _, tok = demo
    path, body = BODIES[name]
    plain = _chunks(_raw(frames_server, path, body))
    opts = {**(body.get("stream_options") or {}), "include_canvas_frames": True}
    chunks = _chunks(_raw(frames_server, path, {**body, "stream_options": opts}))
    chat = name == "chat"
    text = (lambda c: c["delta"].get("content")) if chat else (lambda c: c["text"])
    strip = lambda cs: [{k: v for k, v in c.items() if k not in ("id", "created")} for c in cs]  # noqa: E731
    regular = [c for c in chunks if not (c["choices"] and "canvas_frame" in c["choices"][0])]
    assert strip(regular) == strip(plain)
    frames = [c["choices"][0] for c in chunks if c["choices"] and "canvas_frame" in c["choices"][0]]
    assert frames and all(text(c) == "" and c["finish_reason"] is None for c in frames)
    seen_block, step = 0, 0
    for c in chunks:
        choice = c["choices"][0] if c["choices"] else None
        if choice is None or (chat and "role" in choice["delta"]):
            continue
        f = choice.get("canvas_frame")
        if f is None:  # a block's own chunk: its frames came first, the last one its canvas
            assert step >= 1
            seen_block, step = seen_block + 1, 0
            continue
        assert set(f) == {"block", "step", "text", "tokens", "accepted", "mean_entropy"}
        assert f["block"] == seen_block and f["step"] == step + 1
        assert len(f["tokens"]) == len(f["accepted"]) and all(isinstance(a, bool) for a in f["accepted"])
        assert f["text"] == tok.decode(f["tokens"], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        step = f["step"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": SORT, "stream_options": {"include_canvas_frames": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SORT}],
                              "stream_options": {"include_canvas_frames": True}}),
])
def test_frames_need_stream(frames_server, path, body):
    r = httpx.post(frames_server.url + path, json={"model": "dgemma-demo", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options.include_canvas_frames" and "stream=true" in err["message"]


def test_openapi_documents_the_option(frames_server):
    schema = httpx.get(frames_server.url + "/openapi.json").json()
    prop = schema["components"]["schemas"]["StreamOptions"]["properties"]["include_canvas_frames"]
    assert prop["type"] == "boolean" and "canvas_frame" in prop["description"]


# ----- the CLI ------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # two CLI subprocesses (~5 s each)
def test_live_off_when_stdout_is_not_a_terminal(tmp_path):
    """`--live` with stdout a pipe: exactly the text printed without it, and a note on stderr."""
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "dgemma_compile.cli", "generate", REV, "--eager", "--seed", "3",
                               *extra], capture_output=True, timeout=300)

    plain, live = run(), run("--live")
    assert plain.returncode == live.returncode == 0, live.stderr
    assert live.stdout == plain.stdout and plain.stdout.strip()
    assert b"--live draws only on a terminal" in live.stderr
    assert b"--live" not in plain.stderr


def test_live_view_styles_accepted_and_renoised_positions(demo):
    """`--live`'s view (on a terminal): committed text, then each canvas position in its style, then the status line;
    transient (nothing left once it closes)."""
    import io

    from dgemma_compile.cli.live import ACCEPTED, RENOISED, LiveView

    model, tok = demo
    frame = CanvasFrame(block=1, step=3, tokens=[5, 14, 6, 14], accepted=[True, False, True, True], mean_entropy=0.25)
    out = io.StringIO()
    view = LiveView(tok, max_steps=16, file=out)
    view.commit("1 0 9 ")
    text = view.render(frame)
    assert text.plain == "1 0 9 " + "".join(frame.pieces(tok)) + \
        "\nblock 1 · step 3/16 · accepted 3/4 · mean entropy 0.250 nats"
    styles = [str(s.style) for s in text.spans]
    assert styles[:4] == [ACCEPTED, RENOISED, ACCEPTED, ACCEPTED]
    with view:
        view.frame(0, frame)
    assert view.frames == 1
