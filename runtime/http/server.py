"""The OpenAI-compatible HTTP server (FastAPI; SSE through sse-starlette) over one `Engine`.

Routes: POST /v1/completions, POST /v1/chat/completions (the checkpoint's own chat template, `text.encode_chat`),
GET /v1/models, GET /v1/models/{id} (404 for another id), POST /tokenize and /detokenize and GET /tokenizer_info
(vLLM's shapes), GET /health, GET /metrics (Prometheus text, `metrics.ServeMetrics`); /openapi.json documents every
request body and error.

Each choice of a request (`n` per prompt) is its own engine request in its own row, with its own seed: choice i of a
request with seed s uses `choice_seed(s, i)` (choice 0 uses s itself, so n=1 reproduces `gen.generate(seed=s)`); a
request without a seed draws a fresh one.

`temperature` scales the checkpoint's schedule (`GenerationConfig.with_temperature`); 0 makes every denoise step's
candidates greedy (argmax), but the start canvas of each block and the renoise of unaccepted positions are still
drawn from the request's random stream, so answers repeat only with a `seed` (with one, they repeat at any
temperature).

Streaming (SSE, each event framed `data: ...\\n\\n` as vLLM sends and its bench client splits): chat streams begin
with one role chunk per choice (`delta` {"role": "assistant", "content": ""}), before any other chunk; then ONE
event per committed block of each choice (`delta` {"content": ...} / `text`: the block's text, stop strings held
back), the last one with its finish_reason, then a usage event when `stream_options.include_usage`, then `[DONE]`.
One event holds a whole block (up to the canvas length of tokens, committed together), so a client's
"time to first token" is the time to the first committed block and its "inter-token latency" is the time between
blocks; divide by the tokens in an event for a per-token figure. `stream_options.continuous_usage_stats` adds the
usage so far to every chunk. An engine failure mid-stream sends `data: {"error": {...}}` and `[DONE]`. With
logprobs, a chunk's `logprobs` covers the tokens behind the text it adds (see "Logprobs").

Usage: `prompt_tokens` counts the ids the model reads, BOS included: the token ids a client sent, or the tokenizer's
encoding of the text / rendered template (what `tokenizer(text)["input_ids"]` gives with the checkpoint's own
tokenizer, as vLLM counts); `completion_tokens` counts the generated tokens behind the returned text, the eos that
ended an answer NOT counted (so it equals the client tokenizer's count of the returned text wherever the text
re-tokenizes to the same ids; at a stop string, the shortest prefix whose text covers what was returned).

Logprobs (completions `logprobs: k`; chat `logprobs: true` with `top_logprobs: k`; k at most the server's
`--max-logprobs`, `Engine.max_logprobs`, else a 400 naming the field and the limit): per returned token, its
log-probability and the k most likely tokens' in the model's distribution at the denoise step whose argmax canvas
was committed (a block's last step; each committed token is that step's argmax, so it is the top alternative
whenever k >= 1), at temperature 1: log_softmax of the model's own (softcapped) logits, vLLM's default "raw"
logprobs; the request's temperature schedule shapes the sampling, not these. Token strings are each id decoded
alone (vLLM's rule; a special token as its string, e.g. "<eos>" kept as an ordinary token with `ignore_eos`). The
entries cover exactly the tokens `completion_tokens` counts (the usage rule below): the eos that ended an answer has
NO entry (it is not part of the answer; vLLM returns one and counts it), and at a stop string only the shortest
prefix covering the returned text has entries. Completions: OpenAI's legacy shape {"tokens", "token_logprobs",
"top_logprobs": [{string: log p}] (the k most likely and the token itself: k entries, k + 1 where the token is not
among them, so 1 for k = 0, as vLLM), "text_offset"} (each token string's offset in the choice's token strings
joined: its offset in `text` wherever they join into it); chat: {"content": [{"token", "logprob", "bytes" (the
string's UTF-8), "top_logprobs": [k of {"token", "logprob", "bytes"}]}], "refusal": null}. Streamed, each chunk
carries the entries of the tokens behind the text it adds (a token whose text is held back, e.g. as the possible
start of a stop string, comes with the chunk that shows it), so a stream's entries joined equal the non-streamed
ones. Each choice's entries are its own row's (the engine reads each row's; a batch mate's never). `echo` with
logprobs (the prompt's) is refused: a block-diffusion model encodes its prompt causally, with no distribution over
it.

Text prompts may hold the tokenizer's special tokens written literally (vLLM's bench renders its custom dataset
through the chat template, so its completions prompts start with "<bos>"): they encode as those tokens, as the
tokenizer splits them out (only the characters between them must be in the vocabulary), and a leading BOS run
collapses into the one BOS at position 0, so `prompt_tokens` counts it once.

Draft events (the extension `draft_every`: k >= 1, streaming only; opt-in per request, since each costs the
request's bucket a host read of the canvas every k steps): every k denoise steps of a block in flight, each choice
gets a chunk whose regular text is empty (`text` "" / `delta.content` "", so clients that ignore drafts see the same
text) and whose choice carries `"draft": {"text": ..., "block": b, "step": s}`: the block's current argmax canvas
as text (cut at eos, at the token budget and before a stop string), provisional, replaced by the block's own event.

Live canvas frames (the extension `stream_options.include_canvas_frames: true`, streaming only, else a 400 naming
the field; opt-in per request, since each costs the request's bucket a host read every denoise step): after every
denoise step of a block in flight, each choice gets a chunk whose regular text is empty (as a draft's) and whose
choice carries `"canvas_frame": {"block", "step", "text", "tokens", "accepted", "mean_entropy"}`: the block's argmax
canvas after that step (C token ids and their text, special tokens skipped; not cut), which positions the step
accepted (the others were renoised) and the step's mean entropy in nats (`frames.CanvasFrame`); the frames of a
block come before its own chunk. A request without the option gets exactly the stream it got before.

Errors are OpenAI-shaped (`protocol.APIError`; FastAPI's and Starlette's own 404 / 405 too, and with `api_key` a
401 from `auth.APIKeyAuth`; types are strict, as OpenAI's; docs/serving.md "One error shape"): malformed JSON (also NaN / Infinity and nesting deeper than
`limits.MAX_DEPTH`), unknown or unsupported fields, bad values, prompts beyond the context, parsing + tokenization
past `input_timeout_s` -> 400; an unknown model -> 404; a body over `max_body_bytes` -> 413; a full queue -> 429; an
engine failure -> 500 for the requests it hit alone. A request is validated whole before any of its choices is
queued, so a bad request never reaches the engine. Parsing, tokenization and template rendering of a body over
`limits.INLINE_BYTES` run in worker threads (`limits.offload`), never on the event loop; smaller ones in place. Grammars compile in worker
processes bounded in size, time and memory (`grammars.GrammarService`), killed when their request ends. A client that disconnects (streaming or not) has its rows
freed at the engine's next iteration, finish reason "cancelled".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma_compile.inputs.constraint import GrammarLibrary
from dgemma_compile.inputs.images import prepare as prepare_images
from dgemma_compile.inputs.text import ImageSlots, chat_template, encode_chat, encode_prompt
from dgemma_compile.model.config import CONTEXT_LENGTH, ConfigError, GenerationConfig
from dgemma_compile.step.canvas import canvas_of
from ..engine import BlockEvent, Engine, QueueFullError
from ..engine import Request as EngineRequest
from . import protocol as P
from .auth import APIKeyAuth, Secret
from .errors import ErrorCounter
from .grammars import GrammarLimits, GrammarService
from .limits import DEFAULT_INPUT_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit, offload, parse_json
from .metrics import CONTENT_TYPE_LATEST
from .openapi import document as openapi_document
from .structured import FIELDS as STRUCTURED_FIELDS, request_constraint
from .tool_calls import ToolAnswer, ToolRequest, resolve_tools, template_messages

GOLDEN = 0x9E3779B97F4A7C15
ERRORS = {400: "invalid request: malformed JSON, an unknown or unsupported field, a bad value, a prompt beyond the "
               "context", 404: "unknown model", 413: "body over the server's --max-body-bytes",
          429: "queue full", 500: "the engine failed while running this request"}
BODIES = {"/v1/completions": P.CompletionRequest, "/v1/chat/completions": P.ChatCompletionRequest,
          "/tokenize": P.TokenizeRequest, "/detokenize": P.DetokenizeRequest}


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: seed + index * 0x9E3779B97F4A7C15 mod 2**64."""
    return (seed + index * GOLDEN) % 2**64


