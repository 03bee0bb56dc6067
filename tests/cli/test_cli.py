"""`dgemma generate` end to end on checkpoint directories written by transformers' save_pretrained.

References are computed in-process with the library (`dg.generate`, the tokenizer's own encode/decode and chat
template); the CLI runs in a subprocess (`run_cli`: the eager and the compiled paths end to end, streamed bytes,
stdin, --threads, --quant, explain) or in this process (`run_main`: error paths, and what lies wholly inside
`cli.main`, where a new interpreter would add only its start-up: flags, a prompts file, the compiled batch path).
"""

import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

import dgemma_compile as dg

pytestmark = pytest.mark.slow  # CLI runs, most in a subprocess (torch + transformers imports: ~2-9 s)
from dgemma_compile.inputs.text import REPLACEMENT
from helpers import write_checkpoint
from test_text import TEMPLATE_NO_BOS, write_byte_bpe

STATS = (r"tokens=\d+ blocks=\d+ mean_steps_per_block=[\d.]+ tokens_per_forward=[\d.]+ tok/s=[\d.]+ "
         r"finish=(eos|length|stop) {one_time} ttfb_s=[\d.]+ threads={threads} scheme=\S+ moe=\w+ "
         r"commit=(fused|separate) quant=[\w-]+")


ORACLE = r"model_load_s=[\d.]+ warmup_s=[\d.]+ step=oracle dtype=float32"  # --eager: the reference generator after its untimed warm-up
COMPILED = r"model_load_s=[\d.]+ compile_s=[\d.]+ step_load_s=[\d.]+ step=[a-z+]+( compile=\w+ in background)? dtype=float32"  # docs/cli.md


def run_cli(*args, timeout=300, stdin=None, env=None, text=True):
    """The CLI in a subprocess; `text=False` keeps stdout's bytes (no newline translation)."""
    base = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"} if env is None else env
    return subprocess.run([sys.executable, "-m", "dgemma_compile.cli", *args], capture_output=True, text=text,
                          timeout=timeout, env=base, input=stdin)


def run_main(*args, stdin=None):
    """`dgemma_compile.cli.main` in this process, for error paths and flags handled inside `main` (no interpreter
    start-up: ~4 s each); the result has run_cli's shape. The real-process path is covered by the run_cli tests."""
    import contextlib
    import io

    from dgemma_compile import cli

    out, err, old_stdin = io.StringIO(), io.StringIO(), sys.stdin
    if stdin is not None:
        sys.stdin = SimpleNamespace(buffer=io.BytesIO(stdin.encode()))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(args))  # argparse's refusals and --help too: main returns their status
    finally:
        sys.stdin = old_stdin
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def error_lines(res):
    assert "Traceback" not in res.stderr, res.stderr
    return [line for line in res.stderr.splitlines() if line.startswith("dgemma: error:")]


def chat_ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_generate_prints_text_and_stats(tiny_dir):
    res = run_cli("generate", "--model", str(tiny_dir), "--max-new-tokens", "12", "--max-denoising-steps", "3",
                  "--seed", "5", "--eager", "abc 12=")
    assert res.returncode == 0, res.stderr
    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    cfg = model.generation_config.replace(max_new_tokens=12, max_denoising_steps=3)
    expected = dg.generate(model, [tok("abc 12=")["input_ids"]], cfg, seed=5)
    assert res.stdout == decode(tok, expected.sequences[0]) + "\n"
    stats = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(STATS.format(one_time=ORACLE, threads=1), stats), stats
    assert f"tokens={expected.stats[0].num_tokens} blocks={expected.stats[0].blocks}" in stats


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/dir"], "/nonexistent/dir: not a directory"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive integer, got 0"),
    (["--max-denoising-steps", "-3"], "argument --max-denoising-steps: must be a positive integer, got -3"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**64), got -1"),
    (["--seed", str(2**70)], "argument --seed: must be an integer in [0, 2**64)"),
    (["--threads", "0"], "argument --threads: must be a positive integer, got 0"),
    (["--batch-size", "2"], "batch_size: --batch-size applies to --prompts-file only"),
])
def test_errors_are_one_line_without_traceback(tiny_dir, args, message):
    full = ["generate", *args, "--eager", "abc"]
    if "--model" not in args:
        full[1:1] = ["--model", str(tiny_dir)]
    res = run_main(*full)
    assert res.returncode == 2
    errors = error_lines(res)
    assert len(errors) == 1 and message in errors[0], res.stderr


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    res = run_main("generate", "--model", str(tmp_path), "--eager", "abc")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "not a DiffusionGemma checkpoint" in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "sys 1 "])
def test_chat_prompt_goes_through_the_chat_template_with_one_bos(tiny_dir, system):
    args = ["--system", system] if system is not None else ["--chat"]
    res = run_main("generate", "--model", str(tiny_dir), *args, "--max-new-tokens", "8", "--max-denoising-steps", "2",
                   "--eager", "hi 3")
    assert res.returncode == 0, res.stderr
    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi 3"}]
    templated = chat_ids(tok, messages)
    bos = model.config.bos_token_id
    assert templated[0] != bos  # this template renders no bos: the CLI must add it
    cfg = model.generation_config.replace(max_new_tokens=8, max_denoising_steps=2)
    expected = dg.generate(model, [[bos] + templated], cfg, seed=0)
    assert res.stdout == decode(tok, expected.sequences[0]) + "\n"


