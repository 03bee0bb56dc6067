"""`dgemma::moe_experts`: the routed experts of one MoE layer, one op with a selectable implementation.

Legend: N tokens, D hidden, E experts, K experts per token, I expert intermediate size, M = N*K assignments.

The op is the one MoE call in every captured graph (the model calls it in eager and compiled runs alike); its
`impl` argument names the implementation, each a plain torch function of (x, w, idx, gate_up, down):
- "loop" (`moe_experts_loop`): transformers' reference loop over the experts that received tokens, accumulated in
  expert order. Data-dependent shapes and host syncs; the parity oracle.
- "grouped" (`moe_experts_grouped`): assignments sorted by expert, one `torch._grouped_mm` per projection; static
  shapes, no sync, the loop's per-token accumulation order. Under torch.compile `_grouped_mm` traces only in
  bfloat16 (its meta check), with D and I multiples of 8 (16-byte strides); eagerly float32 works on CPU.
- "dense" (`moe_experts_dense`): every expert on every token, combined by a dense [N, E] matrix of routing weights
  (zero where unrouted): E/K times the FLOPs, static shapes, any dtype.
- "gathered" (`moe_experts_gathered`): per assignment, its expert's rows gathered and multiplied with the token
  (a matrix-vector product written as multiply + sum): the routed FLOPs, static shapes, any dtype, no sort. Compiled,
  Inductor fuses gather, both projections, GELU and the combine into one C++ loop nest that never materialises the
  gathered [M, 2I, D] weights (eagerly it does: tests and explicit choices only).

Eagerly (CPU and CUDA) the op runs the named implementation. Compiled through `moe_decompositions(gm)` (the
table the compile backend passes to Inductor), "grouped", "dense" and "gathered" are traced into the graph in place of the op,
so Inductor sees plain aten ops and no opaque call remains; "loop" stays an opaque call (it cannot be traced).
`resolve_moe_impl` is the rule that picks one.

Weights come as (data, scale | None) per projection so that quantized experts can reach the op without
tensor-subclass dispatch; a scale is refused for now (NotImplementedError), never dequantized silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

MOE_IMPLS = ("loop", "grouped", "dense", "gathered")


def moe_experts_loop(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """transformers' loop: the experts that received tokens in increasing id order, each token's contributions
    accumulated into zeros in that order (bit-identical to transformers' eager MoE)."""
    out = torch.zeros_like(x_ND)
    for e in torch.unique(idx_NK).tolist():
        token, slot = torch.where(idx_NK == e)
        gate, up = F.linear(x_ND[token], gate_up_EID[e]).chunk(2, dim=-1)
        y = F.linear(F.gelu(gate, approximate="tanh") * up, down_EDI[e]) * w_NK[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def moe_experts_grouped(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """Sync-free experts: assignments sorted by expert (stable, so each token's contributions are accumulated in
    increasing expert id, as in the loop), one grouped GEMM per projection, static shapes. Functional ops only (it
    is also traced as a decomposition, below functionalization)."""
    K = idx_NK.shape[1]
    E = gate_up_EID.shape[0]
    flat_M = idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    token_M = order_M // K
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_ND.device).scatter_add(
        0, flat_M, torch.ones_like(flat_M, dtype=torch.int32))
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x_ND[token_M], gate_up_EID.transpose(1, 2), offs=offs_E).chunk(2, dim=-1)
    y_MD = torch._grouped_mm(F.gelu(gate, approximate="tanh") * up, down_EDI.transpose(1, 2), offs=offs_E)
    y_MD = y_MD * w_NK.reshape(-1)[order_M, None]
    return torch.zeros_like(x_ND).index_add(0, token_M, y_MD.to(x_ND.dtype))


def moe_experts_dense(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """Sync-free experts: every expert on every token, combined with the routing weights (zero where unrouted)."""
    N, E = x_ND.shape[0], gate_up_EID.shape[0]
    combine_EN = torch.zeros(N, E, dtype=w_NK.dtype, device=x_ND.device).scatter(1, idx_NK, w_NK).T
    gate, up = torch.einsum("nd,eid->eni", x_ND, gate_up_EID).chunk(2, dim=-1)
    y_END = torch.einsum("eni,edi->end", F.gelu(gate, approximate="tanh") * up, down_EDI)
    return (y_END * combine_EN[..., None]).sum(0).to(x_ND.dtype)


def moe_experts_gathered(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI):
    """Sync-free experts, routed FLOPs only: for each of the M = N*K assignments (token n, slot k), its expert's
    weights gathered by index and applied as a matrix-vector product (multiply + sum over the input dim, which
    Inductor fuses with the gather into one loop nest); each token's K terms summed in slot order.

    The gate and up products are two expressions that each read `x`: with two readers Inductor stores `x` once
    (its reuse heuristic) instead of recomputing x's producer (e.g. the pre-MoE RMSNorm) inside the weight loop for
    every one of the 2I output rows -- measured 2x slower for the demo's whole step when inlined."""
    N, K = idx_NK.shape
    D, I = x_ND.shape[1], down_EDI.shape[2]
    idx_M = idx_NK.reshape(-1)
    x_M1D = x_ND[:, None, :].expand(N, K, D).reshape(N * K, 1, D)
    gate = (gate_up_EID[:, :I][idx_M] * x_M1D).sum(-1)
    up = (gate_up_EID[:, I:][idx_M] * x_M1D).sum(-1)
    h_M1I = (F.gelu(gate, approximate="tanh") * up)[:, None, :]
    y_MD = (down_EDI[idx_M] * h_M1I).sum(-1)
    return (y_MD.view(N, K, D) * w_NK[..., None]).sum(1).to(x_ND.dtype)


_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "loop": moe_experts_loop, "grouped": moe_experts_grouped, "dense": moe_experts_dense,
    "gathered": moe_experts_gathered}


def _check(impl: str, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None) -> None:
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
    if gate_up_scale is not None or down_scale is not None:
        raise NotImplementedError(f"dgemma::moe_experts (moe_impl={impl!r}): quantized experts (a weight scale) are "
                                  "not supported yet")


@torch.library.custom_op("dgemma::moe_experts", mutates_args=())
def moe_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EID: torch.Tensor,
                gate_up_scale: torch.Tensor | None, down_EDI: torch.Tensor, down_scale: torch.Tensor | None,
                impl: str) -> torch.Tensor:
    """sum_k w[n, k] * down[e] @ (gelu_tanh(gate[e] @ x[n]) * (up[e] @ x[n])), e = idx[n, k].

    Args: x [N, D] (model dtype), w [N, K] float32 routing weights, idx [N, K] int64 expert ids (distinct per row),
    gate_up [E, 2I, D] (gate rows first), down [E, D, I], each projection's scale None (quantized weights are not
    supported yet), impl one of `MOE_IMPLS`. Returns [N, D] in x's dtype.

    Raises: ValueError for an unknown impl (naming moe_impl); NotImplementedError for a non-None scale.
    """
    _check(impl, gate_up_scale, down_scale)
    return _IMPLEMENTATIONS[impl](x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)


