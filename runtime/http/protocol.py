"""The OpenAI-compatible request and response bodies (pydantic), and the OpenAI-shaped error.

Requests forbid unknown fields (400, naming the field). Fields this server does not implement are accepted at a
neutral value and refused otherwise with a 400 naming the field and the values it accepts (`NEUTRAL_COMPLETION`,
`NEUTRAL_CHAT`): OpenAI's (`top_p` 1, penalties 0, `logit_bias` {}, the legacy `functions` [] and `function_call`,
`best_of` 1, `echo` false, `store` false, ...) and vLLM's sampling extensions
(`repetition_penalty` 1, `top_k` -1 or 0, `min_p` 0, `min_tokens` 0). vLLM's `ignore_eos` is implemented (a bool:
the request runs to `max_tokens`, its eos ids kept as ordinary tokens; `GenerationConfig.ignore_eos`).
Structured outputs (`response_format` json_schema / json_object, vLLM's `guided_regex` / `guided_choice` /
`guided_json` and `structured_outputs`) on both routes: `structured.py`. Tool calls (chat `tools`, `tool_choice`,
`parallel_tool_calls`; messages with `tool_calls` and `tool` messages): `tool_calls.py`. `user` and `metadata` are accepted and
ignored. Chat content is a string or text and `image_url` parts (an `image_url` is decoded by the server: `data:`
URLs, and local files or http(s) URLs where the server allows them, on a model with a vision encoder; see
`server.py`); any other part (audio, file) is refused, never dropped.

Logprobs (what they are, and which tokens they cover: `server.py`): completions `logprobs: k` (an integer >= 0,
OpenAI's legacy field; at most the server's `--max-logprobs`, checked by the server) -> `CompletionLogprobs`; chat
`logprobs: true` with `top_logprobs: k` (0..20, OpenAI's range, and at most `--max-logprobs`; `top_logprobs` > 0
needs `logprobs: true`, OpenAI's rule) -> `ChoiceLogprobs`. Neutral values stay accepted (`logprobs` null or false,
`top_logprobs` 0). `echo` with `logprobs` (prompt logprobs) is refused with its reason: a block-diffusion model
encodes its prompt causally, once, with no distribution over the prompt's tokens.

Every per-request value that reaches a device tensor is bounded here or in `GenerationConfig`: floats finite and
within float32 (`temperature`, `entropy_bound`), integers within int64 / the tables (`seed` < 2**64,
`max_denoising_steps`, `draft_every` < 2**31), so admitting a queued request cannot fail on its values.

Extensions (body fields, e.g. the `openai` client's `extra_body`): `max_denoising_steps` (denoise steps per block
at most), `entropy_bound` (the acceptance rule's bound), `draft_every` (k >= 1, streaming only: a draft event
every k denoise steps of each block; see `server.py`), `stream_options.include_canvas_frames` (streaming only: a
live canvas frame after every denoise step; see `server.py`), and the seeded / pinned canvas of vLLM's PR 57250's
names (`dgemma_compile.step.canvas`): `diffusion_seed_canvas` (a text template, "_" one free position, or token ids with
null for free positions) and `diffusion_pinned` (whether its given positions are held, default true; only with a
seed canvas).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_serializer,
                      model_validator)

from dgemma_compile.model.config import ConfigError


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status`, body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Fields this server does not implement, accepted only at a neutral value (absent and null are always neutral):
# name -> (the neutral values, why others are refused). OpenAI's, then vLLM's sampling extensions.
NEUTRAL_COMMON: dict[str, tuple[tuple, str]] = {
    "top_p": ((1,), "the sampler keeps the whole distribution"),
    "presence_penalty": ((0,), "no penalties"),
    "frequency_penalty": ((0,), "no penalties"),
    "logit_bias": (({},), "no logit bias"),
    "store": ((False,), "this server stores nothing"),
    "service_tier": (("auto", "default"), "one service tier"),
    "repetition_penalty": ((1,), "no penalties"),
    "top_k": ((-1, 0), "the sampler keeps the whole distribution"),
    "min_p": ((0,), "the sampler keeps the whole distribution"),
    "min_tokens": ((0,), "an eos may end a request at any block"),
    "skip_special_tokens": ((True,), "special tokens are never returned as text"),
    "include_stop_str_in_output": ((False,), "a stop string is never part of the text"),
}
NEUTRAL_COMPLETION = {**NEUTRAL_COMMON, "echo": ((False,), "no echo of the prompt"),
                      "suffix": (("",), "no suffix"), "best_of": ((1,), "no server-side best-of")}
NEUTRAL_CHAT = {**NEUTRAL_COMMON, "functions": (([],), "the legacy function calls: use tools"),
                "function_call": (("none", "auto"), "the legacy function calls: use tools and tool_choice"),
                "audio": ((), "text only"),
                "modalities": ((["text"],), "text only"), "prediction": ((), "no predicted outputs")}


def cut(value: Any, limit: int = 80) -> str:
    """`value` as JSON text, at most `limit` characters (then ending in "..."): how errors echo a client's value."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps bools apart from numbers (`true` is not 1)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _refuse_unsupported(values: Any, neutral: dict[str, tuple[tuple, str]]) -> Any:
    if isinstance(values, dict):
        for name, (ok, why) in neutral.items():
            v = values.get(name)
            if v is not None and not any(_same(v, n) for n in ok):
                accepted = ", ".join(json.dumps(n) for n in ok) or "null"
                raise ConfigError(name, f"{json.dumps(v)[:80]} is not supported by this server (accepted: absent, "
                                  f"null, {accepted}); {why}")
    return values


