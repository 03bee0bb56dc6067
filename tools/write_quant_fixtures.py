#!/usr/bin/env python
"""Write compressed-tensors checkpoints of small DiffusionGemma models with llmcompressor's real `oneshot`.

Runs in its OWN virtual environment, never the project's test environment (llmcompressor 0.14 pins
transformers <= 5.17 and compressed-tensors 0.19.0):

    python3 -m venv /tmp/qfx && . /tmp/qfx/bin/activate && pip install torch==2.13.0 && pip install -r tools/requirements-quant-fixtures.txt

then, from the repository root:

    OMP_NUM_THREADS=1 python tools/write_quant_fixtures.py [--out tests/fixtures/quant]

(under 10 s on one CPU core). Schemes: llmcompressor's preset `FP8_DYNAMIC` (FP8 E4M3 weights with one scale per
output channel, dynamic per-token FP8 activations) and `NVFP4A16` (FP4 E2M1 weights packed two per byte, one FP8
E4M3 scale per 16 input columns, one float32 global scale per tensor; 16-bit activations). Both are data-free, so
no calibration set is read. Models:

- `demo-*`: the shipped demo model (dgemma_compile/demo/model, float32, tied embeddings). Ignored: `lm_head` (tied to
  the 27-row embedding; quantizing it would untie it, and NVFP4 kernels want rows in multiples of 16), the routers,
  and the vision tower (absent from the demo checkpoint: transformers initialises it with seeded random weights and
  the tool writes them).
- `tiny-untied-*`: a random bfloat16 DiffusionGemma built with transformers' own classes (vocabulary 64, untied
  lm_head, every matrix dimension a multiple of 16). Ignored: the routers and the vision tower; `lm_head` is
  quantized.

What the tool writes and what this script writes itself:

- Every `<model>-<scheme>/` directory is exactly what `oneshot(..., output_dir=...)` saved: config.json with its
  `quantization_config`, model.safetensors, generation_config.json, recipe.yaml.
- llmcompressor cannot quantize the fused 3-D experts (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj`
  [E, D, I]) as 3-D tensors: `oneshot` first "linearizes" each experts module into E per-expert `nn.Linear`s and
  saves them as `experts.{e}.{gate,up,down}_proj.weight[...]`. Its `repack_moe` (which would restore 3-D keys)
  writes the fused weights unquantized (float `gate_up_proj` beside float `gate_up_proj_scale` and
  `gate_up_proj_zero_point`, no packing), so it is not used. For the fused layout this script writes
  `tiny-untied-<scheme>-fused/` itself from the tool's own output, byte for byte: the per-expert tensors are
  stacked into `experts.gate_up_proj*` (gate rows then up rows, as transformers stores `gate_up_proj`) and
  `experts.down_proj*`, named by compressed-tensors' suffixes on the parameter name (`weight` -> `weight_scale`
  becomes `gate_up_proj` -> `gate_up_proj_scale`, `_packed`, `_global_scale`) as llmcompressor's `repack_moe`
  names its qparams; global scales stack to [E, 2] (gate, up) and [E, 1] (down) as `repack_moe` stacks them.
  config.json (with the tool's `quantization_config`), generation_config.json and recipe.yaml are copied
  unchanged.
- The encoder shares every weight with the decoder; the tool quantizes both module copies and writes both
  (`model.encoder.language_model.*` and `model.decoder.*`, bit-identical, checked here). transformers ties the
  encoder to the decoder only while `tie_word_embeddings` is true, so the untied model is saved (float, to a
  temporary directory, then loaded as oneshot needs) with its encoder set to the decoder's values.

The script also writes README.md beside the fixtures (versions, contents, one layer's tensor table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "dgemma_compile" / "demo" / "model"
SCHEMES = {"fp8-dynamic": "FP8_DYNAMIC", "nvfp4a16": "NVFP4A16"}
COMMON_IGNORE = ["re:.*router.*", "re:.*vision.*"]
EXPERT_KEY = re.compile(r"(?P<mod>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<q>weight\w*)")
ENC, DEC = "model.encoder.language_model.", "model.decoder."


def tiny_untied_model(seed: int = 0):
    """A bfloat16 `DiffusionGemmaForBlockDiffusion` with random weights and an untied lm_head (vocabulary 64,
    hidden 32, 2 layers sliding + full, 4 experts of width 16), norms/router scales/layer scalars away from 1, the
    encoder's weights equal to the decoder's (its layer scalars differ)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig

    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4, num_experts=4,
                top_k_experts=2, moe_intermediate_size=16, tie_word_embeddings=False)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8, tie_word_embeddings=False)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn_like(b))
        # tie_word_embeddings=False turns off all of transformers' tying, the encoder<->decoder sharing included:
        # give the encoder the decoder's values, as the architecture shares them
        decoder = dict(model.model.decoder.named_parameters())
        for name, p in model.model.encoder.language_model.named_parameters():
            p.copy_(decoder[name])
    model = model.to(torch.bfloat16)
    assert model.lm_head.weight.data_ptr() != model.model.decoder.embed_tokens.weight.data_ptr(), "lm_head is tied"
    return model