@moe_experts.register_fake
def _(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scale, down_EDI, down_scale, impl):
    _check(impl, gate_up_scale, down_scale)
    return torch.empty_like(x_ND)


def _decompose_moe_experts(x_ND, w_NK, idx_NK, gate_up_EID, gate_up_scale, down_EDI, down_scale, impl):
    """Inductor decomposition of the op: the traced implementation for "grouped", "dense" and "gathered". "loop" returns
    NotImplemented (proxy_tensor.maybe_handle_decomp then keeps the op); `moe_decompositions` never adds this entry
    for a graph that calls "loop", so this is a guard, not a path."""
    _check(impl, gate_up_scale, down_scale)
    if impl == "loop":
        return NotImplemented
    return _IMPLEMENTATIONS[impl](x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)


def graph_moe_impls(gm: torch.fx.GraphModule) -> set[str]:
    """The `impl` arguments of the `dgemma::moe_experts` calls in `gm` and its subgraphs (a Dynamo graph)."""
    op = torch.ops.dgemma.moe_experts
    impls = set()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for target in (op, op.default):
                for node in module.graph.find_nodes(op="call_function", target=target):
                    impls.add(node.kwargs["impl"] if "impl" in node.kwargs else node.args[7])
    return impls


def moe_decompositions(gm: torch.fx.GraphModule) -> dict:
    """The decomposition table for compiling `gm` (`compile_fx(gm, ..., decompositions=...)`): Inductor's default
    table (`select_decomp_table()`, read now: it depends on Inductor's config) plus the decomposition of
    `dgemma::moe_experts` into its traceable implementation, so that no opaque MoE call remains.

    A graph that calls "loop" gets the default table alone: the loop cannot be traced and stays an opaque call, and
    Inductor refuses an op that has a decomposition entry but must fall back to its eager kernel
    (torch/_inductor/lowering.py `make_fallback`: "both a fallback and a decomp for same op"), whatever the entry
    returns. A new dict: nothing is registered globally.

    Raises: ValueError (naming moe_impl) when one graph calls the op with "loop" and with another implementation
    (one unit, one implementation: the others would silently stay opaque).
    """
    impls = graph_moe_impls(gm)
    if "loop" in impls and len(impls) > 1:
        raise ValueError(f"moe_impl: one compiled graph calls dgemma::moe_experts with {sorted(impls)}; 'loop' "
                         "cannot be mixed with a decomposed implementation in one graph")
    return DecompositionTable(decompose_moe="loop" not in impls)


