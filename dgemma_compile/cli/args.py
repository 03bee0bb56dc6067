"""The command line's parser: every command's flags, their choices and defaults. Plain names, so that `dgemma --help`
imports no torch; the ones with a torch-side source (`DTYPES`, `QUANT_SCHEMES`, `DEFAULT_GROUP_TIMEOUT_S`) are checked
equal to it by tests/cli/test_imports.py."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from pathlib import Path


DTYPES = ("bfloat16", "float16", "float32")  # --dtype: names of torch dtypes
COMPILE_MODES = ("auto", "always", "never")  # --compile (`run._compile_mode`)
QUANT_SCHEMES = ("fp8", "fp8-weight-only", "nvfp4-w4a16", "nvfp4")  # = quant.schemes.SCHEMES
DEFAULT_GROUP_TIMEOUT_S = 300.0  # = parallel.group.DEFAULT_TIMEOUT_S
DEFAULT_BATCH_SIZE = 8
FLOAT32_MAX = 3.4028234663852886e38  # = config.FLOAT32_MAX: per-row parameters live in float32 tensors


# ----- value types: a number the command cannot use is refused while parsing, before torch is imported or a model
# loaded ("argument --max-new-tokens: must be a positive integer, got 0"); the library checks again (its own callers)
def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _ranged(kind: type, accepts, requirement: str):
    """An argparse type: a `kind` (int or finite float) that `accepts`, else "must be {requirement}, got ..."."""
    def parse(text: str):
        value = _number(text, kind)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {value}")
        return value
    return parse


positive_int = _ranged(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _ranged(int, lambda v: v >= 0, "an integer >= 0")
logprob_count = _ranged(int, lambda v: 0 <= v <= 64, "an integer in [0, 64]")  # CompileOptions.max_logprobs's range
seed = _ranged(int, lambda v: 0 <= v < 2**64, "an integer in [0, 2**64)")  # rng.seed_tensor's range
non_negative_number = _ranged(float, lambda v: v >= 0, "a finite number >= 0")  # a temperature scale
seconds = _ranged(float, lambda v: v > 0, "a positive number of seconds")
entropy_bound = _ranged(float, lambda v: 0 < v <= FLOAT32_MAX, f"a number in (0, {FLOAT32_MAX:.4g}]")  # = config's
port = _ranged(int, lambda v: 0 <= v <= 65535, "a TCP port in [0, 65535] (0: one the system picks)")


class Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals (an unknown flag, a value its choices or type refuse) are one
    `dgemma: error: ...` line on stderr and exit status 2, as every other expected failure of the command line;
    `--help` prints the usage as argparse does."""

    def error(self, message: str):
        self.exit(2, f"dgemma: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="dgemma", description="DiffusionGemma block-diffusion generation.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt (or of each prompt of a file)")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (or give --prompts-file)")
    g.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (config.json, safetensors, tokenizer); default: the built-in demo model")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image the prompt is about (repeatable; a multimodal checkpoint): with --chat, one image "
                        "part per image before the text; raw, the prompt's image placeholders, or one per image first")
    g.add_argument("--max-soft-tokens", type=positive_int, default=None, metavar="N",
                   help="soft tokens per image (70, 140, 280, 560 or 1120; default: the checkpoint's processor, 280)")
    g.add_argument("--system", default=None, metavar="TEXT",
                   help="system message before the prompt in the chat template (implies --chat)")
    g.add_argument("--max-new-tokens", type=positive_int, default=None, help="exact token budget (default: generation config)")
    g.add_argument("--max-denoising-steps", type=positive_int, default=None, help="denoise steps per block at most")
    g.add_argument("--temperature", type=non_negative_number, default=None, metavar="T",
                   help="scales the checkpoint's temperature schedule (GenerationConfig.with_temperature); 0 = greedy")
    g.add_argument("--entropy-bound", type=entropy_bound, default=None, metavar="X",
                   help="entropy bound of the acceptance rule (default: generation config)")
    g.add_argument("--stop", action="append", default=None, metavar="S",
                   help="stop string (repeatable): the output ends before its first occurrence, across blocks too")
    g.add_argument("--seed", type=seed, default=0, help="seed of the request's random stream (of each line without one)")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weight dtype (default: the checkpoint's; float32 where this CPU's bf16/fp16 GEMM is slow, "
                        "docs/numerics.md)")
    g.add_argument("--quant", choices=QUANT_SCHEMES, default=None,
                   help="quantize the weights on load with torchao (the [quant] extra): fp8 (dynamic per-row "
                        "activations, per-row weights), fp8-weight-only, nvfp4-w4a16; nvfp4 (W4A4) needs sm100")
    g.add_argument("--eager", action="store_true", help="run the eager reference generator instead of the compiled one")
    g.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="auto (default): load the step from the compile cache if it is there, else answer with the "
                        "eager step, compiling in a background process when the job is larger than one batch "
                        "(docs/cli.md); always: compile (or load) before answering; never: the eager step only")
    g.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="intra-op CPU threads (default: OMP_NUM_THREADS if set, else dgemma_compile.cli.threads."
                        "recommended_threads: 1 for small models, else the CPUs free now)")
    g.add_argument("--live", action="store_true",
                   help="redraw the block in flight at every denoise step (accepted and renoised positions, the step "
                        "count, the mean entropy), then print the text as usual; only when stdout is a terminal")
    g.add_argument("--template", default=None, metavar="T",
                   help="a pinned canvas for the output's first positions: each '_' is one free token position ('\\_' "
                        "a literal underscore), the rest of T is held as written, e.g. \"name: ____, age: __\" "
                        "(docs/cli.md; one prompt)")
    c = g.add_mutually_exclusive_group()  # constrained output (docs/constrained.md); one kind per invocation
    c.add_argument("--regex", default=None, metavar="R", help="the text must fully match the regex R")
    c.add_argument("--choice", action="append", default=None, metavar="S",
                   help="the text must equal one of the strings given (repeat --choice for each)")
    c.add_argument("--json-schema", default=None, metavar="FILE", help="the text must be JSON valid under the schema "
                                                                        "in FILE")
    c.add_argument("--json-object", action="store_true", help="the text must be a JSON object")
    g.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="one prompt per line, or JSON objects (prompt, seed, max_new_tokens, entropy_bound, temperature, "
                        "stop); '-' reads stdin; writes one JSON line per prompt on stdout, in input order")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                   help=f"prompts per batch with --prompts-file (default {DEFAULT_BATCH_SIZE}: one compiled bucket)")
    _parallel_flags(g)
    e = sub.add_parser("explain", help="Dynamo explain report of the compiled step (one unit per batch size)")
    e.add_argument("--model", type=Path, default=None, help="checkpoint directory; default: the built-in demo model")
    e.add_argument("--batch-size", type=positive_int, default=1, help="report the bucket serving this many requests")
    e.add_argument("--quant", choices=QUANT_SCHEMES, default=None, help="quantize the weights first (as generate)")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the [serve] extra): /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics")
    s.add_argument("--model", type=Path, default=None, help="checkpoint directory; default: the built-in demo model")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    s.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="rows of the engine's one compiled bucket: requests running at once (default 8)")
    s.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests waiting for a row at most; more get HTTP 429 (default 256)")
    s.add_argument("--max-seq-len", type=positive_int, default=None, metavar="S",
                   help="committed KV slots per row: prompt + generated tokens (default: the model's context, at "
                        "most 1024)")
    s.add_argument("--kv-page-size", type=positive_int, default=None, metavar="P",
                   help="a paged KV cache of P-slot pages shared by the rows, with a prefix cache of full prompt "
                        "pages (a multiple of the canvas length; default: a static cache per row)")
    s.add_argument("--kv-pages", type=positive_int, default=None, metavar="N",
                   help="pages in the pool with --kv-page-size (default: max-batch x max-seq-len / P, the static "
                        "cache's memory); requests wait for pages, never running ones")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: dgemma-demo for the "
                                                             "demo model, else the checkpoint directory's name)")
    s.add_argument("--max-body-bytes", type=positive_int, default=4 * 2**20, metavar="B",
                   help="larger request bodies get HTTP 413 (default 4 MiB)")
    s.add_argument("--input-timeout", type=seconds, default=30.0, metavar="S",
                   help="seconds one request's parsing and tokenization may take; longer gets HTTP 400 (default 30)")
    s.add_argument("--header-timeout", type=seconds, default=10.0, metavar="S",
                   help="seconds a client has to send a request's head (request line and headers) after connecting "
                        "or after its previous answer; longer gets HTTP 408 and the connection closed (default 10)")
    s.add_argument("--max-grammar-bytes", type=positive_int, default=64 * 2**10, metavar="B",
                   help="the longest structured-output constraint (schema, regex, choices, tool tag) in bytes; longer "
                        "gets HTTP 400 before compiling (default 64 KiB)")
    s.add_argument("--grammar-timeout", type=seconds, default=10.0, metavar="S",
                   help="seconds one grammar compile may take; its worker process is killed past it, HTTP 400 "
                        "(default 10)")
    s.add_argument("--grammar-memory", type=positive_int, default=2**30, metavar="B",
                   help="bytes of address space a grammar worker's compiles may add (RLIMIT_AS); past it HTTP 400 "
                        "and the worker is replaced (default 1 GiB)")
    s.add_argument("--grammar-workers", type=positive_int, default=2, metavar="N",
                   help="grammar worker processes, compiles at once (default 2)")
    s.add_argument("--grammar-cache-bytes", type=non_negative_int, default=256 * 2**20, metavar="B",
                   help="bytes of compiled grammars kept for reuse, least recently used dropped (default 256 MiB; 0: "
                        "none)")
    s.add_argument("--image-dir", type=Path, default=None, metavar="DIR",
                   help="image_url parts may name local files (file: URLs) inside DIR (default: none)")
    s.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image_url parts (default: data: URLs only)")
    s.add_argument("--allow-private-image-urls", action="store_true",
                   help="with --allow-image-urls: also fetch from loopback, private, link-local and other non-public "
                        "addresses (for local use; default: refused, on every redirect hop too)")
    s.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="with --allow-image-urls: fetch only from these host names (exact, case-insensitive; "
                        "checked on every redirect hop; default: any public host)")
    s.add_argument("--max-image-bytes", type=positive_int, default=8 * 2**20, metavar="B",
                   help="the largest image an image_url part may hold, decoded or fetched (default 8 MiB)")
    s.add_argument("--max-image-pixels", type=positive_int, default=32 * 2**20, metavar="N",
                   help="the most pixels (width x height) an image may have, checked before decoding (default 32 Mi)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="every /v1 and tokenizer route needs 'Authorization: Bearer KEY' (HTTP 401 otherwise; "
                        "/health and /metrics stay open); default: the environment variable DGEMMA_API_KEY, else "
                        "no key. Prefer the variable: a command line is visible to other users of the machine")
    s.add_argument("--max-logprobs", type=logprob_count, default=20, metavar="K",
                   help="the most alternatives per token a request's logprobs may ask for (completions' logprobs, "
                        "chat's top_logprobs; more get HTTP 400); each denoise step keeps K per position (default "
                        "20, vLLM's; 0: only the returned tokens' own log-probabilities)")
    s.add_argument("--eager", action="store_true", help="eager steps instead of the compiled bucket (no compile)")
    s.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="auto (default): load the batch sizes the compile cache holds, compile the others in a "
                        "background process while the eager step serves (GET /health: buckets[].step); always: "
                        "compile batch 1 before serving, the others on first use; never: the eager step only")
    s.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                   help="each row's logits bitwise those of its solo run whatever the bucket and batch mates "
                        "(CompileOptions.batch_invariant; auto: on for CPU, free there)")
    s.add_argument("--fuse-commit", choices=("auto", "on", "off"), default="auto",
                   help="commit fusion: each commit rides in its next block's first denoise step, every row of the "
                        "mixed step 2C tokens (CompileOptions.fuse_commit; auto: on for CUDA, off for CPU, where "
                        "the doubled rows cost more than the iteration they save)")
    s.add_argument("--threads", type=positive_int, default=None, metavar="N", help="intra-op CPU threads (as generate)")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    _parallel_flags(s)
    k = sub.add_parser("cache", help="the compile cache (compiled steps loaded by later runs; docs/cli.md): where it "
                                     "is, its entries, or empty it")
    k.add_argument("action", choices=("info", "clear"), help="info: the directory and its entries; clear: remove them")
    return p


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=positive_int, default=None, metavar="N",
                   help="shard the model over N ranks (docs/parallel.md): started here as N processes (gloo on CPU, "
                        "nccl on CUDA), or joined under torchrun (its WORLD_SIZE); rank 0 alone writes the output "
                        "and serves HTTP (default 1, or torchrun's WORLD_SIZE)")
    p.add_argument("--experts-split", choices=("tensor", "expert"), default="tensor",
                   help="how a tensor-parallel run splits the routed experts: tensor (every expert's intermediate "
                        "slice on every rank, the default) or expert (E/N whole experts a rank; E must be a multiple "
                        "of N); the same bytes move per step either way (docs/parallel.md, 'Experts: which split')")
    p.add_argument("--group-timeout", type=seconds, default=DEFAULT_GROUP_TIMEOUT_S, metavar="S",
                   help="seconds a rank waits for its peers in a collective before the run ends with an error (a rank "
                        f"that crashes ends it at once; default {DEFAULT_GROUP_TIMEOUT_S:.0f})")


