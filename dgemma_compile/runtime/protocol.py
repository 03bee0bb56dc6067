"""The OpenAI-compatible request and response bodies (pydantic), and the OpenAI-shaped error.

Requests forbid unknown fields (400, naming the field). Known OpenAI fields this server does not implement are
accepted only at their neutral value (`logprobs`, `response_format`, `tools`, ... absent or null; `top_p` 1;
penalties 0; `echo` false) and refused otherwise. Extensions (body fields, e.g. the `openai` client's `extra_body`):
`max_denoising_steps` (denoise steps per block at most), `entropy_bound` (the acceptance rule's bound) and
`draft_every` (k >= 1, streaming only: a draft event every k denoise steps of each block; see `server.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """An error answered as OpenAI does: HTTP `status`, body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# fields of the OpenAI API this server refuses unless they hold the value given here (None: absent or null)
UNSUPPORTED_COMMON = {"top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None}
UNSUPPORTED_COMPLETION = {**UNSUPPORTED_COMMON, "logprobs": None, "echo": False, "suffix": None, "best_of": None}
UNSUPPORTED_CHAT = {**UNSUPPORTED_COMMON, "logprobs": False, "top_logprobs": None, "response_format": None,
                    "tools": None, "tool_choice": None, "functions": None, "function_call": None,
                    "parallel_tool_calls": None, "audio": None, "modalities": None, "prediction": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, description="exact budget of generated tokens")
    temperature: float | None = Field(default=None, ge=0, description="scales the checkpoint's schedule; 0 = greedy")
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    user: str | None = None
    # extensions
    max_denoising_steps: int | None = Field(default=None, ge=1)
    entropy_bound: float | None = Field(default=None, ge=0)
    draft_every: int | None = Field(default=None, ge=1, description="a draft event every k denoise steps (stream)")
    # OpenAI fields refused unless neutral (UNSUPPORTED_*; each request model's `_unsupported` checks them)
    logprobs: Any = None
    top_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @model_validator(mode="after")
    def _drafts_stream(self):
        if self.draft_every is not None and not self.stream:
            raise ValueError("draft_every: draft events are streamed; needs stream=true")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be a positive integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(s == "" for s in stops):
            raise ValueError("empty stop string")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def _refuse_unsupported(values: Any, allowed: dict[str, Any]) -> Any:
    if isinstance(values, dict):
        for name, neutral in allowed.items():
            if name in values and values[name] is not None and values[name] != neutral:
                raise ValueError(f"{name}: not supported by this server")
    return values


class CompletionRequest(_Common):
    """POST /v1/completions. `prompt`: a string, a list of strings (each its own `n` choices), or token ids."""

    prompt: str | list[str] | list[int]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, values):
        return _refuse_unsupported(values, UNSUPPORTED_COMPLETION)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions; `max_completion_tokens` is `max_tokens`'s newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: Any = None
    response_format: Any = None
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
        return _refuse_unsupported(values, UNSUPPORTED_CHAT)

    @model_validator(mode="after")
    def _budget(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ")
            self.max_tokens = self._positive(self.max_completion_tokens)
        return self


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
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
    logprobs: None = None
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
    loc = [str(x) for x in e.get("loc", ()) if not isinstance(x, int)]
    msg = e.get("msg", str(error)).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        return f"{'.'.join(loc)}: unrecognized request argument", (loc[0] if loc else None)
    if not loc and ": " in msg:  # a model-level check naming its field ("logprobs: not supported ...")
        return msg, msg.split(":", 1)[0]
    return (f"{'.'.join(loc)}: {msg}" if loc else msg), (loc[0] if loc else None)