def _responses(ok: type, *codes: int) -> dict:
    return {200: {"model": ok}, **{c: {"model": P.ErrorResponse, "description": ERRORS[c]} for c in codes}}


def _body(path: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{BODIES[path].__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


MAX_IMAGES = 8
"""The most image_url parts one chat request may hold."""


class Server:
    """What the routes of one app share (`app.state.server`): the engine, the model's name and tokenizer, and the way
    a request reaches the engine -- its body parsed and tokenized off the event loop (bounded), validated whole into
    engine requests, its grammar compiled in a worker process, its answer collected or streamed. Built by
    `create_app` (its arguments are this object's fields)."""

    def __init__(self, engine: Engine, *, model_name: str, tokenizer, metrics, image_sources, input_timeout_s: float,
                 grammars: GrammarService):
        self.engine, self.model_name, self.tokenizer, self.metrics = engine, model_name, tokenizer, metrics
        self.image_sources, self.input_timeout_s, self.grammars = image_sources, input_timeout_s, grammars
        self.created = int(time.time())
        self.bos = engine.model.config.bos_token_id
        self.vocab = engine.model.config.vocab_size
        self.strings: dict[int, str] = {}  # id -> its string, decoded alone (at most the vocabulary)

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dgemma_compile",
                "max_model_len": self.engine.max_seq_len}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise P.APIError(404, f"model {P.cut(name)} does not exist; this server serves {self.model_name!r}",
                             param="model", type="not_found_error", code="model_not_found")

    @staticmethod
    def validate(raw: bytes, model: type):
        body = parse_json(raw)
        try:
            return model.model_validate(body, strict=True)  # OpenAI's types: no "0.5" for 0.5, no true for 1
        except ValidationError as e:
            message, param = P.validation_message(e)
            raise P.APIError(400, message, param=param) from None

    async def parse(self, request: Request, model: type):
        raw = await request.body()
        request.state.body_bytes = len(raw)
        req = await offload(self.validate, raw, model, timeout=self.input_timeout_s, what="parsing the body",
                            size=len(raw))
        self.check_model(req.model)
        return req

    async def tokenize(self, request: Request | None, fn, *args):
        """`fn(*args)` (tokenization, template rendering, image reading) off the event loop, bounded; in place for a
        small body (`limits.INLINE_BYTES`) of `request`; None: work the body's size does not bound (images: a short
        URL can name a large one), always in a worker thread. ConfigError -> 400."""
        try:
            return await offload(fn, *args, timeout=self.input_timeout_s, what="tokenizing", param="prompt",
                                 size=None if request is None else request.state.body_bytes)
        except ConfigError as e:
            raise _config_error(e) from None

    def config_of(self, req: P.GenerationRequest) -> GenerationConfig:
        changes = {"max_new_tokens": req.max_tokens, "max_denoising_steps": req.max_denoising_steps,
                   "entropy_bound": req.entropy_bound, "ignore_eos": req.ignore_eos}
        try:
            cfg = self.engine.config.replace(**{k: v for k, v in changes.items() if v is not None})
            return cfg.with_temperature(req.temperature) if req.temperature is not None else cfg
        except ConfigError as e:
            raise _config_error(e, req.budget_param) from None

    def logprobs_of(self, req: P.GenerationRequest, chat: bool) -> int | None:
        """The k of the request's logprobs (None: none asked), at most `engine.max_logprobs` (else a 400)."""
        limit = self.engine.max_logprobs
        if chat:
            if not req.logprobs:
                return None
            k, name, most = req.top_logprobs or 0, "top_logprobs", min(20, limit)
        else:
            k, name, most = req.logprobs, "logprobs", limit
        if k is not None and k > most:
            raise P.APIError(400, f"{name}: {k} is more than this server allows: 0 to {most} (its --max-logprobs is "
                                  f"{limit})", param=name)
        return k

    def constraint_of(self, req: P.GenerationRequest, tool: ToolRequest | None):
        """(the request's constraint, the field it came from): a structured-output field's, or the enforced tool
        choice's (field "tool_choice"); both at once is a 400."""
        constraint, field = request_constraint({name: getattr(req, name) for name in STRUCTURED_FIELDS})
        if tool is not None and tool.constraint is not None:
            if constraint is not None:
                raise P.APIError(400, f"tool_choice: {tool.choice} tool calls are enforced by a grammar, which "
                                      f"cannot be combined with {field}", param="tool_choice")
            return tool.constraint, "tool_choice"
        return constraint, field

    def canvas_of_request(self, req: P.GenerationRequest, cfg: GenerationConfig):
        """The request's seeded / pinned canvas (`dgemma_compile.step.canvas`) from `diffusion_seed_canvas` and
        `diffusion_pinned`, or None; a bad one is a 400 naming the field."""
        if req.diffusion_seed_canvas is None:
            return None
        try:
            return canvas_of(req.diffusion_seed_canvas, cfg, self.engine.model.config.vocab_size, self.tokenizer,
                             pinned=req.diffusion_pinned is not False, name="diffusion_seed_canvas")
        except ConfigError as e:
            message = str(e).replace("max_new_tokens=", f"{req.budget_param}=")  # the request's name of the budget
            if e.param == "tokenizer":
                message = "diffusion_seed_canvas: a text canvas needs the server's tokenizer; give token ids"
            raise P.APIError(400, message, param="diffusion_seed_canvas") from None

    def submit(self, prompts: list[list[int]], req: P.GenerationRequest, on_event, logprobs: int | None,
               images=None, tool: ToolRequest | None = None, compiled=None) -> list[EngineRequest]:
        """Validate every choice, then queue them all (or none: 429; a constraint the grammar library cannot
        compile: 400 naming the field it came from). `images`: the prompt's `images.ImagePrompt` (one prompt),
        shared by its choices."""
        cfg = self.config_of(req)
        constraint, field = self.constraint_of(req, tool)
        canvas = self.canvas_of_request(req, cfg)
        seed = req.seed if req.seed is not None else secrets.randbits(64)
        choices = [EngineRequest(prompt=p, config=cfg, seed=choice_seed(seed, i), stops=req.stops(),
                                 on_event=on_event, draft_every=req.draft_every or 0, logprobs=logprobs,
                                 frames=req.stream_options is not None and req.stream_options.include_canvas_frames,
                                 images=images, constraint=constraint, compiled=compiled, canvas=canvas)
                   for p in prompts for i in range(req.n)]
        try:
            for c in choices:
                c.config = self.engine.check_request(c.prompt, c.config, c.seed, c.images)
        except ConfigError as e:
            prompt_param = "messages" if getattr(req, "messages", None) is not None else "prompt"
            raise _context_error(e, self.engine, len(c.prompt), cfg.max_new_tokens, prompt_param,
                                 req.budget_param) from None
        try:
            self.engine.submit_all(choices)  # all of them or none
        except QueueFullError as e:
            raise P.APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ConfigError as e:  # the constraint's (a matcher made at submit)
            if field is not None and e.param in ("constraint", "ignore_eos", "tokenizer"):
                raise P.APIError(400, f"{field}: {e.problem}", param=field) from None
            raise _config_error(e, req.budget_param) from None
        return choices

    async def compile_grammar(self, request: Request, constraint, field: str):
        """The request's compiled grammar (`grammars.GrammarService`: a worker process, bounded), or None when the
        client went away first (the compile's process is killed)."""
        task = asyncio.ensure_future(self.grammars.compile(constraint, field, self.input_timeout_s))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task.done() else None
        finally:
            for t in (task, gone):
                if not t.done():
                    t.cancel()
            with contextlib.suppress(asyncio.CancelledError, P.APIError):
                await task

    async def run(self, request: Request, prompts: list[list[int]], req: P.GenerationRequest, chat: bool, images=None,
                  tool: ToolRequest | None = None):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[BlockEvent] = asyncio.Queue()
        k = self.logprobs_of(req, chat)
        constraint, field = self.constraint_of(req, tool)
        count = len(prompts) * req.n
        if count > self.engine.max_queue:  # could never be queued whole: a 400, not a 429 a client would retry
            param = "n" if req.n > 1 else "prompt"
            raise P.APIError(400, f"{param}: {len(prompts)} prompt(s) x n={req.n} = {count} choices, more than this "
                                  f"server's queue can ever hold ({self.engine.max_queue}, dgemma serve --max-queue)",
                             param=param, code="too_many_choices")
        compiled = None
        if constraint is not None:
            compiled = await self.compile_grammar(request, constraint, "tools" if field == "tool_choice" else field)
            if compiled is None:
                return Response(status_code=499)
        choices = self.submit(prompts, req, lambda e: loop.call_soon_threadsafe(events.put_nowait, e), k, images, tool,
                              compiled)
        index = {id(c): i for i, c in enumerate(choices)}
        lps = [None if k is None else _ChoiceLogprobs(self.tokenizer, self.token_string, chat) for _ in choices]
        answers = [ToolAnswer(self.tokenizer, tool, frozenset(c.config.eos_token_ids))
                   if tool is not None and tool.parse else None for c in choices]
        prompt_tokens = sum(len(p) for p in prompts)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if req.stream:
            return EventSourceResponse(_stream(self.engine, choices, index, events, req, rid, now, self.model_name,
                                               chat, prompt_tokens, lps, answers), ping=15, sep="\n")
        texts, reasons, tokens = [""] * len(choices), [None] * len(choices), [0] * len(choices)
        gone = asyncio.create_task(_disconnected(request))
        gone.add_done_callback(lambda t: t.cancelled() or [self.engine.cancel(c) for c in choices])
        try:
            while any(r is None for r in reasons):
                e = await events.get()
                i = index[id(e.request)]
                if e.draft or e.frame is not None:
                    continue
                texts[i] += e.text
                if answers[i] is not None:
                    answers[i].add(e.tokens)
                if lps[i] is not None and e.finish_reason not in ("cancelled", "error"):
                    lps[i].add(e)
                if e.finish_reason is not None:
                    reasons[i], tokens[i] = e.finish_reason, _completion_tokens(e)
        finally:
            if not gone.done():
                gone.cancel()
            _cancel_unfinished(self.engine, choices, reasons)
        if gone.done() and not gone.cancelled():
            return Response(status_code=499)
        if "error" in reasons:
            raise P.APIError(500, ERRORS[500], type="server_error")
        usage = P.Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(tokens),
                        total_tokens=prompt_tokens + sum(tokens))
        finish = [P.FINISH_REASONS.get(r, r) for r in reasons]
        logprobs = [None if lp is None else lp.take(n) for lp, n in zip(lps, tokens)]
        if chat:
            messages = [P.AssistantMessage(content=t) for t in texts]
            for i, a in enumerate(answers):
                if a is not None:
                    content, calls = a.message()
                    messages[i] = P.AssistantMessage(content=content, tool_calls=calls)
                    finish[i] = a.finish_reason(reasons[i])
            body = P.ChatCompletionResponse(
                id=rid, created=now, model=self.model_name, usage=usage,
                choices=[P.ChatChoice(index=i, message=m, finish_reason=f, logprobs=lp)
                         for i, (m, f, lp) in enumerate(zip(messages, finish, logprobs))])
        else:
            body = P.CompletionResponse(
                id=rid, created=now, model=self.model_name, usage=usage,
                choices=[P.CompletionChoice(index=i, text=t, finish_reason=f, logprobs=lp)
                         for i, (t, f, lp) in enumerate(zip(texts, finish, logprobs))])
        return JSONResponse(body.model_dump())

    def token_string(self, token: int) -> str:
        s = self.strings.get(token)
        if s is None:
            s = self.strings[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
        return s

    def encode_completion(self, prompts: list) -> list[list[int]]:
        return [encode_prompt(self.tokenizer, p, bos_token_id=self.bos) if isinstance(p, str) else list(p)
                for p in prompts]

    def read_images(self, parts: list[tuple[str, str]]) -> tuple[list, ImageSlots]:
        """The images of a chat's image_url parts (`preprocess.open_image_url` under `image_sources`), preprocessed,
        and their placeholders; ConfigError naming the part: a model without a vision encoder, too many images, a URL
        not allowed, a bad image."""
        from dgemma_compile.inputs.preprocess import ImageSources, num_soft_tokens, open_image_url, preprocess

        model = self.engine.model
        first = parts[0][0]
        if model.vision is None:
            raise ConfigError(first, "image_url parts need a model with a vision encoder; this one has none")
        if len(parts) > MAX_IMAGES:
            raise ConfigError(parts[MAX_IMAGES][0], f"more than the {MAX_IMAGES} images a request may hold")
        sources = self.image_sources or ImageSources()
        pil = [open_image_url(url, name, sources) for name, url in parts]
        images = preprocess(model, pil)
        return images, ImageSlots.for_model(self.tokenizer, model, [num_soft_tokens(model, im) for im in images])

    def chat_ids(self, messages: list[dict], **kw) -> list[int]:
        """`text.encode_chat`, a message text it refuses (empty, or characters the tokenizer cannot encode) named
        as the request names it, `messages[i].content`."""
        return encode_chat(self.tokenizer, messages, bos_token_id=self.bos,
                           name_of=lambda i, _: f"messages[{i}].content", **kw)

    def tokenize_request(self, req: P.TokenizeRequest) -> list[int]:
        if req.messages is not None:
            return self.chat_ids([m.template_dict() for m in req.messages],
                            add_generation_prompt=req.add_generation_prompt)
        if req.add_special_tokens:
            return encode_prompt(self.tokenizer, req.prompt, bos_token_id=self.bos)
        return [int(t) for t in self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]]