def test_chat_without_a_template_is_one_error_line(tiny_dir, tmp_path):
    d = tmp_path / "no-template"
    shutil.copytree(tiny_dir, d)
    (d / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    res = run_main("generate", "--model", str(d), "--chat", "hi")  # compiled path: fails before compiling
    assert res.returncode == 2 and "compiling" not in res.stderr
    errors = error_lines(res)
    assert len(errors) == 1 and errors[0].startswith(f"dgemma: error: chat template: {d} has none"), res.stderr


@pytest.mark.parametrize("args,message", [
    (["",], "prompt: empty prompt"),
    (["abc ✓ é"], "prompt: characters the model's tokenizer cannot encode: 'é✓'"),
    (["--system", "é", "abc"], "system: characters the model's tokenizer cannot encode: 'é'"),
])
def test_prompts_the_tokenizer_cannot_take_are_rejected_before_compiling(tiny_dir, args, message):
    res = run_main("generate", "--model", str(tiny_dir), *args)  # compiled path: must fail before any compile
    assert res.returncode == 2 and "compiling" not in res.stderr
    errors = error_lines(res)
    assert len(errors) == 1 and message in errors[0], res.stderr


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    """A tiny random model over a byte-level BPE (random output: bytes of characters split across blocks)."""
    d = write_checkpoint(tmp_path_factory.mktemp("bpe-ckpt"), vocab_size=300, canvas_length=4,
                         layer_types=("sliding_attention", "full_attention"))
    return write_byte_bpe(d, bos_post_processor=False, template=TEMPLATE_NO_BOS)


@pytest.mark.slow
def test_streaming_holds_back_a_character_split_by_a_block(bpe_ckpt):
    model, tok = dg.load(bpe_ckpt), dg.load_tokenizer(bpe_ckpt)
    cfg = model.generation_config.replace(max_new_tokens=24, max_denoising_steps=2)
    prompt = [model.config.bos_token_id] + tok("sort é", add_special_tokens=False)["input_ids"]
    for seed in range(50):  # a seed whose output has a block boundary inside a character
        so_far, split = [], False

        def on_block(_, new, so_far=so_far):
            nonlocal split
            so_far += new[0]
            split |= decode(tok, so_far).endswith(REPLACEMENT)

        out = dg.generate(model, [prompt], cfg, seed=seed, on_block=on_block)
        if split and out.stats[0].blocks > 1:
            break
    else:
        pytest.fail("no seed splits a character across blocks")
    res = run_cli("generate", "--model", str(bpe_ckpt), "--max-new-tokens", "24", "--max-denoising-steps", "2",
                  "--seed", str(seed), "--eager", "sort é", text=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode() == decode(tok, out.sequences[0]) + "\n"  # each character once, nothing repeated


@pytest.mark.slow
def test_threads_flag_reaches_the_stats_line(tiny_dir):
    res = run_cli("generate", "--model", str(tiny_dir), "--max-new-tokens", "4", "--max-denoising-steps", "1",
                  "--eager", "--threads", "2", "abc")
    assert res.returncode == 0 and " threads=2 " in res.stderr.splitlines()[-1], res.stderr


def test_threads_precedence_flag_then_environment_then_recommendation(tiny_dir, monkeypatch):
    import torch

    from dgemma_compile.cli import threads
    from dgemma_compile.cli.run import _apply_threads

    model = dg.load(tiny_dir)
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert _apply_threads(SimpleNamespace(threads=2), model) == 2 == torch.get_num_threads()
        assert _apply_threads(SimpleNamespace(threads=None), model) == 2  # OMP_NUM_THREADS set: torch's count stays
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(threads, "recommended_threads", lambda m: 3 if m is model else 0)
        assert _apply_threads(SimpleNamespace(threads=None), model) == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


# ----- --prompts-file ----------------------------------------------------------------------------------------------
PROMPT_LINES = [
    "abc 12=",                                                   # 1 plain
    '{"prompt": "hi 3", "seed": 7, "max_new_tokens": 5}',        # 2
    '{"prompt": "abc", ',                                        # 3 bad JSON
    "",                                                          # 4 blank: skipped
    '{"prompt": "x", "temperature": -0.5}',                      # 5 bad temperature
    '{"prompt": ""}',                                            # 6 empty prompt
    '{"prompt": "a b", "max_new_tokens": 0}',                    # 7 bad config value
    "ab ✓",                                                      # 8 unencodable
    '{"prompt": "cab", "entropy_bound": 0.3, "temperature": 0}',  # 9 greedy
    '{"prompt": "zz", "foo": 1}',                                # 10 unknown key
    "hi 3",                                                      # 11
    '{"prompt": "b", "seed": -4}',                               # 12 bad seed
]
LINE_ERRORS = {3: "not a valid JSON object", 5: "temperature: must be a finite number >= 0", 6: "prompt: empty prompt",
               7: "max_new_tokens: must be a positive integer", 8: "prompt: characters the model's tokenizer cannot",
               10: "foo: unknown key", 12: "seed"}


def expected_line(model, tok, line: str, *, seed=5, max_new_tokens=12, steps=3, moe_impl="auto") -> dict:
    """What one prompt of the file must give: the eager generator on that prompt alone (with the compiled
    generator's `moe_impl` when compared with a compiled run)."""
    obj = json.loads(line) if line.startswith("{") else {"prompt": line}
    cfg = model.generation_config.replace(max_new_tokens=obj.get("max_new_tokens", max_new_tokens),
                                          max_denoising_steps=steps)
    if "entropy_bound" in obj:
        cfg = cfg.replace(entropy_bound=obj["entropy_bound"])
    if "temperature" in obj:
        cfg = cfg.with_temperature(obj["temperature"])
    out = dg.generate(model, [tok(obj["prompt"])["input_ids"]], cfg, seed=obj.get("seed", seed), moe_impl=moe_impl)
    st = out.stats[0]
    return {"text": decode(tok, out.sequences[0]), "num_tokens": st.num_tokens, "finish_reason": st.finish_reason,
            "steps_per_block": st.steps_per_block}


def check_results(stdout: str, lines: list[str], model, tok, errors: dict[int, str] | None = None,
                  moe_impl: str = "auto") -> None:
    results = [json.loads(r) for r in stdout.splitlines()]
    numbers = [i for i, line in enumerate(lines, 1) if line.strip()]
    assert [r["line"] for r in results] == numbers  # one result per prompt line, in input order
    for r in results:
        if r["line"] in (errors or {}):
            assert set(r) == {"line", "error"} and errors[r["line"]] in r["error"], r
        else:
            assert r == {"line": r["line"], **expected_line(model, tok, lines[r["line"] - 1], moe_impl=moe_impl)}


@pytest.mark.slow
def test_prompts_file_results_in_order_with_bad_lines_in_place(tiny_dir, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(PROMPT_LINES) + "\n")
    res = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(f), "--batch-size", "2", "--eager",
                   "--max-new-tokens", "12", "--max-denoising-steps", "3", "--seed", "5")
    assert res.returncode == 2, res.stderr
    check_results(res.stdout, PROMPT_LINES, dg.load(tiny_dir), dg.load_tokenizer(tiny_dir), LINE_ERRORS)
    errors = error_lines(res)
    assert [int(re.match(r"dgemma: error: --prompts-file line (\d+): ", e).group(1)) for e in errors] == \
        sorted(LINE_ERRORS)
    summary = res.stderr.strip().splitlines()[-1]
    assert summary.startswith(f"prompts={len(PROMPT_LINES) - 1} errors={len(LINE_ERRORS)} tokens="), summary
    assert re.search(r" batch_size=2 " + ORACLE + r" ttfb_s=[\d.]+ threads=1$", summary), summary


@pytest.mark.slow
def test_prompts_from_stdin(tiny_dir):
    lines = ["abc 12=", '{"prompt": "hi 3", "seed": 7}']
    res = run_cli("generate", "--model", str(tiny_dir), "--prompts-file", "-", "--eager", "--max-new-tokens", "12",
                  "--max-denoising-steps", "3", "--seed", "5", stdin="\r\n".join(lines))
    assert res.returncode == 0, res.stderr
    check_results(res.stdout, lines, dg.load(tiny_dir), dg.load_tokenizer(tiny_dir))


@pytest.mark.parametrize("args,message", [
    (["generate", "--quant", "bogus", "x"], "argument --quant: invalid choice: 'bogus' (choose from 'fp8', "
                                            "'fp8-weight-only', 'nvfp4-w4a16', 'nvfp4')"),
    (["generate", "--max-new-tokens", "two", "x"], "argument --max-new-tokens: invalid int value: 'two'"),
    (["bogus"], "argument command: invalid choice: 'bogus' (choose from 'generate', 'explain', 'serve', 'cache')"),
])
def test_flags_argparse_refuses_are_one_error_line(args, message):
    """A flag argparse refuses is one `dgemma: error:` line and status 2, as every other expected failure (no usage
    block on stderr); --help still prints the usage."""
    res = run_main(*args)
    assert res.returncode == 2 and res.stdout == "" and res.stderr == f"dgemma: error: {message}\n", res.stderr
    assert "usage: dgemma generate" in run_main("generate", "--help").stdout


@pytest.mark.parametrize("args,message", [
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file: /nonexistent/prompts.txt: no such file"),
    (["--prompts-file", "/"], "--prompts-file: /: is a directory"),
    (["--prompts-file", "-", "abc"], "prompt: give a prompt or --prompts-file, not both"),
    ([], "prompt: give a prompt, or --prompts-file FILE"),
    (["--prompts-file", "-", "--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
])
def test_prompts_file_errors_come_before_anything_runs(args, message):
    # a missing model directory too: the prompts are checked before anything is loaded
    res = run_main("generate", "--model", "/nonexistent/model", *args, stdin="")
    assert res.returncode == 2 and res.stdout == ""
    errors = error_lines(res)
    assert len(errors) == 1 and errors[0] == f"dgemma: error: {message}", res.stderr


@pytest.mark.parametrize("argv", [["generate", "x"], ["serve"], ["explain"], ["cache", "info"]])
def test_each_command_reads_a_frozen_record_of_every_flag(argv):
    """Issue 41: each command gets one frozen arguments record (`cli.args.COMMANDS`), made once from argparse's
    namespace: its fields are exactly the command's flags (parser and record cannot drift apart), the values are the
    parsed ones (repeatable flags as tuples), and nothing can change it afterwards."""
    import argparse
    import dataclasses

    from dgemma_compile.cli import COMMANDS, _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    flags = {a.dest for a in sub._actions if a.dest != "help"}
    record_type = COMMANDS[argv[0]]
    assert {f.name for f in dataclasses.fields(record_type)} == flags
    ns = parser.parse_args(argv + (["--stop", "a", "--stop", "b"] if argv[0] == "generate" else []))
    record = record_type.from_namespace(ns)
    assert {k: v for k, v in vars(ns).items() if k != "command" and not isinstance(v, list)} == \
        {k: v for k, v in dataclasses.asdict(record).items() if not isinstance(v, tuple)}
    if argv[0] == "generate":
        assert record.stop == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, next(iter(flags)), None)


def test_the_rules_between_flags_are_checked_when_the_record_is_made(tmp_path):
    from dgemma_compile.cli import GenerateArgs, ServeArgs
    from dgemma_compile.model.config import ConfigError

    with pytest.raises(ConfigError, match="live: --live draws one prompt"):
        GenerateArgs(prompts_file="-", live=True)
    with pytest.raises(ConfigError, match="max_soft_tokens: --max-soft-tokens applies to --image only"):
        GenerateArgs(prompt="x", max_soft_tokens=70)
    with pytest.raises(ConfigError, match="allow_image_urls: --allow-private-image-urls"):
        ServeArgs(allow_private_image_urls=True)
    with pytest.raises(ConfigError, match="image_dir: .* is not a directory"):
        ServeArgs(image_dir=tmp_path / "missing")
    assert GenerateArgs(prompt="x").seed == 0 and ServeArgs().port == 8000

def test_prompts_file_without_prompts(tiny_dir, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("\n  \n")
    res = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(f), "--eager")
    assert res.returncode == 2 and error_lines(res) == [f"dgemma: error: --prompts-file: {f}: no prompts"]


# ----- compiled path (the default) ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_batch_matches_eager(tiny_dir, tmp_path):
    """`--prompts-file` on the compiled path, in this process: two batches of 2 (the compiled path in a new interpreter,
    a single prompt and its stats line: `test_quick_start_command_prints_the_answer`)."""
    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    moe = dg.build(model).moe_impl  # what the CLI's compiled generator runs
    lines = ["abc 12=", '{"prompt": "hi 3", "seed": 7, "max_new_tokens": 5}', "cab", '{"prompt": "ab", "seed": 1}']
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(lines))
    res = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(f), "--batch-size", "2",
                   "--max-new-tokens", "12", "--max-denoising-steps", "3", "--seed", "5", "--compile", "always")
    assert res.returncode == 0, res.stderr
    check_results(res.stdout, lines, model, tok, moe_impl=moe)  # two batches of 2, mixed max_new_tokens
    assert re.search(r" batch_size=2 " + COMPILED + r" ttfb_s=[\d.]+ threads=1$", res.stderr.strip()), res.stderr
    assert re.search(r" step=(compiled|loaded) ", res.stderr), res.stderr


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0, got -1.0"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
    (["--entropy-bound", "0"], "argument --entropy-bound: must be a number in (0, 3.403e+38], got 0.0"),
    (["--entropy-bound", "1e39"], "argument --entropy-bound: must be a number in (0, 3.403e+38], got 1e+39"),
    (["--stop", ""], "stop: empty stop string"),
])
def test_sampling_flags_are_validated_in_one_line(tiny_dir, args, message):
    res = run_main("generate", "--model", str(tiny_dir), *args, "abc")  # compiled path: fails before compiling
    assert res.returncode == 2 and "compiling" not in res.stderr
    errors = error_lines(res)
    assert len(errors) == 1 and message in errors[0], res.stderr


