"""`dgemma serve`: the OpenAI-compatible server (`runtime/`) over the loaded model."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..demo import DEMO_MODEL
from .args import ServeArgs
from .run import _apply_threads, _background, _load


def _api_key(args: ServeArgs) -> str | None:
    """`dgemma serve`'s API key: --api-key, else the environment variable DGEMMA_API_KEY, else None (no key).
    Raises ConfigError for an empty or blank key (never showing it)."""
    from ..model.config import ConfigError

    key = args.api_key if args.api_key is not None else os.environ.get("DGEMMA_API_KEY")
    if key is not None and not key.strip():
        raise ConfigError("api_key", "--api-key / DGEMMA_API_KEY is empty; give a key or leave both unset")
    return key


def serve_command(args: ServeArgs, ranks=None) -> int:
    """`dgemma serve`: load the model, build the engine (its steps as --compile says: docs/cli.md), then serve
    until interrupted.
    `ranks` (`cli.ranks.Ranks`): one rank of a tensor-parallel run; rank 0 serves HTTP, the others follow its
    schedule (`runtime/parallel.py`) until it stops."""
    from ..model.config import ConfigError

    try:
        import uvicorn

        from dgemma_runtime.http.grammars import GrammarLimits
        from dgemma_runtime.http.metrics import ServeMetrics
        from dgemma_runtime.http.server import create_app
    except ImportError as e:
        raise ConfigError("serve", f"needs the [serve] extra (pip install 'dgemma-compile[serve]'): {e}") from None
    from .. import load_tokenizer
    from dgemma_runtime import build_engine
    from dgemma_runtime.parallel import ParallelSchedule

    from ..inputs.preprocess import ImageSources

    domains = (None if args.allowed_media_domains is None else
               frozenset(d.lower().rstrip(".") for d in args.allowed_media_domains))
    sources = ImageSources(directory=args.image_dir, fetch=args.allow_image_urls, max_bytes=args.max_image_bytes,
                           timeout_s=min(10.0, args.input_timeout / 2),  # inside the request's input timeout
                           allow_private=args.allow_private_image_urls, allowed_domains=domains,
                           max_pixels=args.max_image_pixels)
    api_key = _api_key(args)
    model_dir = args.model if args.model is not None else DEMO_MODEL
    model = _load(model_dir, ranks, experts_split=args.experts_split)
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
    from dgemma_runtime.http.transport import bounded_protocol

    server.append(uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                http=bounded_protocol(args.header_timeout))))
    if fatal:  # lost a rank before the server started
        server[0].should_exit = True
    try:
        server[0].run()
    finally:
        engine.shutdown()
    if fatal:
        from .ranks import ParallelError

        raise ParallelError(fatal[0])
    return 0


def _serve_background(args: ServeArgs, engine) -> None:
    """`dgemma serve --compile auto`: load every batch size the compile cache holds now; compile the others in a
    background process while the eager step serves them (the engine switches between iterations, logged)."""
    gen, row_table = engine.generator, engine.row_table
    start = time.perf_counter()
    first = row_table.view(row_table.sizes[0])
    if not first.step.cacheable:  # a background compile could not hand its steps over: the eager step serves
        print("dgemma: the compile cache cannot hold this model's steps (DGEMMA_CACHE off, an unusable directory, or "
              "quantized weights): serving with the eager step; --compile always compiles batch 1 before serving",
              file=sys.stderr, flush=True)
        return
    loaded = gen.load_cached(row_table)
    missing = [b for b in row_table.sizes if b not in loaded]
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