# ----- each command's arguments, validated once: a frozen record the command reads and never changes -------------
def _tuple(value):
    """A repeatable flag's list as a tuple (a frozen record holds no list), None kept."""
    return None if value is None else tuple(value)


@dataclass(frozen=True)
class CommandArgs:
    """A command's arguments record: `from_namespace` takes its fields from argparse's namespace (the flags' own
    names), repeatable flags as tuples; a subclass's `__post_init__` checks the rules between its flags."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace):
        values = {f.name: getattr(ns, f.name) for f in fields(cls)}
        return cls(**{k: _tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class ParallelArgs(CommandArgs):
    """The tensor-parallel flags generate and serve share (`_parallel_flags`)."""

    tensor_parallel_size: int | None = None
    experts_split: str = "tensor"
    group_timeout: float = DEFAULT_GROUP_TIMEOUT_S


@dataclass(frozen=True)
class GenerateArgs(ParallelArgs):
    """`dgemma generate`'s arguments (the flags of `_parser`'s generate command, same names), validated once when
    made (`from_namespace`; argparse's value types checked each flag before): the rules between flags below raise
    `ConfigError` naming the flag. The command reads it and never changes it; what it derives (the model, its
    quantization, the constraint) travels beside it (`run.Loaded`)."""

    prompt: str | None = None
    model: Path | None = None
    chat: bool = False
    image: tuple[str, ...] | None = None
    max_soft_tokens: int | None = None
    system: str | None = None
    max_new_tokens: int | None = None
    max_denoising_steps: int | None = None
    temperature: float | None = None
    entropy_bound: float | None = None
    stop: tuple[str, ...] | None = None
    seed: int = 0
    dtype: str | None = None
    quant: str | None = None
    eager: bool = False
    compile: str = "auto"
    threads: int | None = None
    live: bool = False
    template: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_schema: str | None = None
    json_object: bool = False
    prompts_file: str | None = None
    batch_size: int | None = None

    def __post_init__(self) -> None:
        from ..model.config import ConfigError
        from ..inputs.text import check_stop_strings

        if self.prompt is not None and self.prompts_file is not None:
            raise ConfigError("prompt", "give a prompt or --prompts-file, not both")
        if self.prompt is None and self.prompts_file is None:
            raise ConfigError("prompt", "give a prompt, or --prompts-file FILE")
        if self.batch_size is not None and self.prompts_file is None:
            raise ConfigError("batch_size", "--batch-size applies to --prompts-file only")
        if self.image and self.prompts_file is not None:
            raise ConfigError("image", "--image applies to one prompt, not to --prompts-file")
        if self.template is not None and self.prompts_file is not None:
            raise ConfigError("template", "--template applies to one prompt, not to --prompts-file")
        if self.live and self.prompts_file is not None:
            raise ConfigError("live", "--live draws one prompt's canvas, not --prompts-file's")
        if self.max_soft_tokens is not None and not self.image:
            raise ConfigError("max_soft_tokens", "--max-soft-tokens applies to --image only")
        check_stop_strings(self.stop, "--stop")


@dataclass(frozen=True)
class ServeArgs(ParallelArgs):
    """`dgemma serve`'s arguments (the flags of `_parser`'s serve command, same names), validated once when made:
    `image_dir` must be a directory, and the image-URL policies need --allow-image-urls (`ConfigError`)."""

    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_queue: int = 256
    max_seq_len: int | None = None
    kv_page_size: int | None = None
    kv_pages: int | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 2**20
    input_timeout: float = 30.0
    header_timeout: float = 10.0
    max_grammar_bytes: int = 64 * 2**10
    grammar_timeout: float = 10.0
    grammar_memory: int = 2**30
    grammar_workers: int = 2
    grammar_cache_bytes: int = 256 * 2**20
    image_dir: Path | None = None
    allow_image_urls: bool = False
    allow_private_image_urls: bool = False
    allowed_media_domains: tuple[str, ...] | None = None
    max_image_bytes: int = 8 * 2**20
    max_image_pixels: int = 32 * 2**20
    api_key: str | None = None
    max_logprobs: int = 20
    eager: bool = False
    compile: str = "auto"
    batch_invariant: str = "auto"
    fuse_commit: str = "auto"
    threads: int | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        from ..model.config import ConfigError

        if self.image_dir is not None and not self.image_dir.is_dir():
            raise ConfigError("image_dir", f"{self.image_dir} is not a directory")
        if (self.allow_private_image_urls or self.allowed_media_domains) and not self.allow_image_urls:
            raise ConfigError("allow_image_urls", "--allow-private-image-urls and --allowed-media-domains apply to "
                              "fetched image URLs: add --allow-image-urls")


@dataclass(frozen=True)
class ExplainArgs(CommandArgs):
    """`dgemma explain`'s arguments."""

    model: Path | None = None
    batch_size: int = 1
    quant: str | None = None
    json: bool = False


@dataclass(frozen=True)
class CacheArgs(CommandArgs):
    """`dgemma cache`'s arguments."""

    action: str = "info"


COMMANDS = {"generate": GenerateArgs, "serve": ServeArgs, "explain": ExplainArgs, "cache": CacheArgs}
"""Each command's arguments record; `main` makes it once from argparse's namespace."""
