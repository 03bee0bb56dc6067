"""The DiffusionGemma text backbone (Gemma4 MoE) in plain eager PyTorch.

One set of layers runs in two modes:
- encoder (`encode`): causal attention over the cached context plus the new tokens; writes the KV cache. Used for
  prefill and for committing a finished canvas. Plain token embeddings.
- denoiser (`denoise`): bidirectional attention over the whole canvas plus the cached context; reads the cache and
  never commits to it. Adds self-conditioning; returns float32 soft-capped logits.
The model is only its forward: the checked passes `encode` / `denoise` live with the uniform plans' other callers
(`forwards.py`, public as `dgemma_compile.encode` / `denoise`); every step and pass calls `forward_plan` (rows in any
mix of modes, under a `plan.ForwardPlan` built outside the model), `logits` and `self_conditioning_embedding`.

Numerics follow transformers' `modeling_diffusion_gemma.py` (the test oracle; its `configuration_diffusion_gemma.py`
for the model's fields).
No compile concerns live here.

Legend: B batch, T block tokens, C canvas, S cache slots, D hidden, H query heads, Hkv kv heads, Dh head dim,
V vocab, E experts, K experts per token, N flattened tokens (B*T).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels as ops  # noqa: F401  (registers torch.ops.dgemma.*)
from ..kernels import MOE_IMPLS
from ..kernels.moe.formats import NONE, ExpertFormat
from ..kernels.moe.op import run_eager
from .checkpoint_info import CheckpointInfo
from .config import SLIDING, GenerationConfig, ModelConfig, RopeConfig
from .kv_cache import KVCache, new_cache
from .masks import flex_block_attention
from .plan import ForwardPlan
from .vision import VisionConfig, VisionEncoder

ATTENTION_BACKENDS = ("flex", "dense")


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps)^-0.5 in float32: an RMSNorm before its weight and its cast back (`RMSNorm.scale`), so
    that norms of one input share it. Eagerly in float32, torch's `rms_norm` kernel: the same bits (checked over
    shapes, tests/step/test_eager_step.py) in one call instead of five ops."""
    if x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    xf = x.float()
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* weight], computed in float32, cast back (Gemma4: weight, not 1 + weight)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and not torch.compiler.is_compiling():
            # eagerly, torch's own kernel: the same bits in float32 (tests/step/test_eager_step.py) in one call
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.scale(rms_normalize(x, self.eps), x)

    def scale(self, normalized: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This norm of `x` from `normalized` = `rms_normalize(x, self.eps)` (shared by several norms of x): times the
        weight in float32, cast back to x's dtype. Equal to `self(x)` bit for bit."""
        if x.dtype == torch.float32 and (self.weight is None or self.weight.dtype == torch.float32):
            return normalized if self.weight is None else normalized * self.weight  # (the casts would be no-ops)
        out = normalized if self.weight is None else normalized * self.weight.float()
        return out.type_as(x)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [Dh/2 or fewer] (transformers `compute_default_rope_parameters` and
    `_compute_proportional_rope_parameters`). Proportional pads with zeros: those pairs stay unrotated."""
    if rope.rope_type == "default":
        dim = int(head_dim * rope.partial_rotary_factor)
        return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    rope_angles = int(rope.partial_rotary_factor * head_dim // 2)
    rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([rotated, torch.zeros(head_dim // 2 - rope_angles)])
    return inv / rope.factor


def rope_cos_sin(inv_freq: torch.Tensor, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions_BT[..., None].float() * inv_freq.float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BTHD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, :, None, :], sin_BTD[:, :, None, :]
    half = x_BTHD.shape[-1] // 2
    rotated = torch.cat([-x_BTHD[..., half:], x_BTHD[..., :half]], dim=-1)
    return x_BTHD * cos + rotated * sin


def dense_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, mask_BTS: torch.Tensor) -> torch.Tensor:
    """Reference attention, scale 1.0 (q/k are RMS-normed), softmax in float32, GQA by repeating kv heads."""
    rep = q_BHTD.shape[1] // k_BHSD.shape[1]
    k = k_BHSD.repeat_interleave(rep, dim=1)
    v = v_BHSD.repeat_interleave(rep, dim=1)
    scores = q_BHTD @ k.transpose(-1, -2)
    scores = scores.masked_fill(~mask_BTS[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHTD.dtype)
    return probs @ v


def eager_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, mask_BTS: torch.Tensor
                    ) -> torch.Tensor:
    """FlexAttention's own eager math (torch's `math_attention`: GQA by repeating kv heads, scores in float32, masked
    to -inf, softmax, probabilities in the input dtype times V) on the dense mask of a block mask
    (`masks.dense_mask`): bitwise what `masks.flex_block_attention` computes uncompiled, without its vmap over the
    mask_mod (~9 ms a call at the demo's sizes; this, ~0.1 ms). What a flex model's uncompiled step runs
    (`plan.PlanBuffers.eager_plan`). Scale 1.0. Every query sees at least one key in these masks (its own slot), so
    softmax never meets a fully masked row (FlexAttention's `_safe_softmax` would zero it)."""
    G = q_BHTD.shape[1] // k_BHSD.shape[1]
    k, v = k_BHSD.repeat_interleave(G, dim=1), v_BHSD.repeat_interleave(G, dim=1)
    dtype = q_BHTD.dtype
    if dtype in (torch.float32, torch.float64):  # (the casts would be no-ops)
        scores = q_BHTD @ k.transpose(-2, -1)
        return torch.softmax(torch.where(mask_BTS[:, None], scores, -float("inf")), dim=-1) @ v
    scores = q_BHTD.float() @ k.float().transpose(-2, -1)
    probs = torch.softmax(torch.where(mask_BTS[:, None], scores, -float("inf")), dim=-1)
    return probs.to(dtype) @ v


class Attention(nn.Module):
    """Gemma4 attention: q/k RMSNorm with weight, v RMSNorm without, RoPE after the norms, scaling 1.0.
    Full-attention layers have no v_proj: V is the k_proj output (before k_norm and RoPE)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.head_dim = cfg.head_dims[layer]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_kv_heads[layer]
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias) if cfg.layer_types[layer] == SLIDING else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x_BTD, cos, sin, cache: KVCache, layer: int, mask, slots_BT, kernel_options=None,
                flex: bool = False):
        """`flex`: the model attends with FlexAttention, so a dense mask is an uncompiled step's, run with
        FlexAttention's eager math (`eager_attention`, bitwise); else the dense reference (`dense_attention`)."""
        B, T, _ = x_BTD.shape
        q = self.q_norm(self.q_proj(x_BTD).view(B, T, -1, self.head_dim))
        k_raw = self.k_proj(x_BTD).view(B, T, -1, self.head_dim)
        if self.v_proj is not None:
            k, v = self.k_norm(k_raw), self.v_norm(self.v_proj(x_BTD).view(B, T, -1, self.head_dim))
        else:  # V is k_raw: k_norm and v_norm share its normalization (v_norm has no weight)
            normalized = rms_normalize(k_raw, self.k_norm.eps)
            k, v = self.k_norm.scale(normalized, k_raw), self.v_norm.scale(normalized, k_raw)
        if torch.compiler.is_compiling():
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # uncompiled, one rotation over q's and k's heads together: elementwise, the same bits in half the ops
            H = q.shape[2]
            qk = apply_rope(torch.cat([q, k], dim=2), cos, sin)
            q, k = qk[:, :, :H], qk[:, :, H:]
        cache.write_block(layer, k.transpose(1, 2), v.transpose(1, 2), slots_BT)
        keys, values = cache.layer_kv(layer, T)  # [B, Hkv, S+T, Dh]: the static or paged cache's view
        if isinstance(mask, torch.Tensor):  # dense mask [B, T, S+T]: the reference's, or an eager step's
            out = (eager_attention if flex else dense_attention)(q.transpose(1, 2), keys, values, mask)
        else:  # FlexAttention BlockMask
            out = flex_block_attention(q.transpose(1, 2).contiguous(), keys, values, mask,
                                       kernel_options=kernel_options)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    """Routes on the raw residual: RMSNorm-without-weight(h) * scale * D^-0.5 -> proj -> fp32 softmax -> top-k ->
    renormalise -> * per_expert_scale. Returns weights [N, K] (float32) and expert ids [N, K]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k_experts
        self.root = cfg.hidden_size ** -0.5
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, h_ND, normalized: torch.Tensor | None = None):
        """`normalized`: `rms_normalize(h_ND, self.norm.eps)` when the caller has it (the layer's other norms of h
        share it), else computed here."""
        normed = self.norm(h_ND) if normalized is None else self.norm.scale(normalized, h_ND)
        probs = torch.softmax(self.proj(normed * self.scale * self.root), dim=-1, dtype=torch.float32)
        w_NK, idx_NK = torch.topk(probs, k=self.top_k, dim=-1)
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        return w_NK * self.per_expert_scale[idx_NK], idx_NK


class ExpertProjection(nn.Module):
    """One projection of every routed expert, [E, N, K] (N outputs, K inputs), stored in the layout of its `format`
    (an `kernels.moe.formats.ExpertFormat`: the tensors, dtypes and shapes, and how they dequantize), handed to
    `dgemma::moe_experts` as (weight, scales) -- plain tensors, never a tensor subclass (a torchao tensor passed into
    a custom op raises). The weight is `weight`, the scales the buffers `weight_scale` and `weight_global_scale`
    (None where the format has fewer)."""

    def __init__(self, num_experts: int, out_dim: int, in_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_dim, in_dim))
        self.register_buffer("weight_scale", None)
        self.register_buffer("weight_global_scale", None)
        self.format: ExpertFormat = NONE

    @property
    def quant(self) -> str:
        """The format's name (`kernels.moe.op.EXPERT_QUANTS`): the op's `quant` argument."""
        return self.format.name

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K): the dequantized weight's shape."""
        return self.format.dequantized_shape(tuple(self.weight.shape))

    def scales(self) -> list[torch.Tensor]:
        """The scale tensors `dgemma::moe_experts` takes beside `weight`: [], [weight_scale] or [weight_scale,
        weight_global_scale]."""
        return [t for t in (self.weight_scale, self.weight_global_scale) if t is not None]

    def set_quantized(self, format: ExpertFormat, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_global_scale: torch.Tensor | None = None) -> None:
        """Replace the weight by its quantized form in `format`'s layout (`ExpertFormat.check`, against the current
        (E, N, K)). Raises ValueError naming the tensor for an unquantized `format`, a wrong shape or dtype; nothing
        changes then."""
        if not format.quantized:
            raise ValueError(f"expert weights: set_quantized takes a quantized format, got {format.name!r}")
        format.check(self.shape, weight, [weight_scale] + ([] if weight_global_scale is None
                                                             else [weight_global_scale]))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_global_scale", weight_global_scale)
        self.format = format

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, quant={self.quant}"


class Experts(nn.Module):
    """E gated experts: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I], each an `ExpertProjection`,
    run by one custom op (`kernels.moe_experts`) whose `impl` names the implementation: "loop" (transformers' order, the
    reference), "grouped", "dense" or "gathered" (see `kernels/moe/op.py`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = ExpertProjection(E, 2 * I, D)
        self.down_proj = ExpertProjection(E, D, I)

    @property
    def quant(self) -> str:
        """The experts' format (`kernels.moe.op.EXPERT_QUANTS`), one for both projections (the op takes one); ValueError if
        they differ."""
        if self.gate_up_proj.format != self.down_proj.format:
            raise ValueError(f"experts: gate_up_proj is {self.gate_up_proj.quant!r} but down_proj is "
                             f"{self.down_proj.quant!r}; dgemma::moe_experts takes one format for both")
        return self.gate_up_proj.quant

    def forward(self, x_ND, w_NK, idx_NK, impl: str):
        gu, down = self.gate_up_proj, self.down_proj
        # uncompiled on CPU, the op's own function without the custom op's dispatch (`kernels.moe.op.run_eager`); compiled,
        # the op (decomposed or kept opaque, `kernels.moe.op.moe_decompositions`)
        run = run_eager if x_ND.device.type == "cpu" and not torch.compiler.is_compiling() else \
            torch.ops.dgemma.moe_experts
        return run(x_ND, w_NK, idx_NK, gu.weight, gu.scales(), down.weight, down.scales(), impl, self.quant)


class Layer(nn.Module):
    """Gemma4 MoE layer: x + post_attn_norm(attn(input_norm(x))), then
    h + post_ffn_norm(post_ffn_norm_1(MLP(pre_ffn_norm(h))) + post_ffn_norm_2(MoE(pre_ffn_norm_2(h)))) with the
    router reading the raw h, all times the mode's layer_scalar (the checkpoint keeps encoder and decoder ones)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.layer_type = cfg.layer_types[layer]
        self.self_attn = Attention(cfg, layer)
        self.mlp = GatedMLP(D, cfg.intermediate_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, RMSNorm(D, eps))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        self.register_buffer("decoder_layer_scalar", torch.ones(1))

    def forward(self, x_BTD, cos, sin, cache, mask_BTS, plan: ForwardPlan, moe_impl: str, flex: bool = False):
        attn = self.self_attn(self.input_layernorm(x_BTD), cos, sin, cache, self.layer, mask_BTS, plan.slots,
                              plan.kernel_options.get(self.layer_type), flex)
        h = x_BTD + self.post_attention_layernorm(attn)
        # the three norms of h (the dense MLP's, the router's and the experts') share one normalization
        normalized = rms_normalize(h, self.router.norm.eps)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm.scale(normalized, h)))
        h_ND, n_ND = h.reshape(-1, h.shape[-1]), normalized.reshape(-1, h.shape[-1])
        w_NK, idx_NK = self.router(h_ND, n_ND)
        moe = self.experts(self.pre_feedforward_layernorm_2.scale(n_ND, h_ND), w_NK, idx_NK, moe_impl).reshape(h.shape)
        h = h + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(moe))
        return h * torch.where(plan.encoder_tokens[..., None], self.encoder_layer_scalar, self.decoder_layer_scalar)


