"""Frozen, validated configs read from a checkpoint's own JSON files.

`ModelConfig` is the text part of transformers' `DiffusionGemmaConfig` (config.json: `text_config` plus the
top-level `canvas_length`), flattened into per-layer tuples. `GenerationConfig` is `generation_config.json`
(including the nested `sampler_config`), with the reference defaults of
`DiffusionGemmaGenerationConfig._get_default_generation_params` where a key is absent or null.

Every invalid value raises `ConfigError` (a `ValueError`) naming the parameter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
DEFAULT_MAX_SEQ_LEN = 1024
"""Committed KV slots per row the generators preallocate unless told otherwise (`generate(max_seq_len=...)`,
`CompileOptions.max_seq_len`): fixed, never sized to a batch, so a row's numerics do not depend on its batch mates."""

# transformers' defaults for the per-layer-type RoPE (DiffusionGemmaTextConfig.__post_init__).
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


FLOAT32_MAX = 3.4028234663852886e38  # temperatures live in float32 tables


CONTEXT_LENGTH = "context_length_exceeded"
"""`ConfigError.code` of a prompt (and its budget of new tokens) beyond the model's context or a cache's slots: the
code OpenAI's API and vLLM answer such a request with."""


class ConfigError(ValueError):
    """An invalid configuration value. `ConfigError(param, problem, code=None)`: `param` names what is invalid (a
    parameter, or the file it was read from), `problem` says what is wrong with it; str() is "param: problem".
    `ConfigError(message)`: a problem naming no single parameter (`param` None). `code`: a kind callers map without
    reading the message (`CONTEXT_LENGTH`), or None. The HTTP layer maps `param` and `code` to its 400's fields and
    the CLI prints str(); nothing parses the message."""

    def __init__(self, param: object, problem: str | None = None, *, code: str | None = None):
        if problem is None:
            param, problem = None, str(param)
        self.param = None if param is None else str(param)
        self.problem, self.code = problem, code
        super().__init__(problem if self.param is None else f"{self.param}: {problem}")

    def __reduce__(self):  # pickles with its fields and attributes (a rank or a worker process may send it)
        return type(self), (self.param, self.problem), dict(self.__dict__)


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(name, msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """RoPE of one layer type. `proportional` rotates the first `partial_rotary_factor * head_dim / 2`
    frequency pairs of the whole head and leaves the rest unrotated (transformers
    `_compute_proportional_rope_parameters`); `default` rotates `partial_rotary_factor * head_dim` dims."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self) -> None:
        _require(self.rope_type in ROPE_TYPES, "rope_type", f"must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        _require(self.theta > 0, "rope_theta", f"must be > 0, got {self.theta}")
        _require(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor}")
        _require(self.factor > 0, "factor", f"must be > 0, got {self.factor}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Text backbone of DiffusionGemma. Per-layer tuples have `num_layers` entries."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    sliding_window: int
    rope: dict[str, RopeConfig]
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    attention_bias: bool = False
    max_position_embeddings: int = 131_072
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    tie_word_embeddings: bool = True
    """False: the checkpoint has its own `lm_head.weight` (the logits); the self-conditioning product still reads the
    input embeddings (transformers' DiffusionGemma). Released checkpoints are tied."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                     "sliding_window", "num_experts", "top_k_experts", "moe_intermediate_size", "canvas_length",
                     "max_position_embeddings"):
            v = getattr(self, name)
            _require(_is_int(v) and v > 0, name, f"must be a positive integer, got {v!r}")
        n = self.num_layers
        for name in ("layer_types", "head_dims", "num_kv_heads"):
            _require(len(getattr(self, name)) == n, name, f"must have num_layers={n} entries")
        for i, t in enumerate(self.layer_types):
            _require(t in LAYER_TYPES, f"layer_types[{i}]", f"must be one of {LAYER_TYPES}, got {t!r}")
            _require(t in self.rope, f"rope_parameters[{t!r}]", "missing")
        for i, (hd, kv) in enumerate(zip(self.head_dims, self.num_kv_heads)):
            _require(_is_int(hd) and hd > 0 and hd % 2 == 0, f"head_dim of layer {i}", f"must be a positive even integer, got {hd}")
            _require(_is_int(kv) and kv > 0 and self.num_attention_heads % kv == 0, f"num_key_value_heads of layer {i}",
                     f"must divide num_attention_heads={self.num_attention_heads}, got {kv}")
        for t in set(self.layer_types):
            dims = {(hd, kv) for lt, hd, kv in zip(self.layer_types, self.head_dims, self.num_kv_heads) if lt == t}
            _require(len(dims) == 1, f"per_layer_config ({t})", f"all {t} layers must share head_dim and kv heads, got {sorted(dims)}")
        _require(self.top_k_experts <= self.num_experts, "top_k_experts", f"must be <= num_experts={self.num_experts}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _require(self.final_logit_softcapping is None or self.final_logit_softcapping > 0, "final_logit_softcapping", "must be > 0 or null")
        for name in ("pad_token_id", "bos_token_id"):
            v = getattr(self, name)
            _require(_is_int(v) and 0 <= v < self.vocab_size, name, f"must be a token id in [0, {self.vocab_size}), got {v!r}")
        for v in self.eos_token_ids:
            _require(_is_int(v) and 0 <= v < self.vocab_size, "eos_token_id", f"must be token ids in [0, {self.vocab_size}), got {v!r}")

    def layer_kind(self, layer_type: str) -> tuple[int, int]:
        """(head_dim, num_kv_heads) shared by every layer of `layer_type`."""
        i = self.layer_types.index(layer_type)
        return self.head_dims[i], self.num_kv_heads[i]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from a transformers `DiffusionGemmaConfig` dict. Raises `ConfigError` naming `source`."""
        try:
            return cls._from_hf_dict(cfg)
        except ConfigError as e:
            raise ConfigError(source, str(e)) from None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ConfigError(source, f"malformed DiffusionGemma config ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        mt = cfg.get("model_type")
        if mt != "diffusion_gemma" and "DiffusionGemmaForBlockDiffusion" not in archs:
            raise ConfigError("model_type", f"not a DiffusionGemma checkpoint (model_type={mt!r}, architectures={archs})")
        t = cfg.get("text_config")
        _require(isinstance(t, dict), "text_config", "missing")
        get = lambda k, d=None: d if t.get(k) is None else t[k]  # noqa: E731 - absent or null -> transformers default
        _require(get("use_bidirectional_attention") in (None, "vision"), "use_bidirectional_attention",
                 f"only null or 'vision' (causal text encoder) is supported, got {t.get('use_bidirectional_attention')!r}")
        n = get("num_hidden_layers", 30)
        layer_types = list(get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        if layer_types and layer_types[-1] != FULL:  # transformers forces the last layer to full attention
            layer_types[-1] = FULL
        head_dim, kv_heads = get("head_dim", 256), get("num_key_value_heads", 4)
        per_layer = get("per_layer_config")
        if per_layer is None:  # transformers derives it from global_head_dim / num_global_key_value_heads
            over = {"head_dim": get("global_head_dim", 512)}
            if get("num_global_key_value_heads") is not None:
                over["num_key_value_heads"] = get("num_global_key_value_heads")
            per_layer = {i: over for i, lt in enumerate(layer_types) if lt == FULL}
        per_layer = {int(k): v for k, v in per_layer.items()}
        for k in per_layer:
            _require(0 <= k < n, "per_layer_config", f"layer index {k} outside [0, {n})")
        head_dims = tuple(per_layer.get(i, {}).get("head_dim", head_dim) for i in range(n))
        num_kv = tuple(per_layer.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(n))
        rope_params = get("rope_parameters") or DEFAULT_ROPE
        rope = {}
        for lt in set(layer_types):
            p = rope_params.get(lt)
            _require(isinstance(p, dict), f"rope_parameters[{lt!r}]", "missing")
            rope[lt] = RopeConfig(rope_type=p.get("rope_type", "default"), theta=float(p["rope_theta"]),
                                  partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
                                  factor=float(p.get("factor", 1.0)))
        act = get("hidden_activation", "gelu_pytorch_tanh")
        _require(act == "gelu_pytorch_tanh", "hidden_activation", f"only gelu_pytorch_tanh is supported, got {act!r}")
        _require(get("num_experts") is not None, "num_experts", "missing: DiffusionGemma always has MoE layers")
        for name in ("attn_logit_softcapping", "query_pre_attn_scalar"):  # Gemma 2/3 score transforms
            _require(get(name) is None, name, "not supported: DiffusionGemma's attention applies no score transform "
                     "(scale 1.0 on RMS-normed q/k, no attention softcap; transformers' DiffusionGemma attention)")
        eos = get("eos_token_id", 1)
        return cls(
            vocab_size=get("vocab_size", 262_144), hidden_size=get("hidden_size", 2304),
            intermediate_size=get("intermediate_size", 9216), num_layers=n,
            num_attention_heads=get("num_attention_heads", 8), layer_types=tuple(layer_types),
            head_dims=head_dims, num_kv_heads=num_kv, sliding_window=get("sliding_window", 512), rope=rope,
            num_experts=get("num_experts"), top_k_experts=get("top_k_experts"),
            moe_intermediate_size=get("moe_intermediate_size"),
            canvas_length=cfg.get("canvas_length") if cfg.get("canvas_length") is not None else 256,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=t.get("final_logit_softcapping", 30.0),
            attention_bias=bool(get("attention_bias", False)),
            max_position_embeddings=get("max_position_embeddings", 131_072),
            pad_token_id=get("pad_token_id", 0), bos_token_id=get("bos_token_id", 2),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (eos,),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Block-diffusion generation parameters (transformers `DiffusionGemmaGenerationConfig`).

    - `max_new_tokens`: exact budget of generated tokens per request (the reference rounds up to whole canvases).
    - `max_denoising_steps` (N): denoise steps per block at most; step n = N..1 uses temperature
      T = t_min + (t_max - t_min) * n / N (`LinearTemperatureScheduleLogitsProcessor`); t_min == t_max is a constant
      temperature (transformers refuses it); T below float32's smallest normal (0 included) is greedy.
    - `entropy_bound`: accept the lowest-entropy positions while (cumulative entropy - own entropy) <= bound
      (`EntropyBoundSampler.accept_canvas`, arXiv 2505.24857).
    - `stability_threshold`, `confidence_threshold`: stop a block when the argmax canvas equals the one of each of
      the previous `stability_threshold` steps and the mean entropy of the scaled logits is below the threshold
      (`StableAndConfidentStoppingCriteria`); `stop_early=False` disables it (the vLLM-style fixed-steps run).
    - `eos_token_ids`, `pad_token_id`: None means "take the model's".
    - `ignore_eos`: run to the token budget, eos ids kept as ordinary tokens (vLLM's sampling extension; per
      request, not structural: the end rule reads it per row, `finish.py`).
    """

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    stop_early: bool = True
    eos_token_ids: tuple[int, ...] | None = None
    pad_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if _is_int(self.eos_token_ids):  # one id is a common spelling
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        _require(isinstance(self.stop_early, bool), "stop_early", f"must be a bool, got {self.stop_early!r}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        for name in ("max_new_tokens", "max_denoising_steps"):
            v = getattr(self, name)
            _require(_is_int(v) and v > 0, name, f"must be a positive integer, got {v!r}")
        _require(_is_int(self.stability_threshold) and self.stability_threshold >= 0, "stability_threshold",
                 f"must be an integer >= 0, got {self.stability_threshold!r}")
        for name in ("entropy_bound", "confidence_threshold"):  # float32 in the per-row inputs: must fit
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     and 0 < v <= FLOAT32_MAX, name, f"must be a number in (0, {FLOAT32_MAX:.4g}], got {v!r}")
        for name in ("t_min", "t_max"):  # stored as float32 in the per-row tables: must fit
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     and 0 <= v <= FLOAT32_MAX, name, f"must be a number in [0, {FLOAT32_MAX:.4g}], got {v!r}")
        # t_min == t_max (a constant temperature) is allowed: a deliberate difference from transformers.
        _require(self.t_max >= self.t_min, "t_max", f"must be >= t_min (got t_max={self.t_max}, t_min={self.t_min})")
        if self.eos_token_ids is not None:
            _require(isinstance(self.eos_token_ids, (tuple, list)) and all(_is_int(e) and e >= 0 for e in self.eos_token_ids),
                     "eos_token_id",
                     f"must be non-negative token ids, got {self.eos_token_ids!r}")
        if self.pad_token_id is not None:
            _require(_is_int(self.pad_token_id) and self.pad_token_id >= 0, "pad_token_id",
                     f"must be a non-negative token id, got {self.pad_token_id!r}")

    def with_temperature(self, temperature: float) -> "GenerationConfig":
        """What one user-facing temperature T means (the CLI's --temperature, the server's `temperature`): T scales
        the whole schedule, t_min' = T * t_min and t_max' = T * t_max, so T = 1 keeps the checkpoint's schedule
        (its tuned default), T < 1 sharpens every step proportionally, and T = 0 is greedy decoding (argmax tokens,
        every position accepted; see `sampler.GREEDY_BELOW`).

        Raises:
            ConfigError: T negative, not finite, not a number, or scaling t_max beyond float32 (names `temperature`).
        """
        ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and math.isfinite(temperature)
        _require(ok and temperature >= 0, "temperature", f"must be a finite number >= 0, got {temperature!r}")
        _require(self.t_max * temperature <= FLOAT32_MAX, "temperature",
                 f"{temperature!r} scales t_max={self.t_max} beyond float32's range")
        return self.replace(t_min=self.t_min * temperature, t_max=self.t_max * temperature)

    def replace(self, **changes: Any) -> "GenerationConfig":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def resolved(self, model: ModelConfig) -> "GenerationConfig":
        """Fill eos/pad from the model and check every token id against its vocabulary."""
        eos = self.eos_token_ids if self.eos_token_ids is not None else model.eos_token_ids
        pad = self.pad_token_id if self.pad_token_id is not None else model.pad_token_id
        for e in eos:
            _require(e < model.vocab_size, "eos_token_id", f"{e} is outside the vocabulary [0, {model.vocab_size})")
        _require(pad < model.vocab_size, "pad_token_id", f"{pad} is outside the vocabulary [0, {model.vocab_size})")
        return dataclasses.replace(self, eos_token_ids=tuple(eos), pad_token_id=pad)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "generation_config.json") -> "GenerationConfig":
        """Read a transformers generation_config dict; absent or null keys take the reference defaults."""
        try:
            kw: dict[str, Any] = {}
            for key in ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
                        "confidence_threshold", "pad_token_id"):
                if d.get(key) is not None:
                    kw[key] = d[key]
            sampler = d.get("sampler_config")
            if sampler is not None:
                _require(isinstance(sampler, dict), "sampler_config", f"must be an object, got {sampler!r}")
                cls_name = sampler.get("_cls_name", "EntropyBoundSamplerConfig")
                _require(cls_name == "EntropyBoundSamplerConfig", "sampler_config._cls_name",
                         f"only EntropyBoundSamplerConfig is supported, got {cls_name!r}")
                if sampler.get("entropy_bound") is not None:
                    kw["entropy_bound"] = sampler["entropy_bound"]
            eos = d.get("eos_token_id")
            if eos is not None:
                kw["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(source, str(e)) from None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from `path`; raises `ConfigError` naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(path, "file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(path, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(path, "expected a JSON object")
    return data
