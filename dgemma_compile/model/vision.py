"""The vision encoder of a multimodal DiffusionGemma checkpoint: image patches -> soft tokens in the text width.

transformers' `DiffusionGemmaEncoderModel.get_image_features`: the vision tower (`vision_tower`, a Gemma4 vision
model built from config.json's `vision_config`) turns one image's patches into pooled soft tokens, and the multimodal
embedder (`embed_vision`: RMSNorm without weight, then a bias-free Linear to the text hidden size) maps them into the
text model's embedding space. The tower is transformers' own `Gemma4VisionModel` (a well-kept module: it runs once
per image at prefill, outside the denoise loop, so nothing of it is compiled or fused here); the embedder is ours.

`VisionConfig` holds what the text side needs of a multimodal checkpoint (the image token ids, whether image groups
attend bidirectionally); `VisionEncoder` is the module (`DiffusionGemma.vision`, None for a text-only checkpoint or
`load(..., vision=False)`).

Legend: P patches of one image (padded: `position_ids` (-1, -1)), N its soft tokens, Dv the tower's width, D the text
hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import ConfigError


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The multimodal part of config.json.

    image_token_id: the soft-token placeholder id (258880 in the release); boi_token_id / eoi_token_id: the ids the
    processor writes around each image; bidirectional_groups: `text_config.use_bidirectional_attention == "vision"`
    (each contiguous run of image tokens attends bidirectionally within itself in the encoder; False: causal, as
    transformers then does); tower: the `vision_config` dict, as transformers' `Gemma4VisionConfig` reads it."""

    image_token_id: int
    boi_token_id: int | None
    eoi_token_id: int | None
    bidirectional_groups: bool
    tower: dict[str, Any]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "VisionConfig | None":
        """None when config.json has no `vision_config` (a text-only checkpoint); transformers' defaults for absent
        ids. Raises `ConfigError` naming `source` and the field for a vision config of another model type or an id
        that is not an integer."""
        tower = cfg.get("vision_config")
        if tower is None:
            return None
        if not isinstance(tower, dict) or tower.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ConfigError(source, "vision_config: only a gemma4_vision tower is supported, got "
                              f"{tower.get('model_type') if isinstance(tower, dict) else tower!r}")
        ids = {}
        for name, default in (("image_token_id", 258_880), ("boi_token_id", 255_999), ("eoi_token_id", 258_882)):
            v = cfg.get(name, default)
            if (v is not None or name == "image_token_id") and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(source, f"{name}: must be a non-negative token id, got {v!r}")
            ids[name] = v
        text = cfg.get("text_config") or {}
        return cls(**ids, bidirectional_groups=text.get("use_bidirectional_attention") == "vision", tower=dict(tower))

    def unusable(self, vocab_size: int) -> str | None:
        """Why prompts of this checkpoint cannot hold images (an image token id outside the text vocabulary, as in
        checkpoints that carry a tower but were trained on text only), or None."""
        if self.image_token_id >= vocab_size:
            return f"image_token_id {self.image_token_id} is outside the vocabulary [0, {vocab_size})"
        return None


