"""The OpenAI-compatible HTTP server (FastAPI; SSE through sse-starlette) over one `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions (the checkpoint's own chat template, `text.encode_chat`),
GET /v1/models, GET /health, GET /metrics (Prometheus text, `metrics.ServeMetrics`).

Each choice of a request (`n` per prompt) is its own engine request in its own row, with its own seed: choice i of a
request with seed s uses `choice_seed(s, i)` (choice 0 uses s itself, so n=1 reproduces `gen.generate(seed=s)`); a
request without a seed draws a fresh one. Streaming sends one SSE event per finished block of each choice (its text
so far, stop strings held back), the last one with its finish_reason, then a usage event when
`stream_options.include_usage`, then `[DONE]`. A client that disconnects (streaming or not) has its rows freed at
the engine's next iteration.

Draft events (the extension `draft_every`: k >= 1, streaming only; opt-in per request, since each costs the
request's bucket a host read of the canvas every k steps): every k denoise steps of a block in flight, each choice
gets a chunk whose regular text is empty (`text` "" / `delta.content` "", so clients that ignore drafts see the same
text) and whose choice carries `"draft": {"text": ..., "block": b, "step": s}`: the block's current argmax canvas
as text (cut at eos, at the token budget and before a stop string), provisional, replaced by the block's own event.

Errors are OpenAI-shaped (`protocol.APIError`): malformed JSON, unknown or unsupported fields, bad values, prompts
beyond the context -> 400; an unknown model -> 404; a full queue -> 429. A request is validated whole before any of
its choices is queued, so a bad request never reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from ..config import ConfigError, GenerationConfig
from ..text import encode_chat, encode_prompt
from . import protocol as P
from .engine import BlockEvent, Engine, QueueFullError
from .engine import Request as EngineRequest
from .metrics import CONTENT_TYPE_LATEST

GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: seed + index * 0x9E3779B97F4A7C15 mod 2**64."""
    return (seed + index * GOLDEN) % 2**64


