"""Hugging Face checkpoint directory -> `DiffusionGemma`.

Reads config.json (the text part of `DiffusionGemmaConfig`), generation_config.json (optional; reference defaults
when absent) and single-file or sharded safetensors (model.safetensors.index.json), memory-mapped. Every header is
read and checked (missing or unexpected tensors, shapes, dtypes, shard files) before any weight is loaded; a
failure raises one `CheckpointError` naming the file and the tensor, and nothing half-loaded is returned.

Key mapping (transformers' `DiffusionGemmaForBlockDiffusion` names): the encoder and decoder share every weight, so
a shared weight may be stored under either `model.decoder.` or `model.encoder.language_model.` (save_pretrained
keeps the decoder copy); the two `layer_scalar` buffers are kept apart; the routed experts' `weight` is stored as
`experts.gate_up_proj` / `experts.down_proj`; an untied head is the top-level `lm_head.weight`. A multimodal
checkpoint (config.json has a `vision_config`) also loads the vision tower (`model.encoder.vision_tower.*` ->
`vision.tower.*`) and the multimodal embedder (`model.encoder.embed_vision.*` -> `vision.embedder.*`), checked like
every other tensor; `load(..., vision=False)` skips them (one log line), as text-only checkpoints have none.

Quantized checkpoints (compressed-tensors, `quantization_config` in config.json): read by `quant/checkpoint.py`
into the torchao tensors `quant.quantize` builds for the scheme they run as (the stored data as they are, never
cast); `model.checkpoint.quant_scheme` and `.quant_report` say what was loaded quantized and what the checkpoint
left in float. Needs torchao (the `[quant]` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..quant import checkpoint
from ..quant.quantize import quiet_torchao
from ..quant.schemes import check_scheme
from . import compute_dtype
from .backbone import DiffusionGemma
from .checkpoint_info import CheckpointInfo, LazyWeights
from .config import ConfigError, GenerationConfig, ModelConfig, read_json
from .vision import VisionConfig

log = logging.getLogger("dgemma_compile")

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
VISION_PREFIXES = {"vision.tower.": "model.encoder.vision_tower.", "vision.embedder.": "model.encoder.embed_vision."}
IGNORED_PREFIXES = tuple(VISION_PREFIXES.values())  # skipped with `load(..., vision=False)`
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
    if name.startswith("lm_head."):
        return [name]
    for ours, theirs in VISION_PREFIXES.items():
        if name.startswith(ours):
            return [theirs + name[len(ours):]]
    m = re.fullmatch(r"(layers\.\d+\.experts\.(?:gate_up|down)_proj)\.weight", name)
    if m:
        name = m.group(1)
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
    cfg, gen, _ = _load_configs(path)
    return cfg, gen


def _load_configs(path: str | Path) -> tuple[ModelConfig, GenerationConfig, VisionConfig | None]:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    try:
        raw = read_json(directory / "config.json")
        cfg = ModelConfig.from_hf_dict(raw, source=str(directory / "config.json"))
        vision = VisionConfig.from_hf_dict(raw, source=str(directory / "config.json"))
        gen_path = directory / "generation_config.json"
        gen = GenerationConfig.from_hf_dict(read_json(gen_path), source=str(gen_path)) if gen_path.exists() else GenerationConfig()
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return cfg, gen, vision


def _host_dtype(stored: torch.dtype, device: torch.device, directory: Path) -> torch.dtype:
    """`stored`, or float32 where this CPU's GEMM in `stored` is slow (one log line says so and how to keep it)."""
    target, decided_by = compute_dtype.for_host(stored, device)
    if decided_by is not None:
        log.info("%s: computing in float32, not the checkpoint's %s: %s (dtype=%s, or dgemma --dtype %s, keeps it)",
                 directory, str(stored).removeprefix("torch."), decided_by, stored, str(stored).removeprefix("torch."))
    return target


