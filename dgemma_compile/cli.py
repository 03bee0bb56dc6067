"""`dgemma generate | explain | serve`: block-diffusion generation, compile reports and the OpenAI-compatible server
(`runtime/`) from the command line.

`dgemma generate PROMPT` prints each block's text on stdout as soon as the block is committed (through
`text.Detokenizer`: never a broken character, never a repeat), then one stats line on stderr.
`dgemma generate --prompts-file FILE|-` runs many prompts in batches and writes one JSON line per prompt on stdout,
in input order. Every expected failure (missing directory or file, bad checkpoint, bad parameter, bad prompt) is one
`dgemma: error:` line on stderr and exit status 2.

Timing: tok/s and ttfb_s (request start to the first committed block) cover the generation only. One-time costs
come first and are reported apart: `compile_s` (compiled path: every compile unit of the bucket), or `warmup_s`
(`--eager`: an untimed run of the same request with one denoise step per block, so that the shape-specialised
traces eager FlexAttention makes on first use of each shape are done before the clock starts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .demo import DEMO_MODEL

# `dgemma --help` imports no torch (tests/test_imports.py): torch and every module that imports it are imported inside
# the commands, and the parser's choices are plain names, checked equal to their torch-side sources by the tests.
DTYPES = ("bfloat16", "float16", "float32")  # --dtype: names of torch dtypes
COMPILE_MODES = ("auto", "always", "never")  # --compile (`_compile_mode`)
QUANT_SCHEMES = ("fp8", "fp8-weight-only", "nvfp4-w4a16", "nvfp4")  # = quant.schemes.SCHEMES
DEFAULT_GROUP_TIMEOUT_S = 300.0  # = parallel.ranks.DEFAULT_GROUP_TIMEOUT_S
DEFAULT_BATCH_SIZE = 8
MOE_RULE = ("loop = transformers' summation order (eager default, parity tests); grouped = torch._grouped_mm (compiled "
            "bf16 with E/K > 4; compiled float32 on CPU with a canvas of >= 256 tokens, as an eager call inside the "
            "step); gathered = each assignment's expert rows gathered, one fused loop nest (compiled, everything "
            "else); dense = every expert on every token (explicit only)")
# --prompts-file JSONL keys: the ones a line may set, and the ones that will come with later flags.
LINE_KEYS = ("prompt", "seed", "max_new_tokens", "entropy_bound", "temperature", "stop")
SLOT_ROUNDING = 256  # static cache sizes are rounded up so that nearby requests share compiled graphs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgemma", description="DiffusionGemma block-diffusion generation.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt (or of each prompt of a file)")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (or give --prompts-file)")
    g.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (config.json, safetensors, tokenizer); default: the built-in demo model")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image the prompt is about (repeatable; a multimodal checkpoint): with --chat, one image "
                        "part per image before the text; raw, the prompt's image placeholders, or one per image first")
    g.add_argument("--max-soft-tokens", type=int, default=None, metavar="N",
                   help="soft tokens per image (70, 140, 280, 560 or 1120; default: the checkpoint's processor, 280)")
    g.add_argument("--system", default=None, metavar="TEXT",
                   help="system message before the prompt in the chat template (implies --chat)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="exact token budget (default: generation config)")
    g.add_argument("--max-denoising-steps", type=int, default=None, help="denoise steps per block at most")
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="scales the checkpoint's temperature schedule (GenerationConfig.with_temperature); 0 = greedy")
    g.add_argument("--entropy-bound", type=float, default=None, metavar="X",
                   help="entropy bound of the acceptance rule (default: generation config)")
    g.add_argument("--stop", action="append", default=None, metavar="S",
                   help="stop string (repeatable): the output ends before its first occurrence, across blocks too")
    g.add_argument("--seed", type=int, default=0, help="seed of the request's random stream (of each line without one)")
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
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op CPU threads (default: OMP_NUM_THREADS if set, else dgemma_compile.threads."
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
                        "stop); '-' reads "
                        "stdin; writes one JSON line per prompt on stdout, in input order")
    g.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"prompts per batch with --prompts-file (default {DEFAULT_BATCH_SIZE}: one compiled bucket)")
    _parallel_flags(g)
    e = sub.add_parser("explain", help="Dynamo explain report of the compiled step (one unit per batch size)")
    e.add_argument("--model", type=Path, default=None, help="checkpoint directory; default: the built-in demo model")
    e.add_argument("--batch-size", type=int, default=1, help="report the bucket serving this many requests")
    e.add_argument("--quant", choices=QUANT_SCHEMES, default=None, help="quantize the weights first (as generate)")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the [serve] extra): /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics")
    s.add_argument("--model", type=Path, default=None, help="checkpoint directory; default: the built-in demo model")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--max-batch", type=int, default=8, metavar="N",
                   help="rows of the engine's one compiled bucket: requests running at once (default 8)")
    s.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests waiting for a row at most; more get HTTP 429 (default 256)")
    s.add_argument("--max-seq-len", type=int, default=None, metavar="S",
                   help="committed KV slots per row: prompt + generated tokens (default: the model's context, at "
                        "most 1024)")
    s.add_argument("--kv-page-size", type=int, default=None, metavar="P",
                   help="a paged KV cache of P-slot pages shared by the rows, with a prefix cache of full prompt "
                        "pages (a multiple of the canvas length; default: a static cache per row)")
    s.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="pages in the pool with --kv-page-size (default: max-batch x max-seq-len / P, the static "
                        "cache's memory); requests wait for pages, never running ones")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: dgemma-demo for the "
                                                             "demo model, else the checkpoint directory's name)")
    s.add_argument("--max-body-bytes", type=int, default=4 * 2**20, metavar="B",
                   help="larger request bodies get HTTP 413 (default 4 MiB)")
    s.add_argument("--input-timeout", type=float, default=30.0, metavar="S",
                   help="seconds one request's parsing and tokenization may take; longer gets HTTP 400 (default 30)")
    s.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a client has to send a request's head (request line and headers) after connecting "
                        "or after its previous answer; longer gets HTTP 408 and the connection closed (default 10)")
    s.add_argument("--max-grammar-bytes", type=int, default=64 * 2**10, metavar="B",
                   help="the longest structured-output constraint (schema, regex, choices, tool tag) in bytes; longer "
                        "gets HTTP 400 before compiling (default 64 KiB)")
    s.add_argument("--grammar-timeout", type=float, default=10.0, metavar="S",
                   help="seconds one grammar compile may take; its worker process is killed past it, HTTP 400 "
                        "(default 10)")
    s.add_argument("--grammar-memory", type=int, default=2**30, metavar="B",
                   help="bytes of address space a grammar worker's compiles may add (RLIMIT_AS); past it HTTP 400 "
                        "and the worker is replaced (default 1 GiB)")
    s.add_argument("--grammar-workers", type=int, default=2, metavar="N",
                   help="grammar worker processes, compiles at once (default 2)")
    s.add_argument("--grammar-cache-bytes", type=int, default=256 * 2**20, metavar="B",
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
    s.add_argument("--max-image-bytes", type=int, default=8 * 2**20, metavar="B",
                   help="the largest image an image_url part may hold, decoded or fetched (default 8 MiB)")
    s.add_argument("--max-image-pixels", type=int, default=32 * 2**20, metavar="N",
                   help="the most pixels (width x height) an image may have, checked before decoding (default 32 Mi)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="every /v1 and tokenizer route needs 'Authorization: Bearer KEY' (HTTP 401 otherwise; "
                        "/health and /metrics stay open); default: the environment variable DGEMMA_API_KEY, else "
                        "no key. Prefer the variable: a command line is visible to other users of the machine")
    s.add_argument("--max-logprobs", type=int, default=20, metavar="K",
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
    s.add_argument("--threads", type=int, default=None, metavar="N", help="intra-op CPU threads (as generate)")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    _parallel_flags(s)
    k = sub.add_parser("cache", help="the compile cache (compiled steps loaded by later runs; docs/cli.md): where it "
                                     "is, its entries, or empty it")
    k.add_argument("action", choices=("info", "clear"), help="info: the directory and its entries; clear: remove them")
    return p


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="shard the model over N ranks (docs/parallel.md): started here as N processes (gloo on CPU, "
                        "nccl on CUDA), or joined under torchrun (its WORLD_SIZE); rank 0 alone writes the output "
                        "and serves HTTP (default 1, or torchrun's WORLD_SIZE)")
    p.add_argument("--experts-split", choices=("tensor", "expert"), default="tensor",
                   help="how a tensor-parallel run splits the routed experts: tensor (every expert's intermediate "
                        "slice on every rank, the default) or expert (E/N whole experts a rank; E must be a multiple "
                        "of N); the same bytes move per step either way (docs/parallel.md, 'Experts: which split')")
    p.add_argument("--group-timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S, metavar="S",
                   help="seconds a rank waits for its peers in a collective before the run ends with an error (a rank "
                        f"that crashes ends it at once; default {DEFAULT_GROUP_TIMEOUT_S:.0f})")


# ----- prompts ------------------------------------------------------------------------------------------------------
def _encode(tokenizer, model, prompt: str, args: argparse.Namespace, images=None) -> list[int]:
    """Token ids of one prompt: raw, or through the chat template with --chat/--system; `images` (`images.Image`,
    --image) become the prompt's placeholder runs (`text.ImageSlots`). Raises ConfigError."""
    from .preprocess import num_soft_tokens
    from .text import ImageSlots, encode_chat, encode_prompt, user_messages

    bos = model.config.bos_token_id
    slots = ImageSlots.for_model(tokenizer, model, [num_soft_tokens(model, im) for im in images]) if images else None
    if args.chat or args.system is not None:
        messages = user_messages(prompt, args.system)
        if images:
            messages[-1] = {"role": "user", "content": [{"type": "image"} for _ in images]
                            + [{"type": "text", "text": prompt}]}
        return encode_chat(tokenizer, messages, bos_token_id=bos, images=slots)
    return encode_prompt(tokenizer, prompt, bos_token_id=bos, images=slots)