def create_app(engine: Engine, *, model_name: str, tokenizer, metrics=None) -> FastAPI:
    """The FastAPI app serving `engine` (started by the caller) as model `model_name`; `metrics`: the engine's
    `ServeMetrics` for /metrics (404 without)."""
    app = FastAPI(title="dgemma serve")
    created = int(time.time())
    bos = engine.model.config.bos_token_id

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "running": engine.running, "queued": engine.queue_depth,
                "buckets": engine.bucket_table()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dgemma_compile", "max_model_len": engine.max_seq_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise P.APIError(404, "metrics are off", type="not_found_error")
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def parse(request: Request, model: type) -> P._Common:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise P.APIError(400, "the body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            message, param = P.validation_message(e)
            raise P.APIError(400, message, param=param) from None
        if req.model is not None and req.model != model_name:
            raise P.APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                             param="model", code="model_not_found")
        return req

    def config_of(req: P._Common) -> GenerationConfig:
        changes = {"max_new_tokens": req.max_tokens, "max_denoising_steps": req.max_denoising_steps,
                   "entropy_bound": req.entropy_bound}
        try:
            cfg = engine.config.replace(**{k: v for k, v in changes.items() if v is not None})
            return cfg.with_temperature(req.temperature) if req.temperature is not None else cfg
        except ConfigError as e:
            raise _config_error(e) from None

    def submit(prompts: list[list[int]], req: P._Common, on_event) -> list[EngineRequest]:
        """Validate every choice, then queue them all (or none: 429)."""
        cfg = config_of(req)
        seed = req.seed if req.seed is not None else secrets.randbits(64)
        choices = [EngineRequest(prompt=p, config=cfg, seed=choice_seed(seed, i), stops=req.stops(),
                                 on_event=on_event, draft_every=req.draft_every or 0)
                   for p in prompts for i in range(req.n)]
        try:
            for c in choices:
                c.config = engine.check_request(c.prompt, c.config, c.seed)
        except ConfigError as e:
            raise _config_error(e) from None
        queued = []
        try:
            for c in choices:
                queued.append(engine.submit(c))
        except QueueFullError as e:
            for c in queued:
                engine.cancel(c)
            raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        return choices

    async def run(request: Request, prompts: list[list[int]], req: P._Common, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[BlockEvent] = asyncio.Queue()
        choices = submit(prompts, req, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        index = {id(c): i for i, c in enumerate(choices)}
        prompt_tokens = sum(len(p) for p in prompts)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if req.stream:
            return EventSourceResponse(_stream(request, engine, choices, index, events, req, rid, now, model_name,
                                               chat, prompt_tokens), ping=15)
        texts, reasons, tokens = [""] * len(choices), [None] * len(choices), [0] * len(choices)
        try:
            while any(r is None for r in reasons):
                try:
                    e = await asyncio.wait_for(events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                i = index[id(e.request)]
                if e.draft:
                    continue
                texts[i] += e.text
                if e.finish_reason is not None:
                    reasons[i], tokens[i] = e.finish_reason, e.completion_tokens
        finally:
            _cancel_unfinished(engine, choices, reasons)
        if "error" in reasons:
            raise P.APIError(500, "the engine failed while running this request", type="server_error")
        usage = P.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(tokens),
                        total_tokens=prompt_tokens + sum(tokens))
        finish = [P.FINISH_REASONS.get(r, r) for r in reasons]
        if chat:
            body = P.ChatCompletionResponse(
                id=rid, created=now, model=model_name, usage=usage,
                choices=[P.ChatChoice(index=i, message=P.AssistantMessage(content=t), finish_reason=f)
                         for i, (t, f) in enumerate(zip(texts, finish))])
        else:
            body = P.CompletionResponse(
                id=rid, created=now, model=model_name, usage=usage,
                choices=[P.CompletionChoice(index=i, text=t, finish_reason=f)
                         for i, (t, f) in enumerate(zip(texts, finish))])
        return JSONResponse(body.model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, P.CompletionRequest)
        p = req.prompt
        try:
            if isinstance(p, str):
                prompts = [encode_prompt(tokenizer, p, bos_token_id=bos)]
            elif p and all(isinstance(x, str) for x in p):
                prompts = [encode_prompt(tokenizer, x, bos_token_id=bos) for x in p]
            else:
                prompts = [list(p)]
        except ConfigError as e:
            raise _config_error(e) from None
        return await run(request, prompts, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, P.ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            prompt = encode_chat(tokenizer, messages, bos_token_id=bos)
        except ConfigError as e:
            raise _config_error(e) from None
        return await run(request, [prompt], req, chat=True)

    return app


def _draft_chunk(e: BlockEvent, i: int, rid: str, now: int, model_name: str, chat: bool) -> dict:
    """The SSE chunk of one draft event (see the module docstring)."""
    draft = {"text": e.text, "block": e.block, "step": e.step}
    if chat:
        choice = {"index": i, "delta": {"content": ""}, "logprobs": None, "finish_reason": None, "draft": draft}
        return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name, "choices": [choice]}
    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": None, "draft": draft}
    return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}


def _cancel_unfinished(engine: Engine, choices: list[EngineRequest], reasons: list) -> None:
    for c, r in zip(choices, reasons):
        if r is None:
            engine.cancel(c)


def _config_error(e: ConfigError) -> P.APIError:
    """A ConfigError ("name: problem") -> 400 naming the request parameter."""
    message = str(e)
    name = message.split(":", 1)[0]
    # the engine's names -> the request's ("max_seq_len": prompt + max_tokens beyond this server's cache)
    param = {"max_new_tokens": "max_tokens", "max_seq_len": "max_tokens", "prompts[0]": "prompt"}.get(name, name)
    code = "context_length_exceeded" if "context" in message or "max_seq_len" in message else None
    return P.APIError(400, message, param=param, code=code)


async def _stream(request: Request, engine: Engine, choices: list[EngineRequest], index: dict, events: asyncio.Queue,
                  req: P._Common, rid: str, now: int, model_name: str, chat: bool,
                  prompt_tokens: int) -> AsyncIterator[dict]:
    """The SSE events of one streamed request (see the module docstring); cancels unfinished choices when the
    client goes away (sse-starlette cancels this generator on a disconnect)."""
    reasons: list = [None] * len(choices)
    tokens = [0] * len(choices)
    started = [False] * len(choices)
    try:
        while any(r is None for r in reasons):
            e = await events.get()
            i = index[id(e.request)]
            if e.finish_reason == "cancelled":
                reasons[i] = e.finish_reason
                continue
            if e.draft:
                yield {"data": json.dumps(_draft_chunk(e, i, rid, now, model_name, chat))}
                continue
            finish = P.FINISH_REASONS.get(e.finish_reason, e.finish_reason) if e.finish_reason else None
            if e.finish_reason is not None:
                reasons[i], tokens[i] = e.finish_reason, e.completion_tokens
            if chat:
                delta = P.Delta(role=None if started[i] else "assistant", content=e.text)
                started[i] = True
                chunk = P.ChatCompletionChunk(id=rid, created=now, model=model_name,
                                              choices=[P.ChatChunkChoice(index=i, delta=delta, finish_reason=finish)])
                data = chunk.model_dump(exclude_none=False)
            else:
                data = {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [{"index": i, "text": e.text, "logprobs": None, "finish_reason": finish}]}
            yield {"data": json.dumps(data)}
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sum(tokens),
                     "total_tokens": prompt_tokens + sum(tokens)}
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield {"data": json.dumps({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [],
                                       "usage": usage})}
        yield {"data": "[DONE]"}
    finally:
        _cancel_unfinished(engine, choices, reasons)
