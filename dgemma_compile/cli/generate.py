"""`dgemma generate`: one prompt (blocks on stdout as they commit) or a prompts file (one JSON line per prompt)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from ..demo import DEMO_MODEL
from .args import DEFAULT_BATCH_SIZE, GenerateArgs
from .prompts import PromptLine, _encode, _read_inputs
from .run import Loaded, _apply_threads, _load, _quantize, _runner, _shared


def generate_command(args: GenerateArgs, ranks=None) -> int:
    """`dgemma generate`; `ranks` (`cli.ranks.Ranks`): one rank of a tensor-parallel run, whose inputs (the
    prompts file or stdin, the images) are rank 0's."""
    from .. import load_tokenizer

    lines, pil_images = _shared(ranks, lambda: _read_inputs(args))  # before any loading
    constraint = _constraint(args)

    model_dir = args.model if args.model is not None else DEMO_MODEL
    start = time.perf_counter()
    model = _load(model_dir, ranks, dtype=args.dtype, quant=args.quant, experts_split=args.experts_split)
    quant = _quantize(model, args.quant if ranks is None else None)  # ranks: quantized before sharding (_load)
    loaded = Loaded(model, quant, time.perf_counter() - start, tensor_parallel=ranks is not None)
    tokenizer = load_tokenizer(model_dir)
    if constraint is not None:  # compiled against this tokenizer now: a bad one fails before any model work
        from ..inputs.constraint import row_grammars

        row_grammars(model, [constraint], [model.generation_config.resolved(model.config)], tokenizer)
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
        return _generate_batch(args, loaded, tokenizer, config, lines, constraint)
    if args.temperature is not None:
        config = config.with_temperature(args.temperature)
    return _generate_one(args, loaded, tokenizer, config, constraint, pil_images)


def _generate_one(args: GenerateArgs, loaded: Loaded, tokenizer, config, constraint, pil_images) -> int:
    from ..step.requests import plan_requests
    from ..inputs.text import StopStrings

    model = loaded.model
    matcher = StopStrings(tokenizer, args.stop or ())  # validates --stop before any compile
    images = None
    if args.image:
        from ..inputs.images import prepare
        from ..inputs.preprocess import preprocess

        images = [preprocess(model, pil_images, max_soft_tokens=args.max_soft_tokens)]
    ids = _encode(tokenizer, model, args.prompt, args, images[0] if images else None)
    slots = plan_requests(model, [ids], config, args.seed)[3]  # validate prompt, config and seed before any compile
    if images:
        prepare(model, [ids], images)  # the images against their placeholders, before any compile
    if constraint is not None:  # its commits are the kept prefixes, not whole canvases
        slots = max(slots, len(ids) + config.max_new_tokens - 1)
    canvas = {}
    if args.template is not None:  # validated before any compile
        from ..step.canvas import canvas_of

        canvas = {"canvas": [canvas_of(args.template, config, model.config.vocab_size, tokenizer, name="template")]}
    threads = _apply_threads(args, model)
    run, costs = _runner(loaded, args, 1, slots, config, ([ids], args.seed), config.max_denoising_steps, images)

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
                  constraint=constraint, tokenizer=tokenizer, **({"images": images} if images else {}),
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
          f"moe={out.moe_impl} commit={'fused' if out.fuse_commit else 'separate'} quant={loaded.quant or 'none'}",
          file=sys.stderr)
    return 0


def _generate_batch(args: GenerateArgs, loaded: Loaded, tokenizer, config, lines: list[PromptLine],
                    constraint) -> int:
    """--prompts-file: validate every line first (a bad one is reported in its place), group the good ones by
    config, run each group in batches of --batch-size, write one JSON line per prompt in input order."""
    from tqdm import tqdm

    from ..model.config import ConfigError
    from ..step.requests import STRUCTURAL, plan_requests
    from ..inputs.text import StopStrings, check_stop_strings

    model = loaded.model
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
            if constraint is not None:
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
        run, costs = _runner(loaded, args, rows, slots, first[0].config,
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
                          on_block=on_block, stop=stop, constraint=constraint, tokenizer=tokenizer)
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


def _constraint(args: GenerateArgs):
    """The `Constraint` of --regex / --choice / --json-schema FILE / --json-object, or None. Raises ConfigError
    (naming the flag) for an unreadable schema file or a malformed constraint."""
    from ..model.config import ConfigError
    from ..inputs.constraint import Constraint

    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.choice is not None:
        return Constraint.choice(list(args.choice))
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


def _live_view(args: GenerateArgs, tokenizer, config):
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
