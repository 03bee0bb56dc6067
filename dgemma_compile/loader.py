"""Hugging Face checkpoint directory -> `DiffusionGemma`.

Reads config.json (the text part of `DiffusionGemmaConfig`), generation_config.json (optional; reference defaults
when absent) and single-file or sharded safetensors (model.safetensors.index.json), memory-mapped. Every header is
read and checked (missing or unexpected tensors, shapes, dtypes, shard files) before any weight is loaded; a
failure raises one `CheckpointError` naming the file and the tensor, and nothing half-loaded is returned.

Key mapping (transformers' `DiffusionGemmaForBlockDiffusion` names): the encoder and decoder share every weight, so
a shared weight may be stored under either `model.decoder.` or `model.encoder.language_model.` (save_pretrained
keeps the decoder copy); the two `layer_scalar` buffers are kept apart; the vision tower is ignored (text-only).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import ConfigError, GenerationConfig, ModelConfig, read_json
from .model import DiffusionGemma

log = logging.getLogger("dgemma_compile")

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
IGNORED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and, where known, the tensor."""


def hf_names(name: str) -> list[str]:
    """Checkpoint keys that may hold our parameter `name`, preferred first."""
    m = re.fullmatch(r"layers\.(\d+)\.(encoder|decoder)_layer_scalar", name)
    if m:
        prefix = ENCODER if m.group(2) == "encoder" else DECODER
        return [f"{prefix}layers.{m.group(1)}.layer_scalar"]
    if name.startswith("self_conditioning."):
        return [DECODER + name]
    return [DECODER + name, ENCODER + name]


def _index(directory: Path) -> dict[str, Path]:
    """checkpoint key -> safetensors file holding it, from the index or the single file."""
    index_path = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        return {k: directory / v for k, v in weight_map.items()}
    if single.exists():
        return {k: single for k in _read_header(single)}
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (dtype string, shape) from a safetensors header; checks the file holds every byte it declares."""
    if not path.exists():
        raise CheckpointError(f"{path}: file not found")
    try:
        with safe_open(path, framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def load_configs(path: str | Path) -> tuple[ModelConfig, GenerationConfig]:
    """Read config.json and generation_config.json (reference defaults when the latter is absent)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    try:
        cfg = ModelConfig.from_hf_dict(read_json(directory / "config.json"), source=str(directory / "config.json"))
        gen_path = directory / "generation_config.json"
        gen = GenerationConfig.from_hf_dict(read_json(gen_path), source=str(gen_path)) if gen_path.exists() else GenerationConfig()
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return cfg, gen


def load(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         window_kind: str = "anchored", attention: str = "flex") -> DiffusionGemma:
    """Load a DiffusionGemma checkpoint directory.

    Args:
        path: directory with config.json, safetensors weights and optionally generation_config.json.
        dtype: parameter dtype; None keeps the checkpoint's (float32 when mixed).
        device: where the weights go.
        window_kind, attention: see `DiffusionGemma` ("anchored"/"symmetric" windows; "flex"/"dense" attention).
    Returns:
        The model in eval mode, with `.generation_config` (a `GenerationConfig`) and `.checkpoint_dir` set.
    Raises:
        CheckpointError: missing/corrupt/truncated files, missing or unexpected tensors, wrong shapes or dtypes,
            or a config that is not DiffusionGemma's.
    """
    directory = Path(path)
    if dtype is not None and dtype not in FLOAT_DTYPES.values():
        raise CheckpointError(f"dtype: must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"device: {device!r} is not a torch device ({e})") from None
    cfg, gen = load_configs(directory)
    files = _index(directory)
    headers: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for f in sorted(set(files.values())):
        headers[f] = _read_header(f)
    for key, f in files.items():
        if key not in headers[f]:
            raise CheckpointError(f"{f}: tensor {key} listed in the index is not in the file")

    with torch.device("meta"):
        model = DiffusionGemma(cfg, window_kind=window_kind, attention=attention)
    expected = model.state_dict()
    sources: dict[str, str] = {}
    for name, ref in expected.items():
        key = next((k for k in hf_names(name) if k in files), None)
        if key is None:
            raise CheckpointError(f"{directory}: tensor {hf_names(name)[0]} is missing from the checkpoint")
        dt, shape = headers[files[key]][key]
        if shape != tuple(ref.shape):
            raise CheckpointError(f"{files[key]}: tensor {key} has shape {list(shape)}, expected {list(ref.shape)}")
        if dt not in FLOAT_DTYPES:
            raise CheckpointError(f"{files[key]}: tensor {key} has dtype {dt}, expected one of {sorted(FLOAT_DTYPES)}")
        sources[name] = key
    used = set(sources.values())
    ignored = [k for k in files if k.startswith(IGNORED_PREFIXES)]
    for key in files:
        if key in used or key in ignored or key == "lm_head.weight" or _is_shared_duplicate(key, used):
            continue
        raise CheckpointError(f"{files[key]}: unexpected tensor {key} (not part of DiffusionGemma's text model)")
    if ignored:
        log.info("ignoring %d vision-tower tensors in %s (text-only model)", len(ignored), directory)

    ckpt_dtypes = {headers[files[k]][k][0] for k in used if not k.endswith("layer_scalar")}
    target = dtype or (FLOAT_DTYPES[ckpt_dtypes.pop()] if len(ckpt_dtypes) == 1 else torch.float32)
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name, key in sources.items():
        by_file.setdefault(files[key], []).append(name)
    for f, names in by_file.items():
        try:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in names:
                    state[name] = fh.get_tensor(sources[name]).to(device=device, dtype=target)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{f}: could not read tensor data ({e})") from None
    if "lm_head.weight" in files:
        _check_tied(files["lm_head.weight"], state["embed_tokens.weight"])

    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    model.generation_config = gen
    model.checkpoint_dir = directory
    model.requires_grad_(False)
    return model.eval()


def _is_shared_duplicate(key: str, used: set[str]) -> bool:
    """A second copy of a shared weight (encoder copy when the decoder one was used, or the reverse)."""
    for a, b in ((ENCODER, DECODER), (DECODER, ENCODER)):
        if key.startswith(a) and not key.endswith("layer_scalar") and b + key[len(a):] in used:
            return True
    return False


def _check_tied(path: Path, embed: torch.Tensor) -> None:
    with safe_open(path, framework="pt", device="cpu") as fh:
        head = fh.get_tensor("lm_head.weight")
    if head.shape != embed.shape or not torch.equal(head.to(embed.dtype), embed.cpu()):
        raise CheckpointError(f"{path}: tensor lm_head.weight differs from the embeddings; untied heads are not supported")


def load_tokenizer(path: str | Path):
    """The tokenizer (with its chat template) saved beside the weights, through transformers.

    Raises:
        CheckpointError: the directory holds no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((Path(path) / n).exists() for n in names):  # transformers would silently build an empty one
        raise CheckpointError(f"{path}: no loadable tokenizer (none of {', '.join(names)})")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: no loadable tokenizer ({e})") from None
