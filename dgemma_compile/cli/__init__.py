"""`dgemma generate | explain | serve | cache`: block-diffusion generation, compile reports, the OpenAI-compatible
server (`runtime/`) and the compile cache from the command line.

`dgemma generate PROMPT` prints each block's text on stdout as soon as the block is committed (through
`text.Detokenizer`: never a broken character, never a repeat), then one stats line on stderr.
`dgemma generate --prompts-file FILE|-` runs many prompts in batches and writes one JSON line per prompt on stdout,
in input order. Every expected failure (missing directory or file, bad checkpoint, bad parameter, bad prompt, a flag
argparse refuses) is one `dgemma: error:` line on stderr and exit status 2.

Timing: tok/s and ttfb_s (request start to the first committed block) cover the generation only. One-time costs
come first and are reported apart: `compile_s` (compiled path: every compile unit of the bucket), or `warmup_s`
(`--eager`: an untimed run of the same request with one denoise step per block, so that the shape-specialised
traces eager FlexAttention makes on first use of each shape are done before the clock starts).

The package, one module per command (`generate.py`, `explain.py`, `serve.py`, `cache.py`) over the parser and each
command's frozen, validated arguments record (`args.py`: `GenerateArgs`, `ServeArgs`, ...),
the prompts file (`prompts.py`) and what generate and serve share (`run.py`); `main` here dispatches, and runs
generate / serve as ranks of a tensor-parallel group (`ranks.py`). `dgemma --help` imports no torch
(tests/cli/test_imports.py): torch and every module that imports it are imported inside the commands.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from .args import (COMMANDS, COMPILE_MODES, DEFAULT_BATCH_SIZE, DEFAULT_GROUP_TIMEOUT_S, DTYPES, FLOAT32_MAX,
                   QUANT_SCHEMES, CacheArgs, ExplainArgs, GenerateArgs, ServeArgs, _parser)
from .cache import cache_command
from .explain import MOE_RULE, explain_command
from .generate import generate_command
from .prompts import LINE_KEYS, PromptLine, parse_prompt_line, read_prompts_file
from .run import SLOT_ROUNDING
from .serve import serve_command

__all__ = ["COMMANDS", "COMPILE_MODES", "CacheArgs", "DEFAULT_BATCH_SIZE", "DEFAULT_GROUP_TIMEOUT_S", "DTYPES",
           "ExplainArgs", "FLOAT32_MAX", "GenerateArgs", "LINE_KEYS", "MOE_RULE", "PromptLine", "QUANT_SCHEMES",
           "SLOT_ROUNDING", "ServeArgs", "cache_command", "explain_command", "generate_command", "main",
           "parse_prompt_line", "read_prompts_file", "serve_command"]


def _tensor_parallel(command_name: str, args: GenerateArgs | ServeArgs, argv: list[str], world: int) -> int:
    """Run generate / serve as one rank of `world` (`cli.ranks.run`: started here, or joined under torchrun).
    A collective that fails (a peer died, or stalled past --group-timeout) ends every rank with one error line."""
    from . import ranks as R

    command = generate_command if command_name == "generate" else serve_command

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


def main(argv: list[str] | None = None, *, owns_process: bool | None = None) -> int:
    """The `dgemma` command on `argv` (default: this program's arguments); returns the exit status.

    `owns_process` (default: True when `argv` is None, i.e. run as the program, as `dgemma` and `python -m
    dgemma_compile.cli` do): generate and serve then keep the host memory a step frees for the next step
    (`host_memory.retain_freed_memory`, a process-wide allocator setting that a caller running `main` inside its own
    program, tests included, does not get unasked)."""
    owns_process = argv is None if owns_process is None else owns_process
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # --help and usage errors (a flag's value refused by its type too) end here, before anything imports torch
        ns = _parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the help or the error line; the status is returned, as every other
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if owns_process and ns.command in ("generate", "serve"):
        from .host_memory import retain_freed_memory

        retain_freed_memory()
    from ..model.config import ConfigError
    from ..model.kv_cache import CacheFullError
    from ..model.loader import CheckpointError
    from .ranks import ParallelError

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    # AOTAutograd's cache skips graphs holding torchao tensors (Float8Tensor has no stable hash): a known cost of
    # quantized compiles (README), not a user-facing problem
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching")
    logging.basicConfig(level=logging.INFO, format="dgemma: %(message)s")
    logging.getLogger("dgemma_compile").setLevel(logging.INFO)
    try:
        args = COMMANDS[ns.command].from_namespace(ns)  # the rules between flags, checked once (ConfigError)
        if ns.command in ("generate", "serve"):
            from . import ranks

            world = ranks.world_size_for(args.tensor_parallel_size)
            if world > 1:
                return _tensor_parallel(ns.command, args, argv, world)
        if ns.command == "generate":
            return generate_command(args)
        if ns.command == "explain":
            return explain_command(args)
        if ns.command == "serve":
            return serve_command(args)
        if ns.command == "cache":
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
    except BrokenPipeError:  # stdout's reader went away (`dgemma cache info | head -1`): stop quietly, as `yes | head`
        devnull = os.open(os.devnull, os.O_WRONLY)  # so that the interpreter's last flush of stdout cannot fail again
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a writer killed by its closed pipe
    return 1
