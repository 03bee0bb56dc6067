"""`dgemma generate` end to end on a checkpoint directory written by transformers' save_pretrained."""

import re
import subprocess
import sys

import pytest

import dgemma_compile as dg


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dgemma_compile.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_generate_prints_text_and_stats(tiny_dir):
    res = run_cli("generate", "--model", str(tiny_dir), "--max-new-tokens", "12", "--max-denoising-steps", "3",
                  "--seed", "5", "--eager", "abc 12=")
    assert res.returncode == 0, res.stderr
    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    cfg = model.generation_config.replace(max_new_tokens=12, max_denoising_steps=3)
    expected = dg.generate(model, [tok("abc 12=")["input_ids"]], cfg, seed=5)
    assert res.stdout == tok.decode(expected.sequences[0], skip_special_tokens=True) + "\n"
    stats = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"tokens=\d+ blocks=\d+ mean_steps_per_block=[\d.]+ tokens_per_forward=[\d.]+ "
                        r"tok/s=[\d.]+ finish=(eos|length)", stats), stats
    assert f"tokens={expected.stats[0].num_tokens} blocks={expected.stats[0].blocks}" in stats


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/dir"], "/nonexistent/dir: not a directory"),
    (["--max-new-tokens", "0"], "max_new_tokens: must be a positive integer"),
    (["--max-denoising-steps", "-3"], "max_denoising_steps: must be a positive integer"),
    (["--seed", "-1"], "seed"),
    (["--seed", str(2**70)], "seed"),
])
def test_errors_are_one_line_without_traceback(tiny_dir, args, message):
    full = ["generate", *args, "--eager", "abc"]
    if "--model" not in args:
        full[1:1] = ["--model", str(tiny_dir)]
    res = run_cli(*full)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("dgemma: error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    res = run_cli("generate", "--model", str(tmp_path), "--eager", "abc")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "not a DiffusionGemma checkpoint" in res.stderr


def test_chat_prompt_goes_through_the_chat_template(tiny_dir):
    res = run_cli("generate", "--model", str(tiny_dir), "--chat", "--max-new-tokens", "8", "--max-denoising-steps", "2",
                  "--eager", "hi 3")
    assert res.returncode == 0, res.stderr
    model, tok = dg.load(tiny_dir), dg.load_tokenizer(tiny_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi 3"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids != tok("hi 3")["input_ids"]  # the template really changed the prompt (no bos here)
    cfg = model.generation_config.replace(max_new_tokens=8, max_denoising_steps=2)
    expected = dg.generate(model, [ids], cfg, seed=0)
    assert res.stdout == tok.decode(expected.sequences[0], skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("prompt,message", [("", "prompt: empty prompt"), ("abc ✓ é", "cannot encode: 'é✓'")])
def test_prompts_the_tokenizer_cannot_take_are_rejected_before_compiling(tiny_dir, prompt, message):
    res = run_cli("generate", "--model", str(tiny_dir), prompt)  # compiled path: must fail before any compile
    assert res.returncode == 2 and "Traceback" not in res.stderr and "compiling" not in res.stderr
    assert message in res.stderr, res.stderr