router = APIRouter()
"""The routes; each reads its app's `Server` from `request.app.state.server`."""


@router.get("/health")
async def health(request: Request) -> dict:
    server: Server = request.app.state.server
    return {"status": "ok", "running": server.engine.running, "queued": server.engine.queue_depth,
            "buckets": server.engine.bucket_table(), "compile": server.engine.compile_state()}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    server: Server = request.app.state.server
    return {"object": "list", "data": [server.model_card()]}


@router.get("/v1/models/{model_id:path}", responses={404: {"model": P.ErrorResponse}})
async def model(request: Request, model_id: str) -> dict:
    server: Server = request.app.state.server
    server.check_model(model_id)
    return server.model_card()


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    server: Server = request.app.state.server
    if server.metrics is None:
        raise P.APIError(404, "metrics are off", type="not_found_error")
    return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions", openapi_extra=_body("/v1/completions"),
             responses=_responses(P.CompletionResponse, 400, 404, 413, 429, 500))
async def completions(request: Request):
    server: Server = request.app.state.server
    req = await server.parse(request, P.CompletionRequest)
    prompts = await server.tokenize(request, server.encode_completion, req.prompts())
    return await server.run(request, prompts, req, chat=False)


@router.post("/v1/chat/completions", openapi_extra=_body("/v1/chat/completions"),
             responses=_responses(P.ChatCompletionResponse, 400, 404, 413, 429, 500))
