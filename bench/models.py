"""The models the benchmark runs, and how each is obtained.

- `demo`: the shipped, trained demo checkpoint (`dgemma_compile/demo/model`, float32).
- `scaled`: random weights with DiffusionGemma-26B-A4B proportions scaled down to run on a CPU (about 93M parameters,
  ~190 MB in bf16): built as a transformers `DiffusionGemmaForBlockDiffusion`, `save_pretrained` once to a cache
  directory under /tmp, then read by both transformers and `dg.load` (the same bytes for every system).
- `full`: the full 26B-A4B text architecture (the released config.json's sizes) with random weights made directly
  on the device in the benchmark dtype through our `DiffusionGemma(ModelConfig(...))`; no checkpoint, so
  transformers cannot run it.
- `full-tiny`: the same code path as `full` at a CPU-friendly size (for dry runs of bench/h200.sh).
- any checkpoint directory given with `--checkpoint`.

Scaling rules for `scaled` (real value -> scaled): hidden 2816 -> 512; layers 30 -> 6 (5 sliding + 1 full, the
real 5:1 pattern, last layer full); query heads 16 -> 8; sliding kv heads 8 x 256 -> 4 x 64 (q:kv 2:1 kept); full kv
heads 2 x 512 -> 1 x 128 (8:1 kept, full head = 2x sliding head kept); dense MLP 2112 -> 384 (0.75 x hidden); experts
128 top-8 of 704 -> 64 top-4 of 128 (1/16 of expert weights active per token and 16 tokens per expert per 256-token
canvas, both as in the real model); vocab 262144 -> 16384 (embedding/lm_head ~1/3 of a token's active weights, as in
the real model); canvas 256 and sliding window 1024 unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dgemma_compile.model.config import FULL, SLIDING, GenerationConfig, ModelConfig, RopeConfig

DEMO_DIR = Path(__file__).resolve().parents[1] / "dgemma_compile" / "demo" / "model"
CACHE_ROOT = Path("/tmp/dgemma_bench")

SCALED_TEXT = dict(
    vocab_size=16384, hidden_size=512, intermediate_size=384, num_hidden_layers=6,
    layer_types=[SLIDING] * 5 + [FULL], num_attention_heads=8, num_key_value_heads=4, head_dim=64,
    global_head_dim=128, num_global_key_value_heads=1, sliding_window=1024, num_experts=64, top_k_experts=4,
    moe_intermediate_size=128, max_position_embeddings=8192, eos_token_id=[1, 106, 50], pad_token_id=0, bos_token_id=2,
)
SCALED_CANVAS = 256
SCALED_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class ModelSpec:
    """What to benchmark. `checkpoint` is a directory (transformers can run it too) or None for a model built
    directly from `direct` (our systems only)."""

    name: str
    checkpoint: str | None = None
    direct: str | None = None  # "full" or "full-tiny"

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None


def resolve(name: str, checkpoint: str | None = None) -> ModelSpec:
    """The spec for `--model name` (or `--checkpoint DIR`). Building `scaled` happens here, once, on first use."""
    if checkpoint is not None:
        return ModelSpec(name=name, checkpoint=str(Path(checkpoint).resolve()))
    if name == "demo":
        return ModelSpec(name="demo", checkpoint=str(DEMO_DIR))
    if name == "scaled":
        return ModelSpec(name="scaled", checkpoint=str(scaled_checkpoint()))
    if name in ("full", "full-tiny"):
        return ModelSpec(name=name, direct=name)
    raise ValueError(f"unknown model {name!r}: choose demo, scaled, full, full-tiny or pass --checkpoint DIR")


# ----- scaled: a transformers checkpoint with random weights, cached under /tmp -----------------------------------
def _scaled_key() -> str:
    blob = json.dumps([SCALED_TEXT, SCALED_CANVAS, str(SCALED_DTYPE), 1], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def scaled_checkpoint(root: Path = CACHE_ROOT) -> Path:
    """Directory of the `scaled` checkpoint, written on first use (a `.complete` marker guards half-written dirs)."""
    directory = root / f"scaled-{_scaled_key()}"
    if not (directory / ".complete").exists():
        write_random_checkpoint(directory, SCALED_TEXT, canvas_length=SCALED_CANVAS, dtype=SCALED_DTYPE)
    return directory


def write_random_checkpoint(directory: Path, text_config: dict, *, canvas_length: int, dtype: torch.dtype,
                            seed: int = 0, generation: dict | None = None) -> Path:
    """save_pretrained a random-weight `DiffusionGemmaForBlockDiffusion` (transformers' own initialisation, a tiny
    vision tower that our loader ignores) in `dtype`, with `generation` as its generation config (default: the
    reference defaults)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=dict(text_config), vision_config=vision, canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    model.generation_config = DiffusionGemmaGenerationConfig(**(generation or {}))
    directory.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(str(directory))
    (directory / ".complete").write_text("ok\n")
    return directory