FLOAT32_MAX = 3.4028234663852886e38


class StreamOptions(BaseModel):
    """`include_usage`: a last chunk with the request's usage (and `choices: []`); `continuous_usage_stats` (vLLM):
    `usage` (so far) in every chunk; `include_canvas_frames` (this server's extension): a `canvas_frame` chunk after
    each denoise step of a block in flight (`server.py`)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_canvas_frames: StrictBool = Field(
        default=False, description="extension: a chunk per denoise step carrying `canvas_frame` {block, step, text, "
                                   "tokens, accepted, mean_entropy}, the block in flight's argmax canvas, before the "
                                   "block's own chunk")


class GenerationRequest(BaseModel):
    """The fields both generation routes share (`CompletionRequest`, `ChatCompletionRequest`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, description="exact budget of generated tokens")
    temperature: float | None = Field(default=None, ge=0, le=FLOAT32_MAX,
                                      description="scales the checkpoint's temperature schedule; 0: greedy "
                                                  "candidates (the start canvas and renoise stay random: answers "
                                                  "repeat only with a seed)")
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(default=None, description="up to 16 stop strings")
    user: str | None = None
    metadata: dict[str, str] | None = None
    # extensions
    max_denoising_steps: int | None = Field(default=None, ge=1, lt=2**31)
    entropy_bound: float | None = Field(default=None, gt=0, le=FLOAT32_MAX)
    draft_every: int | None = Field(default=None, ge=1, lt=2**31,
                                    description="a draft event every k denoise steps (stream)")
    diffusion_seed_canvas: str | list[StrictInt | None] | None = Field(
        default=None,
        description="the start canvas of the output's first positions (vLLM PR 57250's name): a text template, "
                    "each '_' one free position ('\\_' a literal underscore), or token ids with null for free "
                    "positions; its given positions are pinned (docs/serving.md)")
    diffusion_pinned: StrictBool | None = Field(
        default=None, description="hold the seed canvas's given positions through every denoise step (default "
                                  "true); false: a warm start only. Needs diffusion_seed_canvas")
    # fields refused unless neutral (NEUTRAL_*; each request model's `_unsupported` checks them)
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    store: Any = None
    service_tier: Any = None
    repetition_penalty: Any = None
    top_k: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: StrictBool | None = Field(default=None, description="run to max_tokens, eos ids kept as ordinary tokens "
                                                              "(vLLM's extension)")
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    # structured outputs (`structured.request_constraint`): OpenAI's, then vLLM's
    response_format: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_json: Any = None
    structured_outputs: Any = None

    @model_validator(mode="after")
    def _stream_only(self):
        if self.diffusion_pinned is not None and self.diffusion_seed_canvas is None:
            raise ConfigError("diffusion_pinned", "says whether the seed canvas is held; needs diffusion_seed_canvas")
        if self.draft_every is not None and not self.stream:
            raise ConfigError("draft_every", "draft events are streamed; needs stream=true")
        if self.stream_options is not None and self.stream_options.include_canvas_frames and not self.stream:
            raise ConfigError("stream_options.include_canvas_frames", "canvas frames are streamed; needs stream=true")
        if self.stream_options is not None and not self.stream:
            raise ConfigError("stream_options", "only allowed with stream=true")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be a positive integer")
        return v

    @property
    def budget_param(self) -> str:
        """The request's own name of its token budget, for the errors that concern it."""
        return "max_tokens"

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(s == "" for s in stops):
            raise ValueError("empty stop string")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists
    (each prompt of a list its own `n` choices)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: StrictInt | None = Field(default=None, ge=0,
                                       description="k: each returned token's log-probability and the k most likely "
                                                   "alternatives' (at most the server's --max-logprobs)")
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, values):
        if isinstance(values, dict) and values.get("echo") not in (None, False) and values.get("logprobs") is not None:
            raise ConfigError("echo", "echo with logprobs asks for the prompt's logprobs, which this server cannot give: "
                              "a block-diffusion model encodes its prompt causally, once, with no distribution over "
                              "the prompt's tokens (only the generated blocks are denoised); ask for logprobs without "
                              "echo")
        return _refuse_unsupported(values, NEUTRAL_COMPLETION)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, (str, list)) for x in p):
            return list(p)
        return [list(p)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(BaseModel):
    """OpenAI's image content part; `image_url.url` a `data:image/...;base64,` URL (the server decodes it)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCallPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str = Field(description="the arguments as a JSON object's text")


class MessageToolCall(BaseModel):
    """An earlier answer's tool call, sent back in the conversation (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallPart


class ChatMessage(BaseModel):
    """A message; `content` a string or text and image_url parts (an audio or file part is refused). An assistant
    message may carry the `tool_calls` it made (then `content` may be absent or null); a `tool` message answers one
    (`tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ConfigError("content", "a message needs a content (only an assistant message with tool_calls may "
                              "omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ConfigError("tool_calls", "only an assistant message carries tool_calls")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_images(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind not in ("text", "image_url"):
                    raise ValueError(f"{json.dumps(kind)[:40]} content parts are not supported by this server "
                                     "(text and image_url only)")
        return v

    def template_dict(self) -> dict:
        """The message as the chat template reads it (an image part as {"type": "image"}, as transformers' chat
        templates take it)."""
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            out["content"] = [{"type": "image"} if isinstance(p, ImageUrlPart) else p.model_dump() for p in self.content]
        else:
            out["content"] = self.content if self.content is not None else ""
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.role == "tool":
            out.update({k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None})
        return out

    def image_urls(self) -> list[tuple[int, str]]:
        """(part index, url) of each image part, in order."""
        if not isinstance(self.content, list):
            return []
        return [(j, p.image_url.url) for j, p in enumerate(self.content) if isinstance(p, ImageUrlPart)]


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions; `max_completion_tokens` is `max_tokens`'s newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool | None = Field(default=None, description="the returned tokens' log-probabilities")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20,
                                           description="with logprobs: the k most likely alternatives of each token "
                                                       "(at most the server's --max-logprobs)")
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, values):
        return _refuse_unsupported(values, NEUTRAL_CHAT)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ConfigError("top_logprobs", "needs logprobs: true (OpenAI's rule)")
        return self

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, v: int | None) -> int | None:
        return cls._positive(v)

    @model_validator(mode="after")
    def _budget(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ConfigError("max_completion_tokens", f"differs from max_tokens ({self.max_completion_tokens} "
                                  f"and {self.max_tokens}): give one of them")
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def budget_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): `prompt` (text), or `messages` rendered through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str = None  # absent or a string (null refused, as the schema says)
    messages: list[ChatMessage] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ConfigError("prompt", "give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal's body (OpenAI's shape)."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs, per returned token: its string (the id decoded alone), its log p, a
    dict {string: log p} of the k most likely tokens and itself (k + 1 entries where it is not among them), and
    the offset of its string in the choice's token strings joined."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """One returned token (OpenAI's ChatCompletionTokenLogprob): its string (the id decoded alone), its log p, the
    UTF-8 bytes of its string, and the k most likely tokens (`top_logprobs`, descending)."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class ToolCallOut(BaseModel):
    """One call of an answer (OpenAI's `message.tool_calls[i]`): `function.arguments` a JSON object's text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallPart


class AssistantMessage(BaseModel):
    """The answer; `tool_calls` only where calls were parsed (`tool_calls.py`), and then `content` may be null."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _no_empty_calls(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
"""Engine finish reasons -> OpenAI's."""


def validation_message(error: Exception) -> tuple[str, str | None]:
    """A pydantic ValidationError -> (message, the parameter it names)."""
    errors = getattr(error, "errors", lambda: [])()
    if not errors:
        return str(error), None
    e = errors[0]
    loc = [str(x)[:80] for x in e.get("loc", ()) if not isinstance(x, int)]  # a key is a client value: cut
    msg = e.get("msg", str(error)).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        return f"{'.'.join(loc)}: unrecognized request argument", (loc[0] if loc else None)
    raised = (e.get("ctx") or {}).get("error")  # the exception a validator raised (pydantic keeps the object)
    if not loc and isinstance(raised, ConfigError):  # a model-level check naming its field ("echo", ...)
        return str(raised), raised.param
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None)