async def chat_completions(request: Request):
    server: Server = request.app.state.server
    req = await server.parse(request, P.ChatCompletionRequest)
    tool = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if tool.parse:
        for name in ("stop", "logprobs"):
            if getattr(req, name):
                raise P.APIError(400, f"{name}: not supported together with parsed tool calls (tool_choice "
                                      f"{tool.choice!r}); send it without tools or with tool_choice \"none\"",
                                 param=name)
    messages = template_messages([m.template_dict() for m in req.messages])
    parts = [(f"messages[{i}].content[{j}]", url) for i, m in enumerate(req.messages) for j, url in m.image_urls()]
    images, slots = await server.tokenize(None, server.read_images, parts) if parts else (None, None)
    prompt = await server.tokenize(request, lambda: server.chat_ids(messages, images=slots, tools=tool.tools))
    item = (await server.tokenize(None, lambda: prepare_images(server.engine.model, [prompt], [images])))[0] \
        if parts else None
    return await server.run(request, [prompt], req, chat=True, images=item, tool=tool)


@router.post("/tokenize", openapi_extra=_body("/tokenize"), responses=_responses(P.TokenizeResponse, 400, 404, 413))
async def tokenize_route(request: Request):
    """vLLM's /tokenize: `prompt` with the BOS (add_special_tokens, default) or without; or `messages` through
    the chat template. `count` = len(tokens), as `usage.prompt_tokens` counts them."""
    server: Server = request.app.state.server
    req = await server.parse(request, P.TokenizeRequest)
    ids = await server.tokenize(request, server.tokenize_request, req)
    strs = server.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return P.TokenizeResponse(count=len(ids), max_model_len=server.engine.max_seq_len, tokens=ids,
                              token_strs=strs).model_dump()