@pytest.mark.slow
def test_stop_string_temperature_and_entropy_bound_flags(tiny_dir):
    """--temperature 0 (greedy, through with_temperature), --entropy-bound and --stop against the library run with
    the same config and the same stop hook."""
    from dgemma_compile.inputs.text import StopStrings

    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    cfg = model.generation_config.replace(max_new_tokens=24, max_denoising_steps=3, entropy_bound=0.7,
                                          eos_token_ids=()).with_temperature(0.0)
    free = dg.generate(model, [tok("ab 1=")["input_ids"]], cfg, seed=0)
    text = decode(tok, free.sequences[0])
    stop = text[9:11]  # in the second block (canvas 8)
    res = run_main("generate", "--model", str(tiny_dir), "--eager", "--max-new-tokens", "24", "--max-denoising-steps",
                   "3", "--entropy-bound", "0.7", "--temperature", "0", "--stop", stop, "ab 1=")
    assert res.returncode == 0, res.stderr
    m = StopStrings(tok, [stop])
    dg.generate(model, [tok("ab 1=")["input_ids"]], cfg, seed=0, on_block=lambda _, new: m.push(new[0]),
                stop=lambda *_: [0] if m.stopped else [])
    assert res.stdout == m.text + "\n" and stop not in res.stdout and res.stdout.strip()
    assert "finish=stop" in res.stderr