class SelfConditioning(GatedMLP):
    """out = RMSNorm-without-weight(embeds + gated_MLP(RMSNorm(soft))) (transformers DiffusionGemmaSelfConditioning)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)

    def forward(self, embeds_BCD, soft_BCD):
        return self.post_norm(embeds_BCD + super().forward(self.pre_norm(soft_BCD)))


class DiffusionGemma(nn.Module):
    """DiffusionGemma's text model: shared layers, tied embeddings/lm_head, self-conditioning.

    `window_kind` selects the sliding-window semantics of denoise passes: "anchored" (the reference, default) or
    "symmetric" (|q - k| <= W); see `masks.py`. `attention` selects FlexAttention on block masks ("flex", the
    default: one code path for eager, compiled, CPU and GPU) or softmax attention on dense masks ("dense", the test
    reference). `moe_impl` is the default implementation of the routed experts (one of `kernels.MOE_IMPLS`; "loop",
    transformers' summation order, by default); the forward calls take a `moe_impl` that overrides it per call.
    `vision` (a `vision.VisionConfig`, multimodal checkpoints) adds `self.vision`, the vision tower and embedder
    (`vision.VisionEncoder`; None without): it runs only on prompts with images (`images.py`), never in a step.
    """

    def __init__(self, config: ModelConfig, *, window_kind: str = "anchored", attention: str = "flex",
                 moe_impl: str = "loop", vision: "VisionConfig | None" = None):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        if moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
        if window_kind not in ("anchored", "symmetric"):
            raise ValueError(f"window_kind must be 'anchored' or 'symmetric', got {window_kind!r}")
        self.config = config
        self.window_kind = window_kind
        self.attention = attention
        self.moe_impl = moe_impl
        self.generation_config = GenerationConfig()  # the loader sets the checkpoint's (transformers' attribute)
        self.checkpoint = CheckpointInfo()  # where the weights came from and how they are held (loader, quant)
        # nn.Embedding's N(0, 1) init, except under the loader's `torch.device("meta")`: there is nothing to fill,
        # and torch's meta `normal_` is a decomposition that imports Dynamo and Inductor (about 2 s `load` need not pay)
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size) if meta else None)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)
        self.sc_embedding: nn.Linear | None = None  # `quant.quantize`: the embeddings as a [V -> D] projection
        self.tensor_parallel = None  # `parallel.shard`: the rank's `parallel.shard.TensorParallel`
        self.vision: VisionEncoder | None = VisionEncoder(vision, config.hidden_size) if vision is not None else None
        self.init_buffers(self.embed_tokens.weight.device)

    def init_buffers(self, device: torch.device | str) -> None:
        """(Re)compute the non-persistent buffers (embedding scale, RoPE frequencies) on `device`; used after
        building the model on the meta device."""
        cfg = self.config
        # on the meta device (the loader's build, redone on the real device after loading) the frequencies are computed
        # on the CPU: arithmetic on meta tensors runs torch's decompositions, which import Dynamo (about 2 s)
        meta = torch.device(device).type == "meta"
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, device=device), persistent=False)
        for lt in sorted(set(cfg.layer_types)):
            head_dim, _ = cfg.layer_kind(lt)
            with torch.device("cpu") if meta else contextlib.nullcontext():
                inv_freq = rope_inv_freq(cfg.rope[lt], head_dim)
            self.register_buffer(f"inv_freq_{lt}", inv_freq.to(device), persistent=False)
        if self.vision is not None:
            self.vision.init_buffers(device)

    # ----- public API -------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def expert_quant(self) -> str:
        """The routed experts' weight format (`kernels.moe.op.EXPERT_QUANTS`): "none" unless quantized."""
        return self.layers[0].experts.quant

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_shard(self):
        """Under tensor parallel, this rank's slice of the vocabulary (`kernels.sample.vocab_parallel.VocabShard`), held by the
        sharded lm_head it slices (`parallel.vocab.VocabParallelHead.shard`: `parallel.shard` makes the lm_head one
        whenever it sets `tensor_parallel`); None in one process."""
        return None if self.tensor_parallel is None else self.lm_head.shard

    def new_cache(self, batch_size: int, max_seq_len: int, block_size: int | None = None) -> KVCache:
        """A zeroed static cache for `batch_size` rows of up to `max_seq_len` committed tokens each.
        `block_size` (default: the canvas length) bounds the tokens one forward processes; longer prompts are
        encoded in chunks of it."""
        shapes = [(self.config.num_kv_heads[i], self.config.head_dims[i]) for i in range(self.config.num_layers)]
        return new_cache(batch_size=batch_size, max_seq_len=max_seq_len,
                         block_size=block_size or self.config.canvas_length, layer_shapes=shapes,
                         dtype=self.dtype, device=self.device)

    # ----- the forward entry points (unchecked, no host synchronisation: what the steps call) -------------------
    def forward_plan(self, ids_BT: torch.Tensor, cache: KVCache, plan: ForwardPlan,
                     self_conditioning: torch.Tensor | None = None, moe_impl: str | None = None,
                     input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of rows in different modes (`plan.py`): encoder rows (prefill chunk or commit) embed their
        ids and commit their real tokens; denoise rows take the self-conditioned embedding of their canvas, whose
        signal is `self_conditioning` [B, T', D] (model dtype: the soft embedding of the previous step's
        probabilities, `self_conditioning_embedding`) where `plan.self_conditioning`, zero elsewhere and without it
        (a block's first step); idle rows only pass through. T' <= T: a fused mixed plan's denoise rows hold their
        canvas in the first T' tokens; the signal is zero after them. Advances `cache.lengths` by `plan.commit`.
        Returns the final-norm hidden states [B, T, D] (`logits()` for the denoise rows). The model builds no plan:
        callers do (`plan.build_plan`, `plan.PlanBuffers`; `forwards.py` for the uniform passes). `input_embeds`
        [B, T, D] (model dtype): the input embeddings of an encoder plan in place of embedding `ids_BT` (a prompt's
        image soft tokens scattered into its placeholder positions, `images.embed_with_images`)."""
        embeds = self.embed(ids_BT) if input_embeds is None else input_embeds
        B, T, D = embeds.shape
        if self_conditioning is None:
            soft = torch.zeros_like(embeds)
        else:
            soft = torch.where(plan.self_conditioning[:, None, None], self_conditioning,
                               torch.zeros_like(self_conditioning))
            if soft.shape[1] < T:  # the signal of the first T' tokens, zero after them
                soft = torch.cat([soft, soft.new_zeros(B, T - soft.shape[1], D)], dim=1)
        denoised = self.self_conditioning(embeds, soft)
        x = torch.where(plan.denoise_tokens[..., None], denoised, embeds)
        return self._forward_block(x, cache, plan, moe_impl)

    def rope_tables(self, layer_type: str, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, rotary dim] in the model dtype for `layer_type`'s RoPE at `positions_BT`."""
        return rope_cos_sin(getattr(self, f"inv_freq_{layer_type}"), positions_BT, self.dtype)

    def logits(self, hidden_BTD: torch.Tensor, local: bool = False) -> torch.Tensor:
        """The lm_head (the tied embeddings, or `lm_head` when the checkpoint has its own or `quant.quantize` made a
        quantized copy), then float32 soft-capping cap * tanh(logits / cap): float32 [B, T, V].

        `local`: under tensor parallel (`vocab_shard` set), this rank's slice [B, T, per] of the padded vocabulary
        only, for `kernels.sample.vocab_parallel.VocabShard` (no gather); in one process the same as the default."""
        if local and self.vocab_shard is not None:
            head = self.lm_head.local_logits(hidden_BTD)
        elif self.lm_head is None:
            head = F.linear(hidden_BTD, self.embed_tokens.weight)  # no view of the weight: one input of torch.cond
        else:
            head = self.lm_head(hidden_BTD)
        logits = head.float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def self_conditioning_embedding(self, probs_BTV: torch.Tensor, local: bool = False,
                                    pinned_BT: torch.Tensor | None = None,
                                    ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The soft embedding of self-conditioning: probs @ embedding weight * embed_scale (transformers'
        DiffusionGemmaSelfConditioning input), [B, T, D] in the model dtype, from probabilities [B, T, V] (cast to
        the model dtype first; `quant.quantize`'s `sc_embedding` projection in place of the weight where set).
        `local`: under tensor parallel, `probs_BTV` is this rank's slice [B, T, per] (`VocabShard.sample_step`).

        `pinned_BT` (bool [B, T]) with `ids_BT` (int64 [B, T]): pinned positions (`canvas.py`) take the soft
        embedding of their token's one-hot, which is the token's table row, exactly (one nonzero term per output),
        selected at D width before the scale instead of as a one-hot over the vocabulary: the same bits as the
        one-hot's product for an unquantized table; with a quantized `sc_embedding`, the exact row rather than its
        quantized product. Under tensor parallel the row is chosen on the rank that holds it, before the product's
        one all-reduce (`parallel.vocab.VocabParallelProduct`): no collective is added."""
        weight = self.embed_tokens.weight
        probs = probs_BTV.to(weight.dtype)
        pins = () if pinned_BT is None else (pinned_BT, ids_BT)
        if self.vocab_shard is not None:
            product = self.sc_embedding.local(probs, *pins) if local else self.sc_embedding(probs, *pins)
        else:
            product = probs @ weight if self.sc_embedding is None else self.sc_embedding(probs)
            if pins:
                product = torch.where(pinned_BT[..., None], self.embed_tokens(ids_BT), product)
        return product * self.embed_scale.to(weight.dtype)

    def embed(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """The scaled input embeddings of `ids_BT` (int64 [B, T]): embedding row * embed_scale, [B, T, D] in the
        model dtype (transformers' Gemma4 scaled word embedding). Under tensor parallel each rank looks up its own
        vocabulary slice and the rows are summed (`parallel.vocab.VocabParallelEmbedding`: bitwise, one rank
        contributes each row)."""
        weight = self.embed_tokens.weight
        return self.embed_tokens(ids_BT) * self.embed_scale.to(weight.dtype)

    # ----- internals --------------------------------------------------------------------------------------------
    def _forward_block(self, x_BTD: torch.Tensor, cache: KVCache, plan: ForwardPlan,
                       moe_impl: str | None = None) -> torch.Tensor:
        """The layers over one block under `plan` (its RoPE tables, masks and cache slots), then the final norm;
        advances `cache.lengths` by `plan.commit`. `moe_impl` None means `self.moe_impl`."""
        moe_impl = self.moe_impl if moe_impl is None else moe_impl
        # a flex model's dense masks are an uncompiled step's (`plan.PlanBuffers.eager_plan`, an eager bucket's plans):
        # FlexAttention's eager math runs them (`eager_attention`); a dense-attention model's are the reference's
        flex = self.attention != "dense"
        for layer in self.layers:
            cos, sin = plan.rope[layer.layer_type]
            x_BTD = layer(x_BTD, cos, sin, cache, plan.masks[layer.layer_type], plan, moe_impl, flex)
        cache.lengths.add_(plan.commit)  # in place: the compiled units read this very tensor on every call
        return self.norm(x_BTD)