@router.post("/detokenize", openapi_extra=_body("/detokenize"),
             responses=_responses(P.DetokenizeResponse, 400, 404, 413))
async def detokenize_route(request: Request):
    """vLLM's /detokenize: `tokens` -> `prompt`, the text with special tokens as they decode."""
    server: Server = request.app.state.server
    req = await server.parse(request, P.DetokenizeRequest)
    bad = next((t for t in req.tokens if not 0 <= t < server.vocab), None)
    if bad is not None:
        raise P.APIError(400, f"tokens: {bad} is outside the vocabulary [0, {server.vocab})", param="tokens")
    text = await server.tokenize(request, lambda: server.tokenizer.decode(req.tokens, skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False))
    return P.DetokenizeResponse(prompt=text).model_dump()


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it): special tokens, chat template, length."""
    server: Server = request.app.state.server
    try:
        template = chat_template(server.tokenizer)
    except ConfigError:
        template = None
    return {"tokenizer_class": type(server.tokenizer).__name__, "bos_token": server.tokenizer.bos_token,
            "eos_token": server.tokenizer.eos_token, "pad_token": server.tokenizer.pad_token,
            "unk_token": server.tokenizer.unk_token,
            "chat_template": template, "model_max_length": server.engine.max_seq_len}


# exception handlers: every error in OpenAI's shape

async def _api_error(request: Request, e: P.APIError) -> Response:
    metrics = request.app.state.server.metrics
    if metrics is not None and e.code is not None:  # every coded refusal: the limit (or rule) that refused it
        metrics.refused(e.code)
    # ASCII JSON: an echoed value may hold a lone surrogate, which UTF-8 cannot encode (a 500 before)
    return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json")


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405, ... in OpenAI's shape
    err = P.APIError(e.status_code, str(e.detail)[:200],
                     type="not_found_error" if e.status_code == 404 else "invalid_request_error")
    return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)


async def _request_error(_: Request, e: RequestValidationError) -> JSONResponse:  # FastAPI's own 422 -> 400
    message, param = P.validation_message(e)
    return JSONResponse(P.APIError(400, message[:500], param=param).body(), status_code=400)


async def _server_error(_: Request, e: Exception) -> JSONResponse:  # OpenAI-shaped, never text/plain
    err = P.APIError(500, f"internal error: {type(e).__name__}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def create_app(engine: Engine, *, model_name: str, tokenizer, metrics=None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, image_sources=None,
               input_timeout_s: float = DEFAULT_INPUT_TIMEOUT_S, api_key: str | None = None,
               grammar_limits: GrammarLimits | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (started by the caller) as model `model_name`; `metrics`: the engine's
    `ServeMetrics` for /metrics (404 without). `max_body_bytes`: larger bodies get 413 (`limits.BodyLimit`);
    `image_sources`: where image_url parts may point and the limits (`preprocess.ImageSources`; default `data:` URLs
    only, 8 MiB each; at most `MAX_IMAGES` per request; a refusal is a 400 naming the part); `input_timeout_s`: seconds one request's parsing, image decoding and tokenization may
    take (400 past it); `api_key`: every /v1 and tokenizer route needs `Authorization: Bearer <api_key>` (401
    otherwise, `auth.APIKeyAuth`); None: open; `grammar_limits`: the bounds of grammar compiles
    (`grammars.GrammarLimits`, its defaults without), which run in worker processes the app kills at shutdown.
    The routes (`router`) read what they share from `app.state.server` (a `Server`).
    Raises ValueError for an empty `api_key`."""
    if api_key is not None and not api_key:
        raise ValueError("api_key: must be a non-empty string (or None: no key)")
    grammars = GrammarService(lambda: GrammarLibrary.for_model(tokenizer, engine.model, engine.config.eos_token_ids),
                              grammar_limits or GrammarLimits(), metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        try:
            yield
        finally:
            await grammars.close()

    app = FastAPI(title="dgemma serve", lifespan=lifespan)
    app.state.server = Server(engine, model_name=model_name, tokenizer=tokenizer, metrics=metrics,
                              image_sources=image_sources, input_timeout_s=input_timeout_s, grammars=grammars)
    app.state.grammars = grammars
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                       on_refuse=None if metrics is None else lambda: metrics.refused("body_too_large"))
    if api_key is not None:  # outer: a request without the key is answered before its body is read
        app.add_middleware(APIKeyAuth, api_key=Secret(api_key))
    if metrics is not None:  # outermost: counts every error answer, the key's and the body limit's too
        app.add_middleware(ErrorCounter, registry=metrics.registry)
    for exc, handler in ((P.APIError, _api_error), (StarletteHTTPException, _http_error),
                         (RequestValidationError, _request_error), (Exception, _server_error)):
        app.add_exception_handler(exc, handler)
    app.include_router(router)
    vocab = engine.model.config.vocab_size

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, BODIES, vocab=vocab, metrics=metrics is not None,
                                                  api_key=api_key is not None, model_name=model_name)
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the ASGI `http.disconnect` after the body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _completion_tokens(e: BlockEvent) -> int:
    """The usage rule (module docstring): the engine's count without the eos that ended the request."""
    return e.completion_tokens - (e.finish_reason == "eos")