def load(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         window_kind: str = "anchored", attention: str = "flex", vision: bool | None = None,
         lazy: Callable[[str], bool] | None = None) -> DiffusionGemma:
    """Load a DiffusionGemma checkpoint directory.

    Args:
        path: directory with config.json, safetensors weights and optionally generation_config.json.
        dtype: parameter dtype; None keeps the checkpoint's (float32 when mixed), except on a CPU whose GEMM in the
            checkpoint's half-precision dtype is slow, where it is float32 (`compute_dtype.for_host`, logged).
        device: where the weights go.
        window_kind, attention: see `DiffusionGemma` ("anchored"/"symmetric" windows; "flex"/"dense" attention).
        vision: the vision tower and embedder of a multimodal checkpoint (`model.vision`, `vision.VisionEncoder`):
            None (default) loads them when the checkpoint can take images (a `vision_config` and an image token id
            inside the vocabulary; otherwise one log line says why not); True requires them; False leaves them on
            disk. Without them `model.vision` is None and prompts with images are refused.
        lazy: state-dict names for which it returns True are checked (name, shape, dtype; a quantized one's whole
            stored family) but not read: they stay meta tensors of the checkpoint's (dequantized) shape,
            recorded in `model.checkpoint.lazy` (`checkpoint_info.LazyWeights`: each float one's file and key and
            the dtype they load as, a quantized one's `quant.checkpoint.StoredWeight` and its keys' files), from
            which `parallel.load_sharded` reads each rank's slices.
    Returns:
        The model in eval mode, with `.generation_config` (a `GenerationConfig`) and `.checkpoint` (a
        `checkpoint_info.CheckpointInfo`: the directory; for a quantized checkpoint also the `quant.SCHEMES` name it
        runs as and its `quant.QuantReport`). Quantized data keep their stored dtypes (fp8 weight scales become float32, losslessly);
        `dtype` applies to every other tensor and is the quantized weights' dequantized dtype.
    Raises:
        CheckpointError: missing/corrupt/truncated files, missing or unexpected tensors, wrong shapes or dtypes,
            a config that is not DiffusionGemma's, a quantization format or scheme that is not supported, a missing
            or mis-shaped scale, or a quantized checkpoint without torchao installed.
    """
    directory = Path(path)
    if dtype is not None and dtype not in FLOAT_DTYPES.values():
        raise CheckpointError(f"dtype: must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CheckpointError(f"device: {device!r} is not a torch device ({e})") from None
    if vision is not None and not isinstance(vision, bool):
        raise CheckpointError(f"vision: must be None, True or False, got {vision!r}")
    cfg, gen, vision_cfg = _load_configs(directory)
    why_not = "config.json has no vision_config" if vision_cfg is None else vision_cfg.unusable(cfg.vocab_size)
    if vision and why_not:
        raise CheckpointError(f"{directory / 'config.json'}: vision=True, but the checkpoint cannot take images: "
                              f"{why_not}")
    with_vision = vision_cfg is not None and why_not is None and vision is not False
    fmt = _stored_format(directory)
    files = _index(directory)
    headers: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for f in sorted(set(files.values())):
        headers[f] = _read_header(f)
    for key, f in files.items():
        if key not in headers[f]:
            raise CheckpointError(f"{f}: tensor {key} listed in the index is not in the file")
    header = {k: headers[f][k] for k, f in files.items()}

    with torch.device("meta"):
        model = DiffusionGemma(cfg, window_kind=window_kind, attention=attention,
                               vision=vision_cfg if with_vision else None)
    expected = model.state_dict()
    kinds = checkpoint.quantizable(model) if fmt is not None else {}
    quantized: dict[str, checkpoint.StoredWeight] = {}
    sources: dict[str, str] = {}
    for name, ref in expected.items():
        if name in kinds:
            try:
                stored = checkpoint.locate(name, tuple(ref.shape), hf_names(name), fmt, header,
                                           lambda k: str(files[k]), experts=kinds[name] == "experts")
            except checkpoint.FormatError as e:
                raise CheckpointError(str(e)) from None
            if stored is not None:
                quantized[name] = stored
                continue
        key = next((k for k in hf_names(name) if k in files), None)
        if key is None:
            raise CheckpointError(f"{directory}: tensor {hf_names(name)[0]} is missing from the checkpoint")
        dt, shape = header[key]
        if shape != tuple(ref.shape):
            raise CheckpointError(f"{files[key]}: tensor {key} has shape {list(shape)}, expected {list(ref.shape)}")
        if dt not in FLOAT_DTYPES:
            raise CheckpointError(f"{files[key]}: tensor {key} has dtype {dt}, expected one of {sorted(FLOAT_DTYPES)}")
        sources[name] = key
    used = set(sources.values()) | {k for s in quantized.values() for k in s.all_keys()}
    ignored = [k for k in files if k.startswith(IGNORED_PREFIXES)] if model.vision is None else []
    for key in files:
        tied_head = key == "lm_head.weight" and model.lm_head is None
        if key in used or key in ignored or tied_head or _is_shared_duplicate(key, used):
            continue
        if key.startswith("lm_head.") and model.lm_head is None:
            raise CheckpointError(f"{files[key]}: tensor {key}: the lm_head is stored quantized, but config.json ties "
                                  "it to the embeddings (tie_word_embeddings is true); quantize with lm_head in the "
                                  "recipe's ignore list (dg.quantize makes the tied copies itself)")
        raise CheckpointError(f"{files[key]}: unexpected tensor {key} (not part of DiffusionGemma's "
                              f"{'text model' if model.vision is None else 'text model or vision encoder'})")
    if ignored:
        log.info("ignoring %d vision-tower tensors in %s (%s)", len(ignored), directory,
                 "vision=False" if vision is False else why_not or "no vision_config")

    ckpt_dtypes = {header[k][0] for k in sources.values() if not k.endswith("layer_scalar")}
    target = dtype or _host_dtype(FLOAT_DTYPES[ckpt_dtypes.pop()] if len(ckpt_dtypes) == 1 else torch.float32,
                                  device, directory)
    if fmt is not None:
        try:
            check_scheme(fmt.scheme, device, target)
        except ConfigError as e:
            raise CheckpointError(f"{directory / 'config.json'}: {e}") from None
    state, stored_data = {}, {}
    by_file: dict[Path, tuple[list[str], list[str]]] = {}
    skipped = {name: (files[key], key) for name, key in sources.items() if lazy is not None and lazy(name)}
    skipped_quantized = {name: s for name, s in quantized.items() if lazy is not None and lazy(name)}
    read_quantized = {name: s for name, s in quantized.items() if name not in skipped_quantized}
    for name, key in sources.items():
        if name not in skipped:
            by_file.setdefault(files[key], ([], []))[0].append(name)
    for key in sorted({k for s in read_quantized.values() for k in s.all_keys()}):
        by_file.setdefault(files[key], ([], []))[1].append(key)
    for f, (names, keys) in by_file.items():
        try:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for name in names:
                    state[name] = fh.get_tensor(sources[name]).to(device=device, dtype=target)
                for key in keys:
                    stored_data[key] = fh.get_tensor(key)  # as stored: quantized data are never cast
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{f}: could not read tensor data ({e})") from None
    if "lm_head.weight" in files and model.lm_head is None and "embed_tokens.weight" in state:
        _check_tied(files["lm_head.weight"], state["embed_tokens.weight"])

    _assign(model, state, read_quantized, stored_data, fmt, target, device, files,
            set(skipped) | set(skipped_quantized))
    model.init_buffers(device)
    model.generation_config = gen
    model.requires_grad_(False)
    model.checkpoint = CheckpointInfo(
        directory=directory,
        quant_scheme=fmt.scheme.name if fmt is not None else None,
        quant_report=checkpoint.report(model, fmt, quantized, kinds, target, hf_names) if fmt is not None else None,
        lazy=LazyWeights(skipped, target, skipped_quantized,
                         {k: files[k] for s in skipped_quantized.values() for k in s.all_keys()})
        if lazy is not None else None)
    return model.eval()


def _assign(model: DiffusionGemma, state: dict[str, torch.Tensor], quantized: dict, stored_data: dict,
            fmt: "checkpoint.StoredFormat | None", dtype: torch.dtype, device: torch.device,
            files: dict[str, Path], unread: set[str] = frozenset()) -> None:
    """Load `state` (float tensors) and the quantized weights built from `stored_data` into the meta-built model:
    linears as torchao tensors (their dequantized dtype `dtype`), experts through `ExpertProjection.set_quantized`."""
    experts = {}
    if quantized:
        like = checkpoint.template(fmt.scheme, device, dtype)
        for name, stored in quantized.items():
            if stored.experts:
                experts[name] = checkpoint.build_experts(stored, stored_data, device)
            else:
                weight = checkpoint.build_linear(stored, stored_data, like, dtype, device)
                state[name] = nn.Parameter(weight, requires_grad=False)
    result = model.load_state_dict(state, strict=False, assign=True)
    if set(result.missing_keys) != set(experts) | unread or result.unexpected_keys:  # every key was checked before
        raise RuntimeError(f"loader: tensors left unloaded {result.missing_keys}, unexpected {result.unexpected_keys}")
    for name, args in experts.items():
        try:
            model.get_submodule(name.removesuffix(".weight")).set_quantized(fmt.scheme.experts, *args)
        except ValueError as e:
            key = quantized[name].all_keys()[0]
            raise CheckpointError(f"{files[key]}: tensor {quantized[name].module}: {e}") from None


def _stored_format(directory: Path) -> "checkpoint.StoredFormat | None":
    """config.json's `quantization_config` (None: a float checkpoint); torchao must be importable for one."""
    path = directory / "config.json"
    try:
        fmt = checkpoint.read_format(read_json(path), str(path))
    except checkpoint.FormatError as e:
        raise CheckpointError(str(e)) from None
    if fmt is None:
        return None
    try:
        with quiet_torchao():
            import torchao  # noqa: F401
    except ImportError as e:
        raise CheckpointError(f"{path}: a quantized checkpoint ({fmt.family}, runs as {fmt.scheme}) needs "
                              f"torchao: pip install 'dgemma-compile[quant]' ({e})") from None
    if fmt.w4a4:
        log.warning("%s: NVFP4 W4A4 checkpoint (NVFP4 weights and activations); running it as nvfp4-w4a16 (NVFP4 "
                    "weights, 16-bit activations): W4A4 needs sm100 tensor cores; its input_global_scale tensors are "
                    "not used", path)
    return fmt


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
        raise CheckpointError(f"{path}: tensor lm_head.weight differs from the embeddings, but config.json ties them "
                              f"(tie_word_embeddings is true)")


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