@pytest.mark.slow
def test_quick_start_command_prints_the_answer(demo):
    """The README's main job, compiled, on the built-in demo model; also the compiled single-prompt path against the
    eager library on the same prompt, config, seed and cache size, and its stats line."""
    from dgemma_compile.cli import SLOT_ROUNDING
    from dgemma_compile.inputs.text import encode_prompt

    prompt = "sort 3 1 2 9 5="
    res = run_cli("generate", prompt, timeout=900)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "1 2 3 5 9\n" and "finish=eos" in res.stderr
    model, tok = demo
    ids = encode_prompt(tok, prompt, bos_token_id=model.config.bos_token_id)
    expected = dg.generate(model, [ids], model.generation_config, seed=0, moe_impl=dg.build(model).moe_impl,
                           max_seq_len=SLOT_ROUNDING)  # the CLI's defaults: seed 0, one rounded cache of 256 slots
    assert res.stdout == decode(tok, expected.sequences[0]) + "\n"
    stats = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(STATS.format(one_time=COMPILED, threads=1), stats), res.stderr
    assert f"tokens={expected.stats[0].num_tokens} blocks={expected.stats[0].blocks}" in stats


@pytest.mark.slow
def test_explain_on_a_quantized_model_reports_no_graph_breaks(tiny_dir):
    """`dgemma explain --quant fp8` on the tiny checkpoint (vocabulary 48: the tied lm_head and the self-conditioning
    copy are quantized too, so every kind of quantized weight is in the graph): one graph, no breaks."""
    pytest.importorskip("torchao")
    res = run_cli("explain", "--json", "--quant", "fp8", "--model", str(tiny_dir), timeout=900)
    assert res.returncode == 0, res.stderr
    assert "excluded lm_head" not in res.stderr and "excluded sc_embedding" not in res.stderr
    reports = json.loads(res.stdout)
    assert [r["unit"] for r in reports] == ["step[B2_P1_stop]"]  # explain: a bucket of max(2, batch) rows
    assert all(r["graph_count"] == 1 and r["graph_break_count"] == 0 and r["recompiles_in_workload"] == 0
               for r in reports)