class MultimodalEmbedder(nn.Module):
    """Soft tokens [..., Dv] -> [..., D]: RMSNorm without weight (float32, eps from the vision config), then
    `embedding_projection` (transformers' DiffusionGemmaMultimodalEmbedder)."""

    def __init__(self, vision_dim: int, text_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(vision_dim, text_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(x)
        return self.embedding_projection(normed)


class VisionEncoder(nn.Module):
    """The tower and the embedder of one checkpoint. `features(pixel_values, position_ids)` gives one image's soft
    tokens in the text width. Parameters: `tower.*` (checkpoint `model.encoder.vision_tower.*`) and
    `embedder.embedding_projection.weight` (`model.encoder.embed_vision.embedding_projection.weight`)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        from transformers import Gemma4VisionConfig, Gemma4VisionModel

        self.config = config
        self.hf_config = Gemma4VisionConfig(**{k: v for k, v in config.tower.items()
                                               if k not in ("transformers_version", "architectures")})
        self.tower = Gemma4VisionModel(self.hf_config)
        dim = getattr(self.hf_config, "output_proj_dims", None) or self.hf_config.hidden_size
        self.embedder = MultimodalEmbedder(dim, text_hidden_size, self.hf_config.rms_norm_eps)

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 x patch_size^2 (768 for patches of 16 px)."""
        return 3 * self.hf_config.patch_size ** 2

    @property
    def pooling(self) -> int:
        """Patches per soft token: pooling_kernel_size^2 (9 in the release)."""
        return self.hf_config.pooling_kernel_size ** 2

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the tower's non-persistent buffers (its rotary frequencies) on `device`, after building it on
        the meta device: a fresh module of the same class from the vision config. Raises RuntimeError when a buffer is
        left on the meta device (a tower this code does not know how to rebuild; never silently random)."""
        for name, mod in list(self.tower.named_modules()):
            persistent = set(mod.state_dict(keep_vars=True)) if mod._buffers else set()
            if any(b is not None and k not in persistent for k, b in mod._buffers.items()):
                with torch.device(device):
                    fresh = type(mod)(self.hf_config)
                for k, b in fresh._buffers.items():
                    if k not in persistent and b is not None:
                        mod._buffers[k] = b.to(device)
        if torch.device(device).type == "meta":
            return
        left = [n for n, b in self.tower.named_buffers() if b.is_meta]
        if left:
            raise RuntimeError(f"vision tower: buffers {left} could not be rebuilt after loading")

    def soft_tokens(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> int:
        """The soft tokens `features` makes of one image (its real patches / pooling), without running the tower.

        Raises:
            ConfigError: shapes or dtypes other than `features` takes (names `pixel_values` / `position_ids`).
        """
        P = pixel_values.shape[0] if isinstance(pixel_values, torch.Tensor) and pixel_values.dim() == 2 else -1
        if P <= 0 or pixel_values.shape[1] != self.patch_dim or not pixel_values.is_floating_point():
            got = (f"{pixel_values.dtype} {list(pixel_values.shape)}" if isinstance(pixel_values, torch.Tensor)
                   else type(pixel_values).__name__)
            raise ConfigError("pixel_values", f"must be a float tensor [patches, {self.patch_dim}], got {got}")
        if (not isinstance(position_ids, torch.Tensor) or position_ids.shape != (P, 2)
                or position_ids.dtype not in (torch.int64, torch.int32)):
            got = (f"{position_ids.dtype} {list(position_ids.shape)}" if isinstance(position_ids, torch.Tensor)
                   else type(position_ids).__name__)
            raise ConfigError("position_ids", f"must be an integer tensor [{P}, 2] (one (x, y) per patch), got {got}")
        if P % self.pooling:
            raise ConfigError("pixel_values", f"{P} patches, not a multiple of the pooling ({self.pooling})")
        return int((position_ids != -1).any(-1).sum()) // self.pooling

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One image's soft tokens: pixel_values float [P, 3 * patch^2] (the processor's rescaled patches), position_ids
        int64 [P, 2] (x, y per patch, (-1, -1) for padding) -> [N, D] in the model dtype, N = the image's real soft
        tokens (`soft_tokens`, at most P / pooling). Images run one at a time, so an image's features never depend on
        another's.

        Raises:
            ConfigError: shapes or dtypes other than those above (names `pixel_values` / `position_ids`).
        """
        self.soft_tokens(pixel_values, position_ids)
        dtype, dev = self.embedder.embedding_projection.weight.dtype, self.embedder.embedding_projection.weight.device
        out = self.tower(pixel_values=pixel_values[None].to(device=dev, dtype=dtype),
                         pixel_position_ids=position_ids[None].to(device=dev, dtype=torch.long))
        return self.embedder(out.last_hidden_state)  # [N, D]: the tower strips padding soft tokens