def quantize(checkpoint: Path, scheme: str, ignore: list[str], out: Path) -> None:
    """`oneshot` on a checkpoint loaded from disk (oneshot re-reads its config.json by the model's name_or_path)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import DiffusionGemmaForBlockDiffusion

    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(0)  # the demo checkpoint has no vision tower: transformers initialises it at random
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint))
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    oneshot(model=model, recipe=recipe, output_dir=str(out))


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def check_encoder_copies(path: Path) -> int:
    """Every encoder tensor but the layer scalars equals its decoder copy bit for bit; returns how many."""
    tensors = _read(path)
    keys = [k for k in tensors if k.startswith(ENC) and not k.endswith("layer_scalar")]
    for k in keys:
        d = DEC + k[len(ENC):]
        assert torch.equal(_bits(tensors[k]), _bits(tensors[d])), f"{k} differs from {d}"
    return len(keys)


def fuse_experts(src: Path, dst: Path) -> None:
    """Rewrite the tool's per-expert tensors of `src` as fused 3-D experts tensors in `dst` (see the docstring)."""
    from safetensors.torch import save_file

    tensors = _read(src / "model.safetensors")
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for k, t in tensors.items():
        m = EXPERT_KEY.fullmatch(k)
        if m is None:
            out[k] = t
        else:
            groups.setdefault((m["mod"], m["proj"], m["q"]), {})[int(m["e"])] = t
    for (mod, proj, q) in sorted(groups):
        if proj == "up_proj":
            continue
        suffix = q[len("weight"):]  # "", "_scale", "_packed", "_global_scale"
        per = groups[(mod, proj, q)]
        stack = lambda d: torch.stack([d[e] for e in range(len(d))])  # noqa: E731
        if proj == "down_proj":
            out[f"{mod}.down_proj{suffix}"] = stack(per)
            continue
        gate, up = stack(per), stack(groups[(mod, "up_proj", q)])
        # scalars (global scales) stack to [E, 2] (gate, up) as repack_moe does; the rest concatenate on rows
        scalar = gate.ndim == 2 and gate.shape[-1] == 1
        fused = torch.cat([gate, up], dim=-1 if scalar else 1)
        out[f"{mod}.gate_up_proj{suffix}"] = fused.contiguous()
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "recipe.yaml"):
        shutil.copy(src / name, dst / name)
    _check_fused(tensors, out)


