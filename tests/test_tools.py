"""tools/train_demo_model.py at a tiny size: resuming reproduces an uninterrupted run, and the export loads in
dgemma_compile with transformers' logits."""

import importlib.util
from pathlib import Path

import pytest
import torch

import dgemma_compile as dg

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
    ours.encode(ids, cache)
    hf_cache = DynamicCache(config=ref.config.text_config)
    with torch.no_grad():
        ref.model.encoder(input_ids=ids, cache=hf_cache)
        want = ref(decoder_input_ids=canvas, cache=hf_cache).logits
    torch.testing.assert_close(ours.denoise(canvas, cache), want, atol=1e-4, rtol=0)