@dataclass
class PromptLine:
    """One line of a prompts file: its 1-based number and either the request's parts or the error."""

    line: int
    prompt: str | None = None
    changes: dict | None = None  # GenerationConfig changes the line asks for
    seed: int | None = None
    error: str | None = None
    ids: list[int] | None = None
    config: object = None
    stop: object = None  # the line's "stop" (a string or a list), None: --stop
    stops: tuple[str, ...] = ()


def read_prompts_file(name: str) -> list[PromptLine]:
    """The prompt lines of FILE (or stdin for '-'); blank lines are skipped (line numbers still count them).

    A line whose first non-blank character is `{` is a JSON object; any other line is the prompt itself (without
    its line ending). Raises ConfigError when the file cannot be read or holds no prompt.
    """
    from .config import ConfigError

    if name == "-":
        data = sys.stdin.buffer.read()
    else:
        path = Path(name)
        if not path.exists():
            raise ConfigError("--prompts-file", f"{name}: no such file")
        if path.is_dir():
            raise ConfigError("--prompts-file", f"{name}: is a directory")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError("--prompts-file", f"{name}: {e.strerror or e}") from None
    lines = [parse_prompt_line(i, raw) for i, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    if not lines:
        raise ConfigError("--prompts-file", f"{name}: no prompts")
    return lines


def parse_prompt_line(number: int, raw: bytes) -> PromptLine:
    """One prompts-file line -> `PromptLine` (with `error` set when the line is bad)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return PromptLine(number, error=f"not UTF-8 text (byte {e.start + 1})")
    if not text.lstrip().startswith("{"):
        return PromptLine(number, prompt=text, changes={})
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return PromptLine(number, error=f"not a valid JSON object: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return PromptLine(number, error="not a valid JSON object")
    for key in obj:
        if key not in LINE_KEYS:
            return PromptLine(number, error=f"{key}: unknown key (a line may set {', '.join(LINE_KEYS)})")
    if "prompt" not in obj:
        return PromptLine(number, error="prompt: missing")
    if not isinstance(obj["prompt"], str):
        return PromptLine(number, error=f"prompt: must be a string, got {json.dumps(obj['prompt'])}")
    changes = {k: obj[k] for k in ("max_new_tokens", "entropy_bound", "temperature") if k in obj}
    return PromptLine(number, prompt=obj["prompt"], changes=changes, seed=obj.get("seed"), stop=obj.get("stop"))


# ----- running ------------------------------------------------------------------------------------------------------
def _apply_threads(args: argparse.Namespace, model) -> int:
    """--threads N, else OMP_NUM_THREADS when set, else `recommended_threads(model)`; applied before any compile
    (Inductor's CPU kernels are generated for the thread count in force)."""
    import torch

    from .threads import recommended_threads

    if args.threads is not None:
        n = args.threads
    elif os.environ.get("OMP_NUM_THREADS", "").strip():
        n = torch.get_num_threads()
    else:
        n = recommended_threads(model)
    torch.set_num_threads(n)
    return n


Run = Callable[..., object]  # (prompts, config, seed=..., on_block=...) -> GenerationOutput


def _compile_mode(args: argparse.Namespace, gen, rows: int, config, jobs: int) -> tuple[str, str]:
    """--compile resolved, with the reason: "always" (compile, or load, before answering), "load" (from the compile
    cache, never compiling), "never" (the eager step), or "background" (the eager step answers while a background
    process compiles). auto (docs/cli.md): "load" when the compile cache holds the step; "never" where the cache
    cannot hold it (off, unusable, quantized weights: a background compile could not hand it over) or for a job of
    one batch (`jobs` <= `rows`: one prompt, or a prompts file no longer than --batch-size), which ends eagerly
    before a compile would; else "background"."""
    if args.compile != "auto":
        return args.compile, f"--compile {args.compile}"
    if getattr(args, "tensor_parallel", False):  # every rank must take the same path: compile or load now
        return "always", "tensor parallel: every rank compiles or loads before answering"
    if gen.cached(rows, config):
        return "load", "in the compile cache"
    if not gen.cacheable(rows, config):
        return "never", ("the compile cache cannot hold this step (DGEMMA_CACHE off, an unusable directory, or "
                         "quantized weights); --compile always compiles it before answering")
    if jobs <= rows:
        return "never", "a job of one batch ends before a compile would; --compile always compiles first"
    return "background", "not in the compile cache yet"


def _runner(model, args: argparse.Namespace, rows: int, slots: int, config, first: tuple[list, int],
            steps: int, images: list | None = None, jobs: int = 1) -> tuple[Run, Callable[[], str]]:
    """The generate function for this invocation and a function giving its one-time cost and step source as stats
    fields: the compiled generator (one bucket of `rows`, a static cache of `slots` committed slots, a temperature
    table of at least `steps` denoise steps) per --compile (`_compile_mode`; `jobs`: the prompts to run): compiled or
    loaded now (`compile_s`, `load_s`), or eager while a background process compiles (`compile_s` of that process, if
    it finished); or, with --eager, the eager reference after an untimed run of `first` = (prompts, seeds) with one
    denoise step per block (`warmup_s`)."""
    from . import generate

    max_seq_len = -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING  # the same cache, so eager and compiled agree
    if args.eager:
        start = time.perf_counter()
        generate(model, first[0], config.replace(max_denoising_steps=1), seed=first[1], max_seq_len=max_seq_len,
                 images=images)
        warmup = (f" model_load_s={args.model_load_s:.2f} warmup_s={time.perf_counter() - start:.2f} step=oracle"
                  f" dtype={str(model.dtype).removeprefix('torch.')}")
        return (lambda *a, **kw: generate(model, *a, max_seq_len=max_seq_len, **kw)), lambda: warmup
    from . import CompileOptions, build

    gen = build(model, CompileOptions(batch_buckets=(rows,), max_seq_len=max_seq_len,
                                      max_denoising_steps=max(256, steps)))
    mode, why = _compile_mode(args, gen, rows, config, jobs)
    bucket = gen.bucket(config)
    name = bucket.step_name(rows)
    compile_s = step_load_s = 0.0
    if mode == "load":
        start = time.perf_counter()
        if rows in gen.load_cached(bucket):
            step_load_s = time.perf_counter() - start
            print(f"dgemma: loaded {name} from the compile cache in {step_load_s:.2f} s", file=sys.stderr, flush=True)
        else:  # a damaged entry (logged, removed): as if it had not been there
            mode, why = ("never", "its cache entry was damaged") if jobs <= rows else \
                ("background", "its cache entry was damaged")
    if mode == "never":
        gen.defer(None)
        print(f"dgemma: answering with the eager step ({why})", file=sys.stderr, flush=True)
    elif mode == "background":
        gen.defer(_background(args, gen, config, [rows]))
        print(f"dgemma: compiling {name} in a background process ({why}: {gen.units.store.root}); answering with "
              "the eager step meanwhile", file=sys.stderr, flush=True)
    elif mode == "always":
        cached = gen.cached(rows, config)
        verb = "loading" if cached else "compiling"
        with _Ticker(f"dgemma: {verb} {name}" + (" from the compile cache" if cached else f" before answering ({why})")):
            took = gen.warmup(rows, config)
        if cached and gen.units.store is not None and gen.units.store.loads:
            step_load_s = took
        else:
            compile_s = took

    def stats() -> str:
        bg = gen.background
        seconds = compile_s if bg is None else bg.seconds if bg.seconds is not None else \
            time.perf_counter() - bg.started  # still running: its seconds so far
        where = "" if bg is None else f" compile={bg.state} in background"
        return (f" model_load_s={args.model_load_s:.2f} compile_s={seconds:.1f} step_load_s={step_load_s:.2f} "
                f"step={gen.step_source}{where} dtype={str(model.dtype).removeprefix('torch.')}")

    return gen.generate, stats


def _background(args: argparse.Namespace, gen, config, sizes: list[int], paging: dict | None = None):
    """A `compile.background.BackgroundCompile` of `gen`'s steps of `sizes` for this invocation's checkpoint, dtype,
    quantization, thread count and structural `config`, started now."""
    import torch

    from .compile.background import BackgroundCompile, CompileSpec, options_fields

    # the dtype the foreground's model has (the loader may have upcast it on this CPU: compute_dtype), so that the
    # background process compiles the step the foreground looks up
    dtype = getattr(args, "dtype", None) or str(gen.model.dtype).removeprefix("torch.")
    spec = CompileSpec(model=str(args.model if args.model is not None else DEMO_MODEL), dtype=dtype,
                       quant=getattr(args, "quant", None), options=options_fields(gen.options),
                       config={"stop_early": config.stop_early, "stability_threshold": config.stability_threshold,
                               "eos_token_ids": config.eos_token_ids},
                       sizes=list(sizes), threads=torch.get_num_threads(), cache_dir=str(gen.units.store.root),
                       paging=paging or {})
    return BackgroundCompile(spec)


class _Ticker:
    """A progress line on stderr while a foreground compile or load runs: its elapsed seconds, redrawn each second
    on a terminal; elsewhere one line at the start and one at the end."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        import threading

        self.start, self.done = time.perf_counter(), threading.Event()
        self.tty = sys.stderr.isatty()
        if self.tty:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        else:
            print(f"{self.what}...", file=sys.stderr, flush=True)
        return self

    def _run(self) -> None:
        while not self.done.wait(1.0):
            print(f"\r{self.what}... {time.perf_counter() - self.start:.0f} s", end="", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        self.done.set()
        took = time.perf_counter() - self.start
        print(f"{chr(13) if self.tty else ''}{self.what}: {took:.1f} s", file=sys.stderr, flush=True)


def _quantize(model, scheme: str | None) -> str | None:
    """`--quant`: quantize the loaded model; the report (what was quantized, what was left out and why) on stderr,
    also for a quantized checkpoint (the loader's report). Returns the model's scheme (None: not quantized)."""
    if scheme is not None:
        from .quant import quantize

        print(quantize(model, scheme).text(), file=sys.stderr)
    elif model.checkpoint.quant_report is not None:
        print(model.checkpoint.quant_report.text(), file=sys.stderr)
    return model.checkpoint.quant_scheme


def generate_command(args: argparse.Namespace, ranks=None) -> int:
    """`dgemma generate`; `ranks` (`parallel.ranks.Ranks`): one rank of a tensor-parallel run, whose inputs (the
    prompts file or stdin, the images) are rank 0's."""
    from . import load_tokenizer
    from .config import ConfigError
    from .text import check_stop_strings

    if args.prompt is not None and args.prompts_file is not None:
        raise ConfigError("prompt", "give a prompt or --prompts-file, not both")
    if args.prompt is None and args.prompts_file is None:
        raise ConfigError("prompt", "give a prompt, or --prompts-file FILE")
    if args.batch_size is not None and args.prompts_file is None:
        raise ConfigError("batch_size", "--batch-size applies to --prompts-file only")
    if args.image and args.prompts_file is not None:
        raise ConfigError("image", "--image applies to one prompt, not to --prompts-file")
    if args.template is not None and args.prompts_file is not None:
        raise ConfigError("template", "--template applies to one prompt, not to --prompts-file")
    if args.live and args.prompts_file is not None:
        raise ConfigError("live", "--live draws one prompt's canvas, not --prompts-file's")
    if args.max_soft_tokens is not None and not args.image:
        raise ConfigError("max_soft_tokens", "--max-soft-tokens applies to --image only")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError("batch_size", f"must be a positive integer, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("threads", f"must be a positive integer, got {args.threads}")
    check_stop_strings(args.stop, "--stop")
    args.tensor_parallel = ranks is not None
    lines, args.pil_images = _shared(ranks, lambda: _read_inputs(args))  # before any loading
    args.constraint = _constraint(args)

    model_dir = args.model if args.model is not None else DEMO_MODEL
    start = time.perf_counter()
    model = _load(model_dir, args, ranks)
    args.quant = _quantize(model, args.quant if ranks is None else None)  # ranks: quantized before sharding (_load)
    args.model_load_s = time.perf_counter() - start
    tokenizer = load_tokenizer(model_dir)
    if args.constraint is not None:  # compiled against this tokenizer now: a bad one fails before any model work
        from .constraint import row_grammars

        row_grammars(model, [args.constraint], [model.generation_config.resolved(model.config)], tokenizer)
    changes = {}
    if args.max_new_tokens is not None:
        changes["max_new_tokens"] = args.max_new_tokens
    if args.max_denoising_steps is not None:
        changes["max_denoising_steps"] = args.max_denoising_steps
    if args.entropy_bound is not None:
        changes["entropy_bound"] = args.entropy_bound
    config = model.generation_config.replace(**changes)
    if args.temperature is not None:
        config.with_temperature(args.temperature)  # validated now; each request applies its own temperature once
    if lines is not None:
        return _generate_batch(args, model, tokenizer, config, lines)
    if args.temperature is not None:
        config = config.with_temperature(args.temperature)
    return _generate_one(args, model, tokenizer, config)


def _read_inputs(args: argparse.Namespace) -> tuple[list[PromptLine] | None, list | None]:
    """The prompts file's lines (or None) and the --image files (or None). Raises ConfigError."""
    lines = read_prompts_file(args.prompts_file) if args.prompts_file is not None else None
    images = None
    if args.image:
        from .preprocess import read_image

        images = [read_image(p) for p in args.image]
    return lines, images


def _shared(ranks, make):
    """`make()`, or rank 0's on every rank of a tensor-parallel run (stdin and files are read once, by rank 0)."""
    return make() if ranks is None else ranks.share(make)


def _load(model_dir, args: argparse.Namespace, ranks):
    """The model (--dtype); in a tensor-parallel run this rank's shard of it, read slice by slice from the files
    (`parallel.load_sharded`, on the rank's device; a compressed-tensors checkpoint too), or with --quant loaded
    whole, quantized as one process would and then sharded (`model.checkpoint.quant_report` set), so that every rank holds the
    one-process quantized weights' slices. Raises ConfigError for a split the model's shapes refuse."""
    import torch

    from . import load
    from .config import ConfigError

    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    if ranks is None:
        return load(model_dir, dtype=dtype)
    from . import compute_dtype, parallel

    from .loader import CheckpointError

    if dtype is None and ranks.device.type == "cpu":  # one decision for the group (compute_dtype.adopt)
        compute_dtype.adopt(ranks.share(lambda: {d: compute_dtype.probe(d) for d in (torch.bfloat16, torch.float16)}))

    try:  # each rank reads only its slices; with --quant it quantizes the whole model first, then shards it
        return parallel.load_sharded(model_dir, dtype=dtype, device=ranks.device, quant=getattr(args, "quant", None),
                                     experts=getattr(args, "experts_split", "tensor"))
    except (CheckpointError, ConfigError):  # the checkpoint's or the scheme's own error, as without ranks
        raise
    except ValueError as e:  # a split the shapes refuse (`parallel.shard`)
        raise ConfigError("tensor_parallel_size", str(e)) from None


def _constraint(args: argparse.Namespace):
    """The `Constraint` of --regex / --choice / --json-schema FILE / --json-object, or None. Raises ConfigError
    (naming the flag) for an unreadable schema file or a malformed constraint."""
    from .config import ConfigError
    from .constraint import Constraint

    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.choice is not None:
        return Constraint.choice(args.choice)
    if args.json_object:
        return Constraint.json_object()
    if args.json_schema is None:
        return None
    try:
        text = Path(args.json_schema).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--json-schema", f"cannot read {args.json_schema} ({e})") from None
    try:
        return Constraint.json_schema(text)
    except ConfigError as e:
        raise ConfigError("--json-schema", f"{args.json_schema}: {e}") from None


def _generate_one(args: argparse.Namespace, model, tokenizer, config) -> int:
    from .generate import plan_requests
    from .text import StopStrings

    matcher = StopStrings(tokenizer, args.stop or ())  # validates --stop before any compile
    images = None
    if args.image:
        from .images import prepare
        from .preprocess import preprocess

        images = [preprocess(model, args.pil_images, max_soft_tokens=args.max_soft_tokens)]
    ids = _encode(tokenizer, model, args.prompt, args, images[0] if images else None)
    slots = plan_requests(model, [ids], config, args.seed)[3]  # validate prompt, config and seed before any compile
    if images:
        prepare(model, [ids], images)  # the images against their placeholders, before any compile
    if args.constraint is not None:  # its commits are the kept prefixes, not whole canvases
        slots = max(slots, len(ids) + config.max_new_tokens - 1)
    canvas = {}
    if args.template is not None:  # validated before any compile
        from .canvas import canvas_of

        canvas = {"canvas": [canvas_of(args.template, config, model.config.vocab_size, tokenizer, name="template")]}
    threads = _apply_threads(args, model)
    run, costs = _runner(model, args, 1, slots, config, ([ids], args.seed), config.max_denoising_steps, images)

    first_block: list[float] = []
    view = _live_view(args, tokenizer, config)

    def on_block(_: int, new_tokens: list[list[int]]) -> None:
        if not first_block:
            first_block.append(time.perf_counter())
        text = matcher.push(new_tokens[0])
        if view is not None:  # shown in the live view; the whole text is printed when it closes
            view.commit(text)
            return
        sys.stdout.write(text)
        sys.stdout.flush()

    start = time.perf_counter()
    with view if view is not None else contextlib.nullcontext():
        out = run([ids], config, seed=args.seed, on_block=on_block, stop=lambda *_: [0] if matcher.stopped else [],
                  constraint=args.constraint, tokenizer=tokenizer, **({"images": images} if images else {}),
                  **({"on_frame": view.frame} if view is not None else {}), **canvas)
    elapsed = time.perf_counter() - start
    if view is not None:
        sys.stdout.write(view.committed)
    sys.stdout.write(matcher.finish() + "\n")
    sys.stdout.flush()  # the answer before the stats line
    st = out.stats[0]
    ttfb = (first_block[0] - start) if first_block else elapsed
    print(f"tokens={st.num_tokens} blocks={st.blocks} mean_steps_per_block={st.decoder_passes / max(st.blocks, 1):.2f} "
          f"tokens_per_forward={st.tokens_per_forward:.2f} tok/s={st.num_tokens / elapsed:.1f} "
          f"finish={st.finish_reason}{costs()} ttfb_s={ttfb:.3f} threads={threads} scheme={out.scheme} "
          f"moe={out.moe_impl} commit={'fused' if out.fuse_commit else 'separate'} quant={args.quant or 'none'}",
          file=sys.stderr)
    return 0


def _live_view(args: argparse.Namespace, tokenizer, config):
    """--live's `live.LiveView` when stdout is a terminal; else None (with a note on stderr when --live was given:
    the text is printed as without it, and no frame is read)."""
    if not args.live:
        return None
    if not sys.stdout.isatty():
        print("dgemma: --live draws only on a terminal; stdout is not one, so the text is printed as usual",
              file=sys.stderr, flush=True)
        return None
    from .live import LiveView

    return LiveView(tokenizer, config.max_denoising_steps)


def _generate_batch(args: argparse.Namespace, model, tokenizer, config, lines: list[PromptLine]) -> int:
    """--prompts-file: validate every line first (a bad one is reported in its place), group the good ones by
    config, run each group in batches of --batch-size, write one JSON line per prompt in input order."""
    from tqdm import tqdm

    from .config import ConfigError
    from .generate import STRUCTURAL, plan_requests
    from .text import StopStrings, check_stop_strings

    batch = args.batch_size if args.batch_size is not None else DEFAULT_BATCH_SIZE
    slots = 0
    for ln in lines:
        if ln.error is not None:
            continue
        try:
            ln.ids = _encode(tokenizer, model, ln.prompt, args)
            changes = dict(ln.changes)
            temperature = changes.pop("temperature", args.temperature)  # the line's, else --temperature
            ln.config = config.replace(**changes)
            if temperature is not None:
                ln.config = ln.config.with_temperature(temperature)
            ln.stops = check_stop_strings(args.stop if ln.stop is None else ln.stop)
            ln.seed = args.seed if ln.seed is None else ln.seed
            slots = max(slots, plan_requests(model, [ln.ids], ln.config, ln.seed)[3])  # validates; slots needed
            if args.constraint is not None:
                slots = max(slots, len(ln.ids) + ln.config.max_new_tokens - 1)
        except ConfigError as e:
            ln.error = str(e)
    good = [ln for ln in lines if ln.error is None]
    groups: dict[object, list[PromptLine]] = {}  # requests of one batch may differ in all but STRUCTURAL fields
    for ln in good:
        groups.setdefault(tuple(getattr(ln.config, f) for f in STRUCTURAL), []).append(ln)
    chunks = [g[i:i + batch] for g in groups.values() for i in range(0, len(g), batch)]

    results: dict[int, dict] = {ln.line: {"line": ln.line, "error": ln.error} for ln in lines if ln.error is not None}
    for ln in lines:
        if ln.error is not None:
            print(f"dgemma: error: --prompts-file line {ln.line}: {ln.error}", file=sys.stderr)
    order = [ln.line for ln in lines]
    written = 0

    def flush() -> None:
        nonlocal written
        while written < len(order) and order[written] in results:
            sys.stdout.write(json.dumps(results.pop(order[written]), ensure_ascii=False) + "\n")
            written += 1
        sys.stdout.flush()

    flush()
    summary = ""
    if chunks:
        threads = _apply_threads(args, model)
        rows = min(batch, max(len(c) for c in chunks))
        first = chunks[0]
        run, costs = _runner(model, args, rows, slots, first[0].config,
                             ([ln.ids for ln in first], [ln.seed for ln in first]),
                             max(ln.config.max_denoising_steps for ln in good), jobs=len(good))
        first_block: list[float] = []
        matchers: list[StopStrings] = []

        def on_block(_: int, new_tokens: list[list[int]]) -> None:
            if not first_block:
                first_block.append(time.perf_counter())
            for m, toks in zip(matchers, new_tokens):
                m.push(toks)

        def stop(*_) -> list[int]:
            return [i for i, m in enumerate(matchers) if m.stopped]

        tokens = blocks = passes = 0
        start = time.perf_counter()
        with tqdm(total=len(good), unit="prompt", file=sys.stderr, desc="dgemma", disable=None) as bar:
            for chunk in chunks:
                matchers[:] = [StopStrings(tokenizer, ln.stops) for ln in chunk]
                out = run([ln.ids for ln in chunk], [ln.config for ln in chunk], seed=[ln.seed for ln in chunk],
                          on_block=on_block, stop=stop, constraint=args.constraint, tokenizer=tokenizer)
                for ln, m, st in zip(chunk, matchers, out.stats):
                    m.finish()
                    results[ln.line] = {"line": ln.line, "text": m.text,
                                        "num_tokens": st.num_tokens, "finish_reason": st.finish_reason,
                                        "steps_per_block": list(st.steps_per_block)}
                    tokens, blocks, passes = tokens + st.num_tokens, blocks + st.blocks, passes + st.decoder_passes
                flush()
                bar.update(len(chunk))
        elapsed = time.perf_counter() - start
        ttfb = (first_block[0] - start) if first_block else elapsed
        summary = (f" tokens={tokens} blocks={blocks} mean_steps_per_block={passes / max(blocks, 1):.2f} "
                   f"tokens_per_forward={tokens / max(passes, 1):.2f} tok/s={tokens / elapsed:.1f} batch_size={batch}"
                   f"{costs()} ttfb_s={ttfb:.3f} threads={threads}")
    flush()
    errors = len(lines) - len(good)
    print(f"prompts={len(lines)} errors={errors}{summary}", file=sys.stderr)
    return 2 if errors else 0


def explain_command(args: argparse.Namespace) -> int:
    import dataclasses

    from . import CompileOptions, build, load
    from .config import ConfigError

    if args.batch_size < 1:
        raise ConfigError("batch_size", f"must be a positive integer, got {args.batch_size}")
    model = load(args.model if args.model is not None else DEMO_MODEL)
    _quantize(model, args.quant)
    # one bucket that also serves the default workload's two-row batch; 256 slots as `dgemma generate` uses for a
    # short request, so both commands share Inductor's on-disk cache
    reports = build(model, CompileOptions(batch_buckets=(max(2, args.batch_size),), max_seq_len=SLOT_ROUNDING)
                    ).explain(args.batch_size)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
    else:
        print("\n".join(r.text() for r in reports))
        print(f"moe_impl rule (ops.moe.resolve_moe_impl): {MOE_RULE}")
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """`dgemma serve`'s API key: --api-key, else the environment variable DGEMMA_API_KEY, else None (no key).
    Raises ConfigError for an empty or blank key (never showing it)."""
    from .config import ConfigError

    key = args.api_key if args.api_key is not None else os.environ.get("DGEMMA_API_KEY")
    if key is not None and not key.strip():
        raise ConfigError("api_key", "--api-key / DGEMMA_API_KEY is empty; give a key or leave both unset")
    return key


def serve_command(args: argparse.Namespace, ranks=None) -> int:
    """`dgemma serve`: load, build and warm the engine (compiles its bucket), then serve until interrupted.
    `ranks` (`parallel.ranks.Ranks`): one rank of a tensor-parallel run; rank 0 serves HTTP, the others follow its
    schedule (`runtime/parallel.py`) until it stops."""
    from .config import ConfigError

    try:
        import uvicorn

        from dgemma_runtime.grammars import GrammarLimits
        from dgemma_runtime.metrics import ServeMetrics
        from dgemma_runtime.server import create_app
    except ImportError as e:
        raise ConfigError("serve", f"needs the [serve] extra (pip install 'dgemma-compile[serve]'): {e}") from None
    from . import load_tokenizer
    from dgemma_runtime import build_engine
    from dgemma_runtime.parallel import ParallelSchedule

    for name in ("max_batch", "max_queue", "max_seq_len", "threads", "kv_page_size", "kv_pages", "max_body_bytes",
                 "max_image_bytes", "max_image_pixels", "max_grammar_bytes", "grammar_memory", "grammar_workers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(name, f"must be a positive integer, got {v}")
    if not 0 <= args.max_logprobs <= 64:
        raise ConfigError("max_logprobs", f"must be an integer in [0, 64], got {args.max_logprobs}")
    if not args.header_timeout > 0:
        raise ConfigError("header_timeout", f"must be a positive number of seconds, got {args.header_timeout}")
    if not args.input_timeout > 0:
        raise ConfigError("input_timeout", f"must be a positive number of seconds, got {args.input_timeout}")
    if not args.grammar_timeout > 0:
        raise ConfigError("grammar_timeout", f"must be a positive number of seconds, got {args.grammar_timeout}")
    if args.grammar_cache_bytes < 0:
        raise ConfigError("grammar_cache_bytes", f"must be an integer >= 0, got {args.grammar_cache_bytes}")
    if args.image_dir is not None and not args.image_dir.is_dir():
        raise ConfigError("image_dir", f"{args.image_dir} is not a directory")
    from .preprocess import ImageSources

    if (args.allow_private_image_urls or args.allowed_media_domains) and not args.allow_image_urls:
        raise ConfigError("allow_image_urls", "--allow-private-image-urls and --allowed-media-domains apply to fetched "
                          "image URLs: add --allow-image-urls")
    domains = (None if args.allowed_media_domains is None else
               frozenset(d.lower().rstrip(".") for d in args.allowed_media_domains))
    sources = ImageSources(directory=args.image_dir, fetch=args.allow_image_urls, max_bytes=args.max_image_bytes,
                           timeout_s=min(10.0, args.input_timeout / 2),  # inside the request's input timeout
                           allow_private=args.allow_private_image_urls, allowed_domains=domains,
                           max_pixels=args.max_image_pixels)
    api_key = _api_key(args)
    model_dir = args.model if args.model is not None else DEMO_MODEL
    model = _load(model_dir, args, ranks)
    tokenizer = load_tokenizer(model_dir)
    threads = _apply_threads(args, model)
    metrics = ServeMetrics()
    start = time.perf_counter()
    fatal: list[str] = []
    server: list = []

    def on_fatal(message: str) -> None:  # a tensor-parallel rank was lost: stop serving, exit 1
        fatal.append(message)
        if server:  # without waiting for open connections: their requests already ended with "error"
            server[0].should_exit = server[0].force_exit = True

    mode = "always" if ranks is not None and args.compile == "auto" else args.compile  # ranks: one path for all
    if not args.eager and mode == "always":
        print("dgemma: compiling (or loading from the compile cache) the engine's step at batch 1; larger batch sizes "
              "compile on first use...", file=sys.stderr, flush=True)
    engine = build_engine(model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, eager=args.eager,
                          tokenizer=tokenizer, max_queue=args.max_queue, metrics=metrics, page_size=args.kv_page_size,
                          kv_pages=args.kv_pages, fuse_commit={"auto": None, "on": True, "off": False}[args.fuse_commit],
                          batch_invariant={"auto": None, "on": True, "off": False}[args.batch_invariant],
                          max_logprobs=args.max_logprobs,
                          schedule=None if ranks is None else ParallelSchedule(ranks.channel),
                          on_fatal=on_fatal, defer_compile=not args.eager and mode != "always")
    if engine.generator is not None and mode == "auto":
        _serve_background(args, engine)
    if ranks is not None and not ranks.leader:
        engine.follow()  # until rank 0 stops; raises RuntimeError when it is lost
        return 0
    name = args.served_model_name or ("dgemma-demo" if args.model is None else Path(model_dir).resolve().name)
    app = create_app(engine, model_name=name, tokenizer=tokenizer, metrics=metrics, max_body_bytes=args.max_body_bytes,
                     input_timeout_s=args.input_timeout, image_sources=sources, api_key=api_key,
                     grammar_limits=GrammarLimits(max_bytes=args.max_grammar_bytes, timeout_s=args.grammar_timeout,
                                                  memory_bytes=args.grammar_memory, workers=args.grammar_workers,
                                                  cache_bytes=args.grammar_cache_bytes))
    engine.start()
    print(f"dgemma: serving {name} on http://{args.host}:{args.port} max_batch={args.max_batch} "
          f"max_seq_len={engine.max_seq_len} steps={'eager' if args.eager else f'--compile {mode}'} "
          f"kv={'static' if engine.memory is None else f'pages {engine.memory.pool.capacity}x{args.kv_page_size}'} "
          f"batch_invariant={'on' if engine.batch_invariant else 'off'} max_logprobs={engine.max_logprobs} "
          f"setup_s={time.perf_counter() - start:.1f} threads={threads} api_key={'on' if api_key else 'off'}"
          f"{'' if ranks is None else f' tensor_parallel_size={ranks.world_size}'}", file=sys.stderr, flush=True)
    for b in engine.bucket_table():
        print(f"dgemma: bucket rows={b['rows']} tokens_per_row={b['tokens_per_row']} "
              f"fuse_commit={'on' if b['fuse_commit'] else 'off'} kv={b['kv']} unit={b['unit']} "
              f"compiled={'eager' if b['compiled'] is None else b['compiled']} step={b['step']}", file=sys.stderr,
              flush=True)
    from dgemma_runtime.http_protocol import bounded_protocol

    server.append(uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                http=bounded_protocol(args.header_timeout))))
    if fatal:  # lost a rank before the server started
        server[0].should_exit = True
    try:
        server[0].run()
    finally:
        engine.shutdown()
    if fatal:
        from .parallel.ranks import ParallelError

        raise ParallelError(fatal[0])
    return 0


def _serve_background(args: argparse.Namespace, engine) -> None:
    """`dgemma serve --compile auto`: load every batch size the compile cache holds now; compile the others in a
    background process while the eager step serves them (the engine switches between iterations, logged)."""
    gen, bucket = engine.generator, engine.bucket
    start = time.perf_counter()
    first = bucket.view(bucket.sizes[0])
    if not first.step.cacheable:  # a background compile could not hand its steps over: the eager step serves
        print("dgemma: the compile cache cannot hold this model's steps (DGEMMA_CACHE off, an unusable directory, or "
              "quantized weights): serving with the eager step; --compile always compiles batch 1 before serving",
              file=sys.stderr, flush=True)
        return
    loaded = gen.load_cached(bucket)
    missing = [b for b in bucket.sizes if b not in loaded]
    if loaded:
        print(f"dgemma: loaded batch sizes {loaded} from the compile cache in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
    if not missing:
        gen.deferred = False
        return
    paging = dict(page_size=args.kv_page_size, kv_pages=args.kv_pages) if args.kv_page_size is not None else {}
    gen.defer(_background(args, gen, engine.model.generation_config, missing, paging))
    print(f"dgemma: compiling batch sizes {missing} in a background process; the eager step serves them meanwhile",
          file=sys.stderr, flush=True)


def cache_command(args: argparse.Namespace) -> int:
    """`dgemma cache info|clear`: the compile cache's directory and entries (unit, bytes, age), or remove them."""
    from .compile.artifacts import ArtifactStore, cache_root
    from .config import ConfigError

    if cache_root() is None:
        print(f"compile cache: off (DGEMMA_CACHE={os.environ.get('DGEMMA_CACHE')})")
        return 0
    store = ArtifactStore.default()
    if store is None:
        raise ConfigError("cache", f"{cache_root()} is not a usable directory (DGEMMA_CACHE_DIR, XDG_CACHE_HOME)")
    if args.action == "clear":
        failed = store.clear()
        if failed:
            raise ConfigError("cache", f"could not remove {len(failed)} path(s) under {store.root}: {failed[0]}")
        print(f"compile cache: cleared {store.root}")
        return 0
    entries = store.entries()
    cpp = sum(f.stat().st_size for f in store.cpp.root.rglob("*.bin")) if store.cpp.root.is_dir() else 0
    print(f"compile cache: {store.root} ({len(entries)} steps, "
          f"{sum(e['bytes'] for e in entries) / 2**20:.1f} MiB; C++ builds {cpp / 2**20:.1f} MiB)")
    now = time.time()
    for e in sorted(entries, key=lambda e: e["created"]):
        parts = e["parts"]
        print(f"  {parts['unit']:<28} {e['bytes'] / 2**20:6.1f} MiB  {(now - e['created']) / 3600:7.1f} h old  "
              f"threads={parts['threads']} torch={parts['torch'].split()[0]} key={e['key'][:12]}")
    return 0


def _tensor_parallel(args: argparse.Namespace, argv: list[str], world: int) -> int:
    """Run generate / serve as one rank of `world` (`parallel.ranks.run`: started here, or joined under torchrun).
    A collective that fails (a peer died, or stalled past --group-timeout) ends every rank with one error line."""
    from .parallel import ranks as R

    if not args.group_timeout > 0:
        from .config import ConfigError

        raise ConfigError("group_timeout", f"must be a positive number of seconds, got {args.group_timeout}")
    command = generate_command if args.command == "generate" else serve_command

    def body(ranks: "R.Ranks") -> int:
        R.quiet(ranks.rank)
        try:
            return command(args, ranks)
        except RuntimeError as e:  # gloo / nccl: a peer's connection closed, or the group's timeout passed
            if isinstance(e, R.ParallelError):  # ours (its message says which rank and why)
                message = str(e)
            else:
                message = (f"tensor parallel: rank {ranks.rank} of {ranks.world_size}: a collective failed, a rank died "
                           f"or stalled past --group-timeout ({args.group_timeout:.0f} s): "
                           f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
            if not ranks.leader:
                print(R.error_line(ranks.rank, message), file=sys.stderr, flush=True)
                return 1
            raise R.ParallelError(message) from None

    return R.run(body, argv, world, args.group_timeout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)  # --help and usage errors exit here, before anything imports torch
    from .config import ConfigError
    from .kv_cache import CacheFullError
    from .loader import CheckpointError
    from .parallel.ranks import ParallelError

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    # AOTAutograd's cache skips graphs holding torchao tensors (Float8Tensor has no stable hash): a known cost of
    # quantized compiles (README), not a user-facing problem
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
    logging.basicConfig(level=logging.INFO, format="dgemma: %(message)s")
    logging.getLogger("dgemma_compile").setLevel(logging.INFO)
    try:
        if args.command in ("generate", "serve"):
            from .parallel import ranks

            world = ranks.world_size_for(args.tensor_parallel_size)
            if world > 1:
                return _tensor_parallel(args, argv, world)
        if args.command == "generate":
            return generate_command(args)
        if args.command == "explain":
            return explain_command(args)
        if args.command == "serve":
            return serve_command(args)
        if args.command == "cache":
            return cache_command(args)
    except (CheckpointError, ConfigError, CacheFullError) as e:
        print(f"dgemma: error: {e}", file=sys.stderr)
        return 2
    except ParallelError as e:
        print(f"dgemma: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dgemma: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