# ----- full: our model built directly on the device --------------------------------------------------------------
def full_config(tiny: bool = False) -> ModelConfig:
    """DiffusionGemma-26B-A4B's text config (the released checkpoint's config.json), or the same layout at a
    CPU-friendly size."""
    rope = {SLIDING: RopeConfig(rope_type="default", theta=1e4),
            FULL: RopeConfig(rope_type="proportional", theta=1e6, partial_rotary_factor=0.25)}
    if tiny:
        layers = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(6))
        return ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=192, num_layers=6, num_attention_heads=4,
                           layer_types=layers, head_dims=tuple(64 if t == FULL else 32 for t in layers),
                           num_kv_heads=tuple(1 if t == FULL else 2 for t in layers), sliding_window=128, rope=rope,
                           num_experts=16, top_k_experts=4, moe_intermediate_size=64, canvas_length=64,
                           max_position_embeddings=8192, eos_token_ids=(1, 106, 50))
    layers = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(30))  # layers 5, 11, 17, 23, 29
    return ModelConfig(vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_layers=30, num_attention_heads=16,
                       layer_types=layers, head_dims=tuple(512 if t == FULL else 256 for t in layers),
                       num_kv_heads=tuple(2 if t == FULL else 8 for t in layers), sliding_window=1024, rope=rope,
                       num_experts=128, top_k_experts=8, moe_intermediate_size=704, canvas_length=256,
                       final_logit_softcapping=30.0, max_position_embeddings=262_144, eos_token_ids=(1, 106, 50))


def build_direct(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Our `DiffusionGemma(cfg)` with random weights allocated directly on `device` in `dtype` (never a float32 copy):
    built on the meta device, then every tensor allocated and filled in place, as the loader does. Matrices
    ~ N(0, 0.02); norm weights, router scales and layer scalars 1."""
    from dgemma_compile.model.backbone import DiffusionGemma

    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        x = torch.empty(t.shape, dtype=dtype, device=device)
        if x.dim() > 1:
            x.normal_(0.0, 0.02, generator=gen)
        else:
            x.fill_(1.0)
        state[name] = x
    model.load_state_dict(state, strict=True, assign=True)
    model.init_buffers(device)
    model.generation_config = GenerationConfig()
    model.requires_grad_(False)
    return model.eval()


def load_ours(spec: ModelSpec, device: torch.device, dtype: torch.dtype | None):
    """Our model for `spec` on `device` (checkpoint dtype when `dtype` is None; bf16 for direct builds)."""
    import dgemma_compile as dg

    if spec.has_checkpoint:
        return dg.load(spec.checkpoint, dtype=dtype, device=device)
    return build_direct(full_config(tiny=spec.direct == "full-tiny"), device, dtype or torch.bfloat16)


def load_transformers(spec: ModelSpec, device: torch.device, dtype: torch.dtype | None):
    """transformers' `DiffusionGemmaForBlockDiffusion` for a checkpoint spec (same weights as `load_ours`)."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    if not spec.has_checkpoint:
        raise ValueError(f"model {spec.name!r} has no checkpoint: transformers cannot run it")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(spec.checkpoint, dtype=dtype or "auto")
    return model.to(device).eval().requires_grad_(False)
