"""Checkpoint loading: formats that must load, and every failure with its message."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import hf_model, write_checkpoint
from safetensors.torch import load_file, save_file

import dgemma_compile as dg
from dgemma_compile.model.loader import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("base"), tokenizer=True)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def logits_of(model, ids=((2, 5, 9, 11, 3),)):
    cache = model.new_cache(1, 16)
    enc = model.logits(dg.encode(model, torch.tensor(ids), cache))
    return enc, dg.denoise(model, torch.arange(8)[None] + 3, cache)


def edit_weights(directory: Path, fn) -> None:
    path = directory / "model.safetensors"
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})


def test_sharded_checkpoint_equals_single_file(tmp_path, ckpt):
    model = hf_model()
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    model.save_pretrained(str(tmp_path / "single"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = dg.load(tmp_path / "sharded"), dg.load(tmp_path / "single")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    for x, y in zip(logits_of(a), logits_of(b)):  # equal weights; buffer alignment may change the last ulp
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_shared_weights_stored_under_encoder_names(tmp_path, ckpt):
    """A checkpoint that keeps the encoder copy of the shared weights instead of the decoder copy loads the same."""
    d = copy(ckpt, tmp_path / "enc")

    def to_encoder_names(state):
        for k in [k for k in state if k.startswith("model.decoder.") and "self_conditioning" not in k
                  and not k.endswith("layer_scalar")]:
            state["model.encoder.language_model." + k[len("model.decoder."):]] = state.pop(k)

    edit_weights(d, to_encoder_names)
    a, b = dg.load(d), dg.load(ckpt)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    for x, y in zip(logits_of(a), logits_of(b)):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_what_the_loader_remembers_is_one_record_and_no_new_attribute(ckpt):
    """The loader's memory of a checkpoint is `model.checkpoint` (a `CheckpointInfo`), never attributes added to the
    model: a loaded model, lazily or not, has exactly the attributes of one built in memory (issue 38 item 3)."""
    from dgemma_compile.model.checkpoint_info import CheckpointInfo
    from dgemma_compile.model.backbone import DiffusionGemma

    built = DiffusionGemma(dg.load(ckpt).config)
    assert built.checkpoint == CheckpointInfo()
    eager = dg.load(ckpt)
    assert set(vars(eager)) == set(vars(built))
    assert eager.checkpoint == CheckpointInfo(directory=Path(ckpt))
    lazy = dg.load(ckpt, lazy=lambda name: name.endswith("q_proj.weight"))
    assert set(vars(lazy)) == set(vars(built))
    names = {n for n, _ in lazy.named_parameters() if n.endswith("q_proj.weight")}
    assert names and set(lazy.checkpoint.lazy.float_sources) == names
    assert all(lazy.get_parameter(n).is_meta for n in names) and lazy.checkpoint.lazy.dtype == eager.dtype
    assert {f for f, _ in lazy.checkpoint.lazy.float_sources.values()} == {Path(ckpt) / "model.safetensors"}


def test_both_layer_scalar_sets_are_loaded(ckpt):
    state = load_file(ckpt / "model.safetensors")
    model = dg.load(ckpt)
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.encoder_layer_scalar, state[f"model.encoder.language_model.layers.{i}.layer_scalar"])
        assert torch.equal(layer.decoder_layer_scalar, state[f"model.decoder.layers.{i}.layer_scalar"])
        assert not torch.equal(layer.encoder_layer_scalar, layer.decoder_layer_scalar)


def test_vision_tower_ignored_with_one_log_line(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="dgemma_compile"):
        dg.load(ckpt)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "ignoring" in lines[0]


def test_bfloat16_load(ckpt):
    """bf16 weights give float32 logits within a bound from bf16 precision: every layer (plus the embedding and the
    head) may add a few roundings of relative size eps_bf16 = 2**-7 to activations of the logits' scale. The bound
    8 * eps * (layers + 2) * max|logit| is ~5x what this model shows (measured 6.4 eps * scale for the encoder)."""
    model = dg.load(ckpt, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ref = dg.load(ckpt)
    eps = torch.finfo(torch.bfloat16).eps
    for got, want in zip(logits_of(model), logits_of(ref)):
        assert got.dtype == torch.float32
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert 0 < err <= 8 * eps * (ref.config.num_layers + 2) * scale, (err, scale)


def test_tokenizer_with_chat_template(ckpt):
    tok = dg.load_tokenizer(ckpt)
    assert tok("ab")["input_ids"] == [2, 3, 4]
    assert tok.chat_template


@pytest.mark.parametrize("case,pattern", [
    ("no_dir", r"nope: not a directory"),
    ("no_config", r"config.json: file not found"),
    ("bad_json", r"config.json: not valid JSON"),
    ("not_diffusion_gemma", r"config.json: model_type: not a DiffusionGemma checkpoint \(model_type='llama'"),
    ("bad_config_value", r"config.json: top_k_experts: must be <= num_experts=4"),
    ("attention_softcap", r"config.json: attn_logit_softcapping: not supported: DiffusionGemma's attention applies no "
                          r"score transform"),
    ("no_weights", r"no model.safetensors or model.safetensors.index.json"),
    ("missing_tensor", r"tensor model.decoder.layers.1.router.proj.weight is missing"),
    ("wrong_shape", r"model.safetensors: tensor model.decoder.layers.0.mlp.up_proj.weight has shape \[48, 31\], expected \[48, 32\]"),
    ("wrong_dtype", r"model.safetensors: tensor model.decoder.norm.weight has dtype I8"),
    ("truncated", r"model.safetensors: not a readable safetensors file"),
    ("garbage", r"model.safetensors: not a readable safetensors file"),
    ("unexpected", r"model.safetensors: unexpected tensor model.decoder.layers.0.extra.weight"),
    ("untied_head", r"lm_head.weight differs from the embeddings"),
    ("missing_shard", r"model-0000(\d)-of-0000\1.safetensors: file not found"),
    ("index_lies", r"tensor model.decoder.norm.weight listed in the index is not in the file"),
])
def test_bad_checkpoints_fail_with_a_message_naming_file_and_tensor(tmp_path, ckpt, case, pattern):
    d = tmp_path / "ck"
    if case == "no_dir":
        d = tmp_path / "nope"
    elif case in ("missing_shard", "index_lies"):
        hf_model().save_pretrained(str(d), max_shard_size="40KB")
        index = json.loads((d / "model.safetensors.index.json").read_text())
        if case == "missing_shard":
            last = sorted(set(index["weight_map"].values()))[-1]
            (d / last).unlink()
        else:
            first = sorted(set(index["weight_map"].values()))[0]
            other = next(f for f in sorted(set(index["weight_map"].values())) if f != first)
            index["weight_map"]["model.decoder.norm.weight"] = other if index["weight_map"]["model.decoder.norm.weight"] == first else first
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        copy(ckpt, d)
        cfg_path, weights = d / "config.json", d / "model.safetensors"
        cfg = json.loads(cfg_path.read_text())
        if case == "no_config":
            cfg_path.unlink()
        elif case == "bad_json":
            cfg_path.write_text("{not json")
        elif case == "not_diffusion_gemma":
            cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
            cfg_path.write_text(json.dumps(cfg))
        elif case == "bad_config_value":
            cfg["text_config"]["top_k_experts"] = 9
            cfg_path.write_text(json.dumps(cfg))
        elif case == "attention_softcap":
            cfg["text_config"]["attn_logit_softcapping"] = 50.0
            cfg_path.write_text(json.dumps(cfg))
        elif case == "no_weights":
            weights.unlink()
        elif case == "missing_tensor":
            edit_weights(d, lambda s: s.pop("model.decoder.layers.1.router.proj.weight"))
        elif case == "wrong_shape":
            edit_weights(d, lambda s: s.update({"model.decoder.layers.0.mlp.up_proj.weight": torch.zeros(48, 31)}))
        elif case == "wrong_dtype":
            edit_weights(d, lambda s: s.update({"model.decoder.norm.weight": torch.zeros(32, dtype=torch.int8)}))
        elif case == "truncated":
            data = weights.read_bytes()
            weights.write_bytes(data[: len(data) - 100])
        elif case == "garbage":
            weights.write_bytes(b"\x00\x01garbage" * 10)
        elif case == "unexpected":
            edit_weights(d, lambda s: s.update({"model.decoder.layers.0.extra.weight": torch.zeros(3)}))
        elif case == "untied_head":
            edit_weights(d, lambda s: s.update({"lm_head.weight": torch.randn(64, 32)}))
    with pytest.raises(CheckpointError, match=pattern):
        dg.load(d)


def test_missing_tokenizer_is_a_checkpoint_error(tmp_path):
    d = write_checkpoint(tmp_path / "notok")
    with pytest.raises(CheckpointError, match="no loadable tokenizer"):
        dg.load_tokenizer(d)


def test_reference_attention_applies_no_score_transform():
    """What our attention assumes of transformers' DiffusionGemma (scale 1.0 on RMS-normed q/k, no attention
    softcap, so FlexAttention needs no score_mod): its config has no attention softcap or query pre-scalar field,
    its attention modules set `scaling = 1.0`, and their forward passes no `softcap` to the attention function."""
    import inspect

    from transformers import DiffusionGemmaConfig
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as m

    text = DiffusionGemmaConfig().text_config
    assert not hasattr(text, "attn_logit_softcapping") and not hasattr(text, "query_pre_attn_scalar")
    attention = [c for name, c in vars(m).items() if isinstance(c, type) and name.endswith("Attention")]
    assert attention
    model = hf_model()
    for module in model.modules():
        if type(module) in attention:
            assert module.scaling == 1.0
    for cls in attention:
        source = inspect.getsource(cls.forward)
        assert "scaling=self.scaling" in source and "softcap" not in source, cls.__name__