def _finite(logp: float) -> float:
    """JSON has no -inf (nor NaN): at least -9999.0, as vLLM clamps."""
    return logp if logp > -9999.0 else -9999.0


class _ChoiceLogprobs:
    """One choice's logprobs (module docstring, "Logprobs"): `add` each of its block events (their tokens and
    `BlockEvent.logprobs`), `take(end)` the entries of tokens [given so far, end) in the response's shape;
    `behind()` is the end a stream chunk may give: the shortest prefix of the tokens whose text covers what was
    shown (the engine's `completion_tokens` rule at a stop string)."""

    def __init__(self, tokenizer, token_string: Callable[[int], str], chat: bool):
        self.tokenizer, self.token_string, self.chat = tokenizer, token_string, chat
        self.ids: list[int] = []
        self.entries: list[tuple[float, list[tuple[int, float]]]] = []
        self.shown = 0  # characters of text returned
        self.given = 0  # tokens whose entries were returned
        self.offset = 0  # their strings' characters (completions' text_offset)

    def add(self, e: BlockEvent) -> None:
        if e.logprobs is None or len(e.logprobs) != len(e.tokens):
            raise RuntimeError(f"request {e.request.id}: the engine's logprobs do not align with its tokens")
        self.ids += e.tokens
        self.entries += e.logprobs
        self.shown += len(e.text)

    def _text_len(self, k: int) -> int:
        return len(self.tokenizer.decode(self.ids[:k], skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def behind(self) -> int:
        lo, hi = self.given, len(self.ids)  # the text grows with the prefix: the least k in [lo, hi] covering
        while lo < hi:
            mid = (lo + hi) // 2
            if self._text_len(mid) >= self.shown:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def take(self, end: int) -> dict:
        new = [(t, *x) for t, x in zip(self.ids[self.given:end], self.entries[self.given:end])]
        self.given = max(self.given, end)
        s = self.token_string
        if self.chat:
            def entry(t: int, p: float) -> dict:
                text = s(t)
                return {"token": text, "logprob": _finite(p), "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(t, p), "top_logprobs": [entry(a, q) for a, q in top]} for t, p, top in new],
                    "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, p, top in new:
            text = s(t)
            alternatives: dict[str, float] = {}
            for a, q in ((t, p), *top):  # the token itself first; k entries where it is among the top k
                alternatives.setdefault(s(a), _finite(q))
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(p))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _draft_chunk(e: BlockEvent, i: int, rid: str, now: int, model_name: str, chat: bool) -> dict:
    """The SSE chunk of one draft event (see the module docstring)."""
    draft = {"text": e.text, "block": e.block, "step": e.step}
    if chat:
        choice = {"index": i, "delta": {"content": ""}, "logprobs": None, "finish_reason": None, "draft": draft}
        return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name, "choices": [choice]}
    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": None, "draft": draft}
    return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}