class DecompositionTable(dict):
    """Inductor's default decomposition table (`select_decomp_table()`, read at construction: it depends on
    Inductor's config), plus, with `decompose_moe`, `dgemma::moe_experts` -> its traceable implementation.

    Pickles as its recipe, `DecompositionTable(decompose_moe)`: Inductor's FX graph cache keys a compile on the
    pickled `decompositions` it was given, and the default table holds a pybind11 function that does not pickle, so
    a plain dict made every compile bypass the on-disk cache ("Cannot produce stable cache key", measured: each
    process recompiled every unit). The recipe's code is covered by `moe_cache_key` (a hash of this file), the
    default table's by the cache key's Inductor config and torch version.
    """

    def __init__(self, decompose_moe: bool):
        from torch._inductor.decomposition import select_decomp_table

        super().__init__(select_decomp_table())
        self.decompose_moe = decompose_moe
        if decompose_moe:
            self[torch.ops.dgemma.moe_experts.default] = _decompose_moe_experts

    def __reduce__(self):
        return (DecompositionTable, (self.decompose_moe,))


@contextlib.contextmanager
def moe_cache_key():
    """Around a compile with `moe_decompositions`: appends a hash of this file to `torch.compiler.config
    .cache_key_tag`. AOTAutograd's cache key covers the Dynamo graph (where the op still stands) but not the
    decomposition table, so without the tag a graph compiled without our decompositions, or with an older version of
    them, is served from the on-disk cache (observed: a plain Inductor compile of a "dense" graph, then ours, ran
    the opaque op)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    tag = torch.compiler.config.cache_key_tag
    ours = "dgemma-moe-" + get_hash_for_files((__file__,)).hex()[:16]
    with torch.compiler.config.patch(cache_key_tag=f"{tag}|{ours}" if tag else ours):
        yield


def resolve_moe_impl(requested: str, *, dtype: torch.dtype, num_experts: int, top_k: int, compiled: bool) -> str:
    """The MoE implementation to run: `requested` if explicit, else (for "auto") the rule below.

    - eager: "loop", transformers' summation order, so eager runs follow transformers (what the parity tests
      check) and the eager generator stays the oracle.
    - compiled, bfloat16 with E/K > 4: "grouped" (routed FLOPs, each expert's weights read once per forward).
    - compiled, anything else: "gathered" (routed FLOPs, one fused loop nest, no sort). `torch._grouped_mm`'s meta
      check accepts only bfloat16, so a grouped graph in float32 or float16 cannot be traced. Measured against
      "dense" on this 2-core CPU, one thread, compiled (bench/results/moe_cpu_*.md): float32 2.2x faster at the
      demo's shapes (16 and 128 tokens, E=8, K=2) and 6.1x at the scaled model's (256 tokens, E=64, K=4).

    Raises: ValueError (naming moe_impl) for an unknown name, or for "grouped" when compiled in a dtype other than
    bfloat16 (an explicit choice that cannot compile is refused, never replaced).
    """
    if requested != "auto" and requested not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be 'auto' or one of {MOE_IMPLS}, got {requested!r}")
    if requested == "grouped" and compiled and dtype != torch.bfloat16:
        raise ValueError(f"moe_impl='grouped' cannot be compiled in {dtype}: torch._grouped_mm traces only in "
                         "bfloat16; use 'gathered', 'dense' or 'auto'")
    if requested != "auto":
        return requested
    if not compiled:
        return "loop"
    if dtype == torch.bfloat16 and num_experts > 4 * top_k:
        return "grouped"
    return "gathered"