def _check_fused(per: dict[str, torch.Tensor], fused: dict[str, torch.Tensor]) -> None:
    for k, t in per.items():
        m = EXPERT_KEY.fullmatch(k)
        if m is None:
            continue
        e, suffix = int(m["e"]), m["q"][len("weight"):]
        if m["proj"] == "down_proj":
            got = fused[f"{m['mod']}.down_proj{suffix}"][e]
        else:
            f = fused[f"{m['mod']}.gate_up_proj{suffix}"][e]
            gate = m["proj"] == "gate_proj"
            if f.ndim == 1:  # global scales: (gate, up)
                got = f[[0 if gate else 1]]
            else:
                got = f[: f.shape[0] // 2] if gate else f[f.shape[0] // 2:]
        assert torch.equal(_bits(got), _bits(t)), f"fused copy of {k} differs"


# ---------------------------------------------------------------------------------------------------- README

def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch", "safetensors")}


def _table(path: Path, prefix_re: str) -> list[str]:
    from safetensors import safe_open

    rows = ["| tensor | dtype | shape |", "|---|---|---|"]
    with safe_open(str(path), framework="pt") as f:
        for k in sorted(f.keys()):
            if re.match(prefix_re, k):
                sl = f.get_slice(k)
                rows.append(f"| `{k}` | {sl.get_dtype()} | {list(sl.get_shape())} |")
    return rows


def _qconfig_summary(path: Path) -> list[str]:
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = json.dumps(q["config_groups"], indent=1)
    return [f"`format`: `{q['format']}`, `quantization_status`: `{q['quantization_status']}`, "
            f"`version`: `{q['version']}`; `ignore` lists {len(q['ignore'])} module names "
            f"(resolved from the recipe's patterns). `config_groups`:", "", "```json", groups, "```"]


def write_readme(out: Path, written: list[tuple[str, str, list[str], bool]], n_shared: dict[str, int]) -> None:
    v = _versions()
    lines = [
        "# compressed-tensors fixtures",
        "",
        "Written by `tools/write_quant_fixtures.py` (see its docstring for the install and run commands) in its own",
        "virtual environment with " + ", ".join(f"{p} {v[p]}" for p in v) + ".",
        "Regenerate with `OMP_NUM_THREADS=1 python tools/write_quant_fixtures.py` in that environment; the output is",
        "deterministic (seeded).",
        "",
        "Schemes (llmcompressor presets, `QuantizationModifier(targets=\"Linear\", scheme=..., ignore=...)`,",
        "data-free): `FP8_DYNAMIC`: `weight` float8_e4m3fn [N, K] + `weight_scale` [N, 1] (per output channel, the",
        "model's dtype), activations quantized per token at run time (nothing stored). `NVFP4A16`: `weight_packed`",
        "uint8 [N, K/2] (two FP4 E2M1 values per byte, the even column in the low nibble) + `weight_scale`",
        "float8_e4m3fn [N, K/16] + `weight_global_scale` float32 [1]; the dequantized weight is",
        "`fp4 * weight_scale / weight_global_scale` (checked against the float demo: 9.5% relative error on",
        "`layers.0.mlp.gate_proj`; FP8 `weight * weight_scale`: 2.6%). No `weight_shape` is stored.",
        "",
        "| directory | written by | model | scheme | ignored (recipe patterns) | bytes |",
        "|---|---|---|---|---|---|",
    ]
    for name, scheme, ignore, by_tool in written:
        size = (out / name / "model.safetensors").stat().st_size
        model = "demo (float32, tied)" if name.startswith("demo") else "tiny random (bfloat16, untied lm_head)"
        who = "llmcompressor `oneshot`" if by_tool else "this script, from the tool's output (fused 3-D experts)"
        lines.append(f"| `{name}/` | {who} | {model} | `{scheme}` | {', '.join(f'`{i}`' for i in ignore)} | {size:,} |")
    lines += [
        "",
        "Layout notes:",
        "- Experts: the tool writes per-expert 2-D tensors `...experts.{e}.{gate,up,down}_proj.<weight family>`;",
        "  llmcompressor linearizes the fused 3-D experts before quantizing and cannot save them fused (its",
        "  `repack_moe` writes them unquantized). The `*-fused/` directories hold the same bytes as 3-D tensors",
        "  `experts.gate_up_proj{,_packed}` [E, 2I, ...] (gate rows then up rows), `experts.down_proj{,_packed}`",
        "  [E, D, ...], `*_scale` stacked likewise, `*_global_scale` [E, 2] (gate, up) and [E, 1] (down); their",
        "  config.json is the tool's, unchanged (its groups target `Linear`).",
        "- Encoder copies: the encoder shares every weight with the decoder; the tool quantizes and writes both copies",
        "  (`model.encoder.language_model.*` and `model.decoder.*`), bit-identical: "
        + ", ".join(f"{k}: {n} tensors" for k, n in n_shared.items()) + ".",
        "- NVFP4 gate/up (and q/k/v) global scales: llmcompressor makes those of one MLP or expert equal.",
        "- Unquantized tensors (norms, routers, embeddings, layer scalars, vision tower) keep the model's dtype;",
        "  the demo's vision tower is absent from its checkpoint, so these hold seeded random weights.",
        "",
    ]
    for name, scheme, ignore, by_tool in written:
        path = out / name
        lines += [f"## `{name}/`", ""]
        lines += _qconfig_summary(path)
        lines += ["", "Decoder layer 0 (the encoder copy has the same names under `model.encoder.language_model.`), "
                  "plus the embedding and lm_head:", ""]
        first_expert = r"model\.decoder\.layers\.0\.(?!experts\.[1-9])"
        lines += _table(path / "model.safetensors", rf"({first_expert}|model\.decoder\.embed_tokens|lm_head)")
        lines.append("")
    (out / "README.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "quant")
    args = ap.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, str, list[str], bool]] = []
    n_shared: dict[str, int] = {}
    tmp = Path(tempfile.mkdtemp(prefix="qfx-tiny-"))
    tiny_untied_model().save_pretrained(str(tmp))
    for tag, scheme in SCHEMES.items():
        for model_name, checkpoint, ignore in (("demo", DEMO, ["lm_head", *COMMON_IGNORE]),
                                               ("tiny-untied", tmp, COMMON_IGNORE)):
            name = f"{model_name}-{tag}"
            quantize(checkpoint, scheme, ignore, args.out / name)
            n_shared[name] = check_encoder_copies(args.out / name / "model.safetensors")
            written.append((name, scheme, ignore, True))
            print(f"write_quant_fixtures: {name}: written by llmcompressor oneshot ({scheme}); experts saved per "
                  f"expert (2-D), as the tool linearizes them", file=sys.stderr)
            if model_name == "tiny-untied":
                fuse_experts(args.out / name, args.out / f"{name}-fused")
                written.append((f"{name}-fused", scheme, ignore, False))
                print(f"write_quant_fixtures: {name}-fused: written by this script (the tool cannot save fused 3-D "
                      f"experts quantized): per-expert tensors of {name} stacked into experts.gate_up_proj*/"
                      f"down_proj*", file=sys.stderr)
    shutil.rmtree(tmp)
    written.sort()
    write_readme(args.out, written, n_shared)
    print(f"write_quant_fixtures: wrote {len(written)} checkpoints and README.md under {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
