"""Grouped-GEMM Triton kernels for the routed experts (`dgemma::moe_experts`), and their launcher.

Legend: N tokens, D hidden, E experts, K experts per token, I expert intermediate size, M = N*K assignments,
T grouped row tiles (an upper bound, static: see `max_row_tiles`).

Same math and contract as the op's implementations in `kernels/moe/op.py` (`moe_experts_loop` is the oracle):
    out[n] = sum_k w[n, k] * down[e] @ (gelu_tanh(gate[e] @ x[n]) * (up[e] @ x[n])),  e = idx[n, k].

The pipeline, with static shapes and no host synchronisation:
1. routing prep in torch, as `moe_experts_grouped` does it: a stable argsort of the M expert ids (`order_M`: the
   sorted rows' assignment ids n*K + k) and per-expert counts (scatter_add).
2. `_gate_up_kernel`: one program per (row tile, column tile of I). A row tile holds up to BLOCK_M consecutive
   sorted rows of one expert; each program finds its expert from the counts (`_tile_expert`), gathers its tokens'
   rows of x, multiplies by that expert's gate and up rows, and stores gelu_tanh(gate) * up (fp32 epilogue) as a
   sorted [M, I] activation in x's dtype. Experts with no tokens own no tile; one expert may own every tile.
3. `_down_kernel`: one program per (row tile, column tile of D): activation @ down[e]^T times the assignment's
   routing weight, stored in float32 at the assignment's *unsorted* row n*K + k of an [M, D] buffer.
4. the combine in torch: that buffer viewed [N, K, D] and summed over K (float32, slot order k = 0..K-1), cast to
   x's dtype. Deterministic: every buffer row is written by exactly one program and the sum has a fixed order, so
   there are no atomics and repeated runs are bit-identical. The order differs from the loop's (increasing expert
   id), so results match the loop to rounding, not bit for bit.

No capacity limit, nothing dropped: row tiles are assigned from the actual counts, within the static bound T.

GELU (tanh approximation, as `F.gelu(approximate="tanh")` documents it, after Hendrycks & Gimpel 2016):
0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))), computed as g * sigmoid(2 * sqrt(2/pi) * (...)) by the identity
0.5 * (1 + tanh(z)) = sigmoid(2z).

Quantized experts (a weight scale) are not supported by these kernels: the launcher takes plain weights only, and
the op refuses a scale before any implementation runs (scaled weights take the extern path).

Importing this module imports triton; `dgemma_compile.experimental` does not import it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton as _torch_wrap_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_row_tiles(M: int, E: int, block_m: int) -> int:
    """Static bound T on the row tiles of any routing of M assignments over E experts:
    sum_e ceil(c_e / B) <= sum_e (c_e + B - 1) / B = (M + E (B - 1)) / B, floored since the sum is an integer."""
    return (M + E * (block_m - 1)) // block_m


@triton.jit
def _tile_expert(tile, counts_ptr, E, BLOCK_M: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows) of grouped row tile `tile`; expert -1 past the last tile.
    Experts' tiles follow in id order, ceil(count / BLOCK_M) each (an O(E) scan of the counts per program)."""
    expert = tl.full((), -1, tl.int32)
    row0 = tl.full((), 0, tl.int32)
    row_end = tl.full((), 0, tl.int32)
    first_tile = tl.full((), 0, tl.int32)
    start = tl.full((), 0, tl.int32)
    for e in range(E):
        count = tl.load(counts_ptr + e)
        n_tiles = tl.cdiv(count, BLOCK_M)
        hit = (tile >= first_tile) & (tile < first_tile + n_tiles)
        expert = tl.where(hit, e, expert)
        row0 = tl.where(hit, start + (tile - first_tile) * BLOCK_M, row0)
        row_end = tl.where(hit, start + count, row_end)
        first_tile += n_tiles
        start += count
    return expert, row0, row_end


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b; with UPCAST the operands go to float32 first (the interpreter's bfloat16 workaround, see
    `_upcast_for_interpreter`: exact products either way, float32 accumulation)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_kernel(x_ptr, order_ptr, counts_ptr, gate_up_ptr, h_ptr, E, K, D, I,
                    stride_xn, stride_xd, stride_ge, stride_gi, stride_gd,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """h[r, j] = gelu_tanh(x[t] . gate_up[e, j]) * (x[t] . gate_up[e, I + j]) for sorted row r (token t = order[r] //
    K, expert e), columns j of this program's tile of I; h is [M, I] contiguous, accumulated in float32."""
    expert, row0, row_end = _tile_expert(tl.program_id(0), counts_ptr, E, BLOCK_M)
    if expert < 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    token = (tl.load(order_ptr + rows, mask=row_ok, other=0) // K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w_base = gate_up_ptr + expert.to(tl.int64) * stride_ge
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        a = tl.load(x_ptr + token[:, None] * stride_xn + ks[None, :] * stride_xd,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_gate = tl.load(w_base + cols[None, :] * stride_gi + ks[:, None] * stride_gd, mask=b_mask, other=0.0)
        b_up = tl.load(w_base + (cols + I)[None, :] * stride_gi + ks[:, None] * stride_gd, mask=b_mask, other=0.0)
        gate = _dot(a, b_gate, gate, PRECISION, UPCAST)
        up = _dot(a, b_up, up, PRECISION, UPCAST)
    # gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)); 1.5957691216057308 = 2 sqrt(2/pi)
    h = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, order_ptr, counts_ptr, route_w_ptr, down_ptr, y_ptr, E, D, I,
                 stride_de, stride_dd, stride_di,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y[a, d] = route_w[a] * (h[r] . down[e, d]) for sorted row r of assignment a = order[r] (expert e), columns d of
    this program's tile of D; y is [M, D] float32 in assignment order, each row written once."""
    expert, row0, row_end = _tile_expert(tl.program_id(0), counts_ptr, E, BLOCK_M)
    if expert < 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    w_base = down_ptr + expert.to(tl.int64) * stride_de
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(h_ptr + rows.to(tl.int64)[:, None] * I + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_base + cols[None, :] * stride_dd + ks[:, None] * stride_di,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, PRECISION, UPCAST)
    acc = acc * tl.load(route_w_ptr + slot, mask=row_ok, other=0.0)[:, None]
    tl.store(y_ptr + slot[:, None] * D + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def _upcast_for_interpreter(dtype: torch.dtype) -> bool:
    """Whether the dots must take float32 operands: bfloat16 with interpreted kernels (TRITON_INTERPRET=1 when this
    module was imported: Triton reads it when `@triton.jit` decorates), whose `tl.dot` multiplies
    bfloat16's raw uint16 bit patterns (the interpreter does not support bfloat16 arithmetic: Triton's debugging
    guide, triton-lang/triton#11584). bfloat16 products are exact in float32, so only the accumulation order can
    differ from the compiled kernel's."""
    from triton.runtime.interpreter import InterpretedFunction

    return dtype == torch.bfloat16 and isinstance(_gate_up_kernel, InterpretedFunction)


def check_moe_args(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI) -> tuple[int, int, int, int, int]:
    """(N, D, E, K, I) of a valid call; raises ValueError naming the first offending tensor."""
    name = "moe_experts_triton"
    if x_ND.dim() != 2 or x_ND.dtype not in DTYPES:
        raise ValueError(f"{name}: x_ND must be 2-D [N, D] in one of {DTYPES}, got {tuple(x_ND.shape)} {x_ND.dtype}")
    N, D = x_ND.shape
    if idx_NK.dim() != 2 or idx_NK.shape[0] != N or idx_NK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: idx_NK must be [N={N}, K] int32/int64, got {tuple(idx_NK.shape)} {idx_NK.dtype}")
    K = idx_NK.shape[1]
    if w_NK.shape != idx_NK.shape or not w_NK.dtype.is_floating_point:
        raise ValueError(f"{name}: w_NK must be [N, K] = {list(idx_NK.shape)} floating point, got "
                         f"{tuple(w_NK.shape)} {w_NK.dtype}")
    if gate_up_EID.dim() != 3 or gate_up_EID.shape[2] != D or gate_up_EID.shape[1] % 2 or \
            gate_up_EID.dtype != x_ND.dtype:
        raise ValueError(f"{name}: gate_up_EID must be [E, 2I, D={D}] in {x_ND.dtype} (x_ND's dtype), got "
                         f"{tuple(gate_up_EID.shape)} {gate_up_EID.dtype}")
    E, I = gate_up_EID.shape[0], gate_up_EID.shape[1] // 2
    if tuple(down_EDI.shape) != (E, D, I) or down_EDI.dtype != x_ND.dtype:
        raise ValueError(f"{name}: down_EDI must be [E, D, I] = [{E}, {D}, {I}] in {x_ND.dtype}, got "
                         f"{tuple(down_EDI.shape)} {down_EDI.dtype}")
    for tensor_name, t in (("w_NK", w_NK), ("idx_NK", idx_NK), ("gate_up_EID", gate_up_EID),
                           ("down_EDI", down_EDI)):
        if t.device != x_ND.device:
            raise ValueError(f"{name}: {tensor_name} is on {t.device}, x_ND on {x_ND.device}")
    return N, D, E, K, I


def _wrap_triton(kernel):
    """`torch.library.wrap_triton(kernel)`; an interpreted kernel (TRITON_INTERPRET=1) as it is: triton 3.6's
    interpreter's `triton.jit` returns no JITFunction, which torch 2.11's wrap_triton refuses (a plain launch
    either way outside make_fx)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    return _torch_wrap_triton(kernel) if isinstance(kernel, (JITFunction, Autotuner)) else kernel


def moe_experts_triton(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI, *, block_m: int = 64, block_n: int = 64,
                       block_k: int = 32) -> torch.Tensor:
    """The routed experts by two grouped-GEMM Triton kernels; same contract as `kernels.moe.op.moe_experts_loop`.

    Args: x [N, D] bfloat16, float16 or float32; w [N, K] floating routing weights (used in float32); idx [N, K]
    int32/int64 expert ids in [0, E) (an id out of range fails in the routing prep's scatter_add, as in
    `moe_experts_grouped`); gate_up [E, 2I, D] (gate rows first) and down [E, D, I] in x's dtype, any strides.
    Block sizes are powers of two >= 16 (tl.dot's minimum). Returns [N, D] in x's dtype: the activation is rounded
    to x's dtype between the projections, everything else accumulates in float32 (float32 inputs: IEEE products,
    no TF32). Quantized experts (a weight scale) are not supported here.

    Launches go through `torch.library.wrap_triton`, so make_fx can trace this function (the kernels become
    `triton_kernel_wrapper` nodes: how `experimental/moe_lowering.py` offers it to Inductor's autotuner); eagerly, and
    for interpreted kernels, they are plain launches.

    Raises: ValueError naming the tensor for a wrong shape, dtype or device (see `check_moe_args`).
    """
    N, D, E, K, I = check_moe_args(x_ND, w_NK, idx_NK, gate_up_EID, down_EDI)
    if N == 0 or K == 0 or E == 0:
        return torch.zeros_like(x_ND)
    M = N * K
    flat_M = idx_NK.reshape(-1).long()
    order_M = torch.argsort(flat_M, stable=True)
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_ND.device).scatter_add(
        0, flat_M, torch.ones_like(flat_M, dtype=torch.int32))
    route_w_M = w_NK.reshape(-1).to(torch.float32).contiguous()
    h_MI = torch.empty(M, I, dtype=x_ND.dtype, device=x_ND.device)
    y_MD = torch.empty(M, D, dtype=torch.float32, device=x_ND.device)
    precision = "ieee" if x_ND.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    upcast = _upcast_for_interpreter(x_ND.dtype)
    T = max_row_tiles(M, E, block_m)
    _wrap_triton(_gate_up_kernel)[(T, triton.cdiv(I, block_n))](
        x_ND, order_M, counts_E, gate_up_EID, h_MI, E, K, D, I, *x_ND.stride(), *gate_up_EID.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast)
    _wrap_triton(_down_kernel)[(T, triton.cdiv(D, block_n))](
        h_MI, order_M, counts_E, route_w_M, down_EDI, y_MD, E, D, I, *down_EDI.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast)
    return y_MD.view(N, K, D).sum(1).to(x_ND.dtype)
