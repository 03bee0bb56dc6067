"""Roofline of one forward from our `ModelConfig`: bytes read, FLOPs, and the resulting lower bound on its time.

Bytes (weights at `dtype_bytes` per parameter, KV cache in the same dtype; activations and logits not counted):
- embeddings / lm_head (tied): the lm_head reads the whole V x D matrix when the pass makes logits (denoise, AR
  step; not a commit); the input embedding reads N rows; self-conditioning (denoise only) reads the matrix again for
  softmax(logits) @ E (the two reads are at opposite ends of the forward, so no cache keeps it) plus its gated MLP.
- attention: q/k/(v on sliding layers)/o projections and norms; dense MLP: 3 x D x I; router: D x E.
- experts actually touched: for N tokens each routed to k of E experts, the expected number of distinct experts
  per layer is E * (1 - (1 - k/E)^N) (independent uniform routing), each 3 x I_moe x D parameters.
- KV read: per layer, the keys a query block can see (sliding: the last W-1 cached tokens + the block; full: the
  whole context + the block), K and V, for every row; KV written: the block's K and V (every pass writes its
  block slots).
FLOPs: 2 x N x (active parameters per token) for every matmul (experts: k per token; lm_head and self-conditioning
when used) + 4 x N x keys x H x Dh for attention scores and values.
Floor = max(bytes / bandwidth, FLOPs / peak FLOP/s); achieved fraction = floor / measured time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dgemma_compile.model.config import SLIDING, ModelConfig

H200_BANDWIDTH = 4.8e12  # B/s, HBM3e spec
H200_BF16_FLOPS = 989e12  # dense bf16 spec (about 790e12 measured in practice)


@dataclass
class Forward:
    """Traffic and work of one forward."""

    kind: str
    tokens: int  # N = batch x tokens per row
    weight_bytes: dict[str, float] = field(default_factory=dict)
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return sum(self.weight_bytes.values()) + self.kv_read_bytes + self.kv_write_bytes

    def floor_s(self, bandwidth: float, peak_flops: float | None = None) -> float:
        t = self.bytes / bandwidth
        return max(t, self.flops / peak_flops) if peak_flops else t


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens routed uniformly to `top_k` of `num_experts` each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def forward(cfg: ModelConfig, *, kind: str, batch: int, tokens_per_row: int, context: int, dtype_bytes: float) -> Forward:
    """One forward of `kind` ("denoise": bidirectional canvas + self-conditioning + logits; "commit": causal encoder
    pass without logits; "ar": causal one-token pass with logits) over `tokens_per_row` tokens per row after
    `context` cached tokens."""
    if kind not in ("denoise", "commit", "ar"):
        raise ValueError(f"kind must be denoise, commit or ar, got {kind!r}")
    D, V, I, H = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_attention_heads
    E, K, Im = cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size
    T, N = tokens_per_row, batch * tokens_per_row
    b = dtype_bytes
    logits = kind in ("denoise", "ar")
    f = Forward(kind=kind, tokens=N)
    w = f.weight_bytes
    w["embedding rows"] = min(N, V) * D * b
    per_token = 0.0  # matmul parameters touched per token
    if logits:
        w["lm_head"] = V * D * b
        per_token += V * D
    if kind == "denoise":
        w["self-conditioning"] = (V * D + 3 * D * I + D) * b
        per_token += V * D + 3 * D * I
    attn = dense = router = experts = 0.0
    touched = expected_experts(E, K, N)
    attn_flops = 0.0
    for lt, hd, kv in zip(cfg.layer_types, cfg.head_dims, cfg.num_kv_heads):
        proj = D * H * hd + D * kv * hd * (2 if lt == SLIDING else 1) + H * hd * D
        attn += proj + 2 * hd + 7 * D
        dense += 3 * D * I
        router += D * E + D + E
        experts += touched * 3 * Im * D
        per_token += proj + 3 * D * I + D * E + K * 3 * Im * D
        cached = min(context, cfg.sliding_window - 1) if lt == SLIDING else context
        keys = cached + T
        f.kv_read_bytes += batch * keys * kv * hd * 2 * b
        f.kv_write_bytes += N * kv * hd * 2 * b
        mean_keys = keys if kind == "denoise" else cached + (T + 1) / 2  # causal: query i sees i + 1 block keys
        attn_flops += 4 * N * mean_keys * H * hd
    w["attention"] = attn * b
    w["dense MLP"] = dense * b
    w["router"] = router * b
    w["experts touched"] = experts * b
    f.flops = 2 * N * per_token + attn_flops
    return f


def total_weight_bytes(cfg: ModelConfig, dtype_bytes: float) -> float:
    """Every parameter once (tied embeddings once, every expert, norms)."""
    D, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    n = cfg.vocab_size * D + 3 * D * I + 2 * D  # embeddings, self-conditioning MLP + norm, final norm
    for lt, hd, kv in zip(cfg.layer_types, cfg.head_dims, cfg.num_kv_heads):
        n += D * cfg.num_attention_heads * hd * 2 + D * kv * hd * (2 if lt == SLIDING else 1) + 2 * hd + 7 * D
        n += 3 * D * I + D * E + D + E + E * 3 * cfg.moe_intermediate_size * D
    return n * dtype_bytes


@dataclass
class Roofline:
    """Per-step, per-forward and per-canvas floors for a workload (context = mean over the denoise steps)."""

    denoise: Forward
    commit: Forward
    ar: Forward
    steps: int
    canvas: int
    bandwidth: float
    peak_flops: float | None

    @property
    def step_floor_s(self) -> float:
        return self.denoise.floor_s(self.bandwidth, self.peak_flops)

    @property
    def ar_floor_s(self) -> float:
        return self.ar.floor_s(self.bandwidth, self.peak_flops)

    @property
    def canvas_floor_s(self) -> float:
        """`steps` denoise forwards + one commit."""
        return self.steps * self.step_floor_s + self.commit.floor_s(self.bandwidth, self.peak_flops)


def for_workload(cfg: ModelConfig, *, batch: int, prompt_len: int, output_len: int, steps: int, dtype_bytes: float,
                 bandwidth: float, peak_flops: float | None = None) -> Roofline:
    C = cfg.canvas_length
    blocks = max(1, -(-output_len // C))
    ctx = prompt_len + C * (blocks - 1) / 2  # mean committed context over the blocks
    ar_ctx = prompt_len + output_len / 2
    return Roofline(
        denoise=forward(cfg, kind="denoise", batch=batch, tokens_per_row=C, context=int(ctx), dtype_bytes=dtype_bytes),
        commit=forward(cfg, kind="commit", batch=batch, tokens_per_row=C, context=int(ctx), dtype_bytes=dtype_bytes),
        ar=forward(cfg, kind="ar", batch=batch, tokens_per_row=1, context=int(ar_ctx), dtype_bytes=dtype_bytes),
        steps=steps, canvas=C, bandwidth=bandwidth, peak_flops=peak_flops)


def _size(x: float) -> str:
    return f"{x / 1e9:.3f} GB" if x >= 1e9 else f"{x / 1e6:.3f} MB" if x >= 1e6 else f"{x / 1e3:.1f} kB"


def _gflop(x: float) -> str:
    g = x / 1e9
    return f"{g:,.1f}" if g >= 1 else f"{g:.3g}"


def describe(r: Roofline) -> list[str]:
    """Markdown lines: the byte breakdown and floors."""
    gb = _size
    lines = [f"bandwidth {r.bandwidth / 1e9:.1f} GB/s" + (f", peak {r.peak_flops / 1e9:,.0f} GFLOP/s" if r.peak_flops else ""),
             "", "| forward | tokens | weights | KV read | KV write | total bytes | GFLOP | intensity FLOP/B | floor ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fw in (r.denoise, r.commit, r.ar):
        wsum = sum(fw.weight_bytes.values())
        lines.append(f"| {fw.kind} | {fw.tokens} | {gb(wsum)} | {gb(fw.kv_read_bytes)} | {gb(fw.kv_write_bytes)} | "
                     f"{gb(fw.bytes)} | {_gflop(fw.flops)} | {fw.flops / fw.bytes:.1f} | "
                     f"{fw.floor_s(r.bandwidth, r.peak_flops) * 1e3:.3f} |")
    parts = ", ".join(f"{k} {gb(v)}" for k, v in r.denoise.weight_bytes.items())
    lines += ["", f"denoise weights: {parts}",
              f"canvas floor ({r.steps} denoise + 1 commit): {r.canvas_floor_s * 1e3:.3f} ms -> "
              f"ceiling {r.canvas / r.canvas_floor_s:.0f} tok/s per row; AR ceiling {1 / r.ar_floor_s:.0f} tok/s per row"]
    return lines