def _frame_chunk(e: BlockEvent, i: int, rid: str, now: int, model_name: str, chat: bool) -> dict:
    """The SSE chunk of one live canvas frame (see the module docstring): a draft's shape, `canvas_frame` instead."""
    f = e.frame
    frame = {"block": f.block, "step": f.step, "text": e.text, "tokens": f.tokens, "accepted": f.accepted,
             "mean_entropy": f.mean_entropy}
    if chat:
        choice = {"index": i, "delta": {"content": ""}, "logprobs": None, "finish_reason": None,
                  "canvas_frame": frame}
        return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name, "choices": [choice]}
    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": None, "canvas_frame": frame}
    return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": [choice]}


def _cancel_unfinished(engine: Engine, choices: list[EngineRequest], reasons: list) -> None:
    for c, r in zip(choices, reasons):
        if r is None:
            engine.cancel(c)


def _context_error(e: ConfigError, engine: Engine, prompt_len: int, max_tokens: int, prompt_param: str,
                   budget: str = "max_tokens") -> P.APIError:
    """The engine's refusal `e` as a 400. A context-length one (`e.code`) for a request whose prompt plus max_tokens
    exceeds this server's context (its cache's slots, `max_model_len`, or the model's positions, whichever is fewer)
    is said in the request's terms, naming `prompt_param` ("prompt", or "messages" for a chat) when the prompt alone
    leaves no room, else the budget (`budget`: the request's name of it, max_tokens or max_completion_tokens). The
    engine decides (it needs no slot for the last block, so a request may end within one canvas of the limit); any
    other refusal keeps its own words (`_config_error`)."""
    limit = min(engine.max_seq_len, engine.model.config.max_position_embeddings)
    if e.code != CONTEXT_LENGTH or prompt_len + max_tokens <= limit:
        return _config_error(e, budget)
    return P.APIError(400, f"this server's context is {limit} tokens; the request needs {prompt_len + max_tokens}: "
                           f"{prompt_len} prompt tokens + {budget} {max_tokens}. Shorten the prompt or lower "
                           f"{budget}", param=prompt_param if prompt_len >= limit else budget,
                      code=CONTEXT_LENGTH)


