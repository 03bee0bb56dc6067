"""`dgemma generate | explain`: block-diffusion generation and compile reports from the command line.

Prints each block's text on stdout as soon as the block is committed, then one stats line on stderr. Every
expected failure (missing directory, bad checkpoint, bad parameter) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

DEMO_MODEL = Path(__file__).parent / "demo" / "model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgemma", description="DiffusionGemma block-diffusion generation.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (config.json, safetensors, tokenizer); default: the built-in demo model")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=None, help="exact token budget (default: generation config)")
    g.add_argument("--max-denoising-steps", type=int, default=None, help="denoise steps per block at most")
    g.add_argument("--seed", type=int, default=0, help="seed of the request's random stream")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: the checkpoint's)")
    g.add_argument("--eager", action="store_true", help="run the eager reference generator instead of the compiled one")
    e = sub.add_parser("explain", help="Dynamo explain report of the compiled denoise step and encoder chunk")
    e.add_argument("--model", type=Path, default=None, help="checkpoint directory; default: the built-in demo model")
    e.add_argument("--batch-size", type=int, default=1, help="report the bucket serving this many requests")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def _prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of the prompt. Raises ConfigError for an empty prompt or characters the tokenizer cannot encode."""
    from .config import ConfigError

    if not prompt:
        raise ConfigError("prompt: empty prompt")
    unknown = sorted({ch for ch in prompt if tokenizer.unk_token_id is not None
                      and tokenizer.unk_token_id in tokenizer(ch, add_special_tokens=False)["input_ids"]})
    if unknown:
        raise ConfigError(f"prompt: characters the model's tokenizer cannot encode: {''.join(unknown)!r}")
    if chat:
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
    else:
        ids = tokenizer(prompt)["input_ids"]
    return [int(t) for t in ids]


def generate_command(args: argparse.Namespace) -> int:
    from . import generate, load, load_tokenizer
    from .generate import plan

    model_dir = args.model if args.model is not None else DEMO_MODEL
    model = load(model_dir, dtype=DTYPES[args.dtype] if args.dtype else None)
    tokenizer = load_tokenizer(model_dir)
    changes = {}
    if args.max_new_tokens is not None:
        changes["max_new_tokens"] = args.max_new_tokens
    if args.max_denoising_steps is not None:
        changes["max_denoising_steps"] = args.max_denoising_steps
    config = model.generation_config.replace(**changes)
    ids = _prompt_ids(tokenizer, args.prompt, args.chat)

    shown = ""
    generated: list[int] = []

    def on_block(_: int, new_tokens: list[list[int]]) -> None:
        nonlocal shown
        generated.extend(new_tokens[0])
        text = tokenizer.decode(generated, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
        sys.stdout.flush()
        shown = text

    plan(model, [ids], config, args.seed)  # validate prompt, config and seed before any compile
    compile_note = ""
    if args.eager:
        run = lambda: generate(model, [ids], config, seed=args.seed, on_block=on_block)  # noqa: E731
    else:
        from .compile import CompileOptions, build

        # one request: one bucket, and a static cache that fits this prompt and budget (rounded up to share graphs)
        slots = -(-(len(ids) + config.max_new_tokens) // 256) * 256
        gen = build(model, CompileOptions(batch_buckets=(1,), max_seq_len=slots))
        print("dgemma: compiling the denoise step and encoder chunk (a minute or so on a CPU, cached afterwards)...",
              file=sys.stderr, flush=True)
        compile_note = f" compile_s={gen.warmup(1, config):.1f}"
        run = lambda: gen.generate([ids], config, seed=args.seed, on_block=on_block)  # noqa: E731
    start = time.perf_counter()
    out = run()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    st = out.stats[0]
    mean_steps = st.decoder_passes / max(st.blocks, 1)
    print(f"tokens={st.num_tokens} blocks={st.blocks} mean_steps_per_block={mean_steps:.2f} "
          f"tokens_per_forward={st.tokens_per_forward:.2f} tok/s={st.num_tokens / elapsed:.1f} "
          f"finish={st.finish_reason}{compile_note}", file=sys.stderr)
    return 0


def explain_command(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from . import load
    from .compile import build

    model = load(args.model if args.model is not None else DEMO_MODEL)
    reports = build(model).explain(args.batch_size)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
    else:
        print("\n".join(r.text() for r in reports))
    return 0


def main(argv: list[str] | None = None) -> int:
    from .config import ConfigError
    from .kv_cache import CacheFullError
    from .loader import CheckpointError

    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    logging.basicConfig(level=logging.INFO, format="dgemma: %(message)s")
    logging.getLogger("dgemma_compile").setLevel(logging.INFO)
    try:
        if args.command == "generate":
            return generate_command(args)
        if args.command == "explain":
            return explain_command(args)
    except (CheckpointError, ConfigError, CacheFullError) as e:
        print(f"dgemma: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dgemma: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