def test_quant_refusal_names_the_scheme_and_the_way_out():
    pytest.importorskip("torchao")
    res = run_main("generate", "--quant", "nvfp4", "--eager", "sort 3 1 2=")
    assert res.returncode != 0 and "'nvfp4'" in res.stderr and "nvfp4-w4a16" in res.stderr and res.stdout == ""


@pytest.mark.slow
def test_quant_flag_quantizes_on_load_and_names_the_scheme():
    """`--quant fp8-weight-only` on the demo model: the report of what was quantized and left out, the answer, and the
    scheme in the stats line; no torchao import noise on stderr."""
    pytest.importorskip("torchao")
    res = run_cli("generate", "--quant", "fp8-weight-only", "--dtype", "bfloat16", "--eager", "sort 3 1 2 9 5=")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "1 2 3 5 9\n"
    assert "quant fp8-weight-only (numerics v3): 37 projections quantized" in res.stderr  # 29 linears, 8 expert projections
    assert "excluded lm_head (the tied embeddings' logits)" in res.stderr and "quant=fp8-weight-only" in res.stderr
    assert "Failed to load" not in res.stderr and "Warning" not in res.stderr


@pytest.mark.slow
def test_a_closed_stdout_ends_the_command_quietly(tiny_dir):
    """A reader that stops early (`dgemma generate --prompts-file ... | head -1`): the command ends with the shell's
    status for a closed pipe (141) and no traceback on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_compile.cli", "generate", "--model", str(tiny_dir),
                             "--prompts-file", "-", "--eager", "--batch-size", "1", "--max-new-tokens", "4",
                             "--max-denoising-steps", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write("\n".join(f"abc {i}=" for i in range(8)))
    proc.stdin.close()
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert json.loads(first)["line"] == 1 and "Traceback" not in err and "BrokenPipe" not in err