def _config_error(e: ConfigError, budget: str = "max_tokens") -> P.APIError:
    """A ConfigError -> 400 naming the request parameter (`ConfigError.param`, the engine's names mapped to the
    request's: "max_seq_len" is prompt + the budget beyond this server's cache; `budget`: the request's name of its
    token budget, max_tokens or a chat's max_completion_tokens) with its `code`."""
    param = {"max_new_tokens": budget, "max_seq_len": budget, "prompts[0]": "prompt"}.get(e.param, e.param)
    return P.APIError(400, str(e), param=param, code=e.code)


async def _stream(engine: Engine, choices: list[EngineRequest], index: dict, events: asyncio.Queue,
                  req: P.GenerationRequest, rid: str, now: int, model_name: str, chat: bool, prompt_tokens: int,
                  lps: list[_ChoiceLogprobs | None], answers: list[ToolAnswer | None]) -> AsyncIterator[dict]:
    """The SSE events of one streamed request (see the module docstring); cancels unfinished choices when the
    client goes away (sse-starlette cancels this generator on a disconnect)."""
    reasons: list = [None] * len(choices)
    tokens = [0] * len(choices)
    obj = "chat.completion.chunk" if chat else "text_completion"
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def usage() -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": sum(tokens),
                "total_tokens": prompt_tokens + sum(tokens)}

    def event(choice: dict) -> dict:
        chunk = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
        if continuous:
            chunk["usage"] = usage()
        return {"data": json.dumps(chunk)}

    try:
        if chat:  # the role first, once per choice, before any draft or text
            for i in range(len(choices)):
                yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        while any(r is None for r in reasons):
            e = await events.get()
            i = index[id(e.request)]
            if e.finish_reason in ("cancelled", "error"):
                reasons[i] = e.finish_reason
                if e.finish_reason == "error":
                    err = P.APIError(500, ERRORS[500], type="server_error")
                    yield {"data": json.dumps(err.body())}
                    break
                continue
            if e.draft:
                yield {"data": json.dumps(_draft_chunk(e, i, rid, now, model_name, chat))}
                continue
            if e.frame is not None:
                yield {"data": json.dumps(_frame_chunk(e, i, rid, now, model_name, chat))}
                continue
            finish = P.FINISH_REASONS.get(e.finish_reason, e.finish_reason) if e.finish_reason else None
            tokens[i] = _completion_tokens(e)
            if e.finish_reason is not None:
                reasons[i] = e.finish_reason
            lp = lps[i]
            if lp is not None:
                lp.add(e)
                lp = lp.take(tokens[i] if e.finish_reason is not None else lp.behind())
            a = answers[i]
            if a is not None:  # parsed tool calls (tools.ToolAnswer): content, then each call's deltas, then the end
                a.add(e.tokens)
                content, calls = a.push(final=e.finish_reason is not None)
                if content:
                    yield event({"index": i, "delta": {"content": content}, "logprobs": None, "finish_reason": None})
                for d in calls:
                    yield event({"index": i, "delta": {"tool_calls": [d]}, "logprobs": None, "finish_reason": None})
                if e.finish_reason is not None:
                    yield event({"index": i, "delta": {}, "logprobs": None,
                                 "finish_reason": a.finish_reason(e.finish_reason)})
            elif chat:
                yield event({"index": i, "delta": {"content": e.text}, "logprobs": lp, "finish_reason": finish})
            else:
                yield event({"index": i, "text": e.text, "logprobs": lp, "finish_reason": finish})
        if opts is not None and opts.include_usage:
            yield {"data": json.dumps({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [],
                                       "usage": usage()})}
        yield {"data": "[DONE]"}
    finally:
        _cancel_unfinished(engine, choices, reasons)
