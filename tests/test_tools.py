"""tools/train_demo_model.py at a tiny size: resuming reproduces an uninterrupted run, and the export loads in
dgemma_compile with transformers' logits."""

import importlib.util
from pathlib import Path

import pytest
import torch

import dgemma_compile as dg
from helpers import hf_cache as hf_cache_kw

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def train():
    return _module("train_demo_model")


def _args(run_dir, *extra):
    return ["--run-dir", str(run_dir), "--size", "small", "--n-train", "400", "--batch-size", "4",
            "--eval-minutes", "0", "--warmup", "2", "--total-steps", "6", *extra]


def test_validation_split_is_the_held_out_stream_after_the_test_prompts(train):
    from dgemma_compile.demo import tasks

    assert train.validation_split(6, 0, 400) == tasks.make_split("heldout", 506, 0, train_n=400)[500:]


def test_periodic_eval_scores_validation_prompts_and_keeps_the_best(train, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(train, "run_eval", lambda model, tok, examples, log: seen.append(examples) or
                        {"overall": 0.5, "tokens_per_forward": 1.0, "exact": {}})
    train.main(_args(tmp_path, "--max-steps", "2", "--eval-minutes", "1e-9", "--eval-n", "4"))
    assert seen and all(ex == train.validation_split(4, 0, 400) for ex in seen)
    best = torch.load(tmp_path / "best.pt", weights_only=False)
    assert best["eval"]["overall"] == 0.5 and best["step"] == 1


@pytest.mark.slow
def test_resumed_training_equals_uninterrupted_and_exports_a_loadable_checkpoint(train, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.cache_utils import DynamicCache

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train.main(_args(straight, "--max-steps", "4"))
    train.main(_args(resumed, "--max-steps", "2"))
    train.main(_args(resumed, "--max-steps", "4", "--resume"))
    a = torch.load(straight / "ckpt.pt", weights_only=False)
    b = torch.load(resumed / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for name, w in a["model"].items():
        torch.testing.assert_close(b["model"][name], w, rtol=0, atol=0, msg=name)

    out = tmp_path / "export"
    train.main(["--run-dir", str(resumed), "--export", str(out), "--from", "last"])
    ours = dg.load(out)
    tok = dg.load_tokenizer(out)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(str(out)).eval()
    ids = torch.tensor([tok("sort 3 1 2=")["input_ids"]])
    canvas = torch.randint(0, ours.config.vocab_size, (1, ours.config.canvas_length),
                           generator=torch.Generator().manual_seed(0))
    cache = ours.new_cache(1, 64)
    dg.encode(ours, ids, cache)
    hf_cache = DynamicCache(config=ref.config.text_config)
    with torch.no_grad():
        ref.model.encoder(input_ids=ids, **hf_cache_kw(hf_cache))
        want = ref(decoder_input_ids=canvas, **hf_cache_kw(hf_cache)).logits
    torch.testing.assert_close(dg.denoise(ours, canvas, cache), want, atol=1e-4, rtol=0)


def _schedule(**kw):
    import argparse

    return argparse.Namespace(**{"lr": 1e-3, "min_lr_frac": 0.1, "warmup": 10, "total_steps": 110, "restart_at": 0,
                                 **kw})


def test_lr_schedule_warms_up_decays_to_its_floor_and_restarts(train):
    import math

    a = _schedule()
    assert math.isclose(train.lr_at(0, a), 1e-4) and math.isclose(train.lr_at(9, a), 1e-3)
    assert math.isclose(train.lr_at(60, a), 1e-3 * (0.1 + 0.9 * 0.5))  # half-way through the cosine
    assert math.isclose(train.lr_at(110, a), 1e-4) and math.isclose(train.lr_at(500, a), 1e-4)
    b = _schedule(restart_at=1000)
    assert [train.lr_at(1000 + s, b) for s in (0, 9, 60, 110)] == [train.lr_at(s, a) for s in (0, 9, 60, 110)]
    with pytest.raises(ValueError, match="before restart_at"):
        train.lr_at(999, b)


def test_resume_keeps_the_runs_schedule_unless_a_flag_is_given(train, tmp_path):
    train.main(_args(tmp_path, "--max-steps", "2", "--lr", "1e-3"))
    resume = ["--run-dir", str(tmp_path), "--resume", "--eval-minutes", "0"]
    train.main(resume + ["--max-steps", "3", "--restart-at", "2", "--total-steps", "4"])
    train.main(resume + ["--max-steps", "4"])
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["step"] == 4
    assert {k: ck["args"][k] for k in train.SCHEDULE} == dict(lr=1e-3, min_lr_frac=0.05, warmup=2, total_steps=4,
                                                              restart_at=2)
    with pytest.raises(SystemExit):  # restarting the schedule ahead of the checkpoint
        train.main(resume + ["--max-steps", "5", "--restart-at", "9"])
