"""Pass `sample_step_fusion`: the vocabulary-wide region of the denoise step -> one `dgemma::sample_step` call.

What it matches: the graph of `sampler.sample_step` (the first-position mask of constrained rows when the step passes
one, shift by the row max, scale by 1/T, argmax, chunked inverse-CDF sample, entropy, self-conditioning
probabilities) over any producer of the logits, with any temperature / greedy / uniform (/ bitmask / flag) inputs. The pattern is not written by hand: it is `sampler.sample_step` itself, traced by Inductor's `fwd_only` into
the same decomposed aten ops the captured step contains (integers, floats, dtypes and devices in it match any value,
so one pattern serves every B, C and V), in each of its structural variants: logits already float32 or cast from a
16-bit dtype, a vocabulary that is or is not a whole number of sampler chunks (the padded last chunk adds a pad), and
with or without the mask (the step always passes `StepInputs.allowed` / `constrained`; the mask is then the op's
per-row tensor data, so a grammar never recompiles and the logits are read by the op alone).
A match is rewritten only when its logits, counted as float32, span at least `min_logits_bytes`
(`CompileOptions.sample_step_fusion_min_bytes`): below that Inductor's fused loops are faster than the op's eager
CPU implementation and the op saves no memory worth having.

Why the rewrite is legal: the op computes `sampler.sample_step` itself (`kernels.sample`), position by position, and a
match requires that no node inside the region is read outside it (the pattern matcher's rule for multi-output
patterns), so nothing else depended on an intermediate. Values are equal up to float reduction order and the
last bits of exp/tanh (Inductor's fused loops vs the op's ATen kernels); tokens are checked equal with the pass on and off (tests/compile/test_passes.py, the
demo test set).

Then, per inserted op, two folds that keep the vocabulary-wide tensors out of the step (what bounds its transient
memory to about the model-dtype logits plus the model-dtype self-conditioning output): the op's logits input, when
it is the model's own float32 cast and softcap (cap * tanh(x / cap), `DiffusionGemma.logits`) read by nothing else,
is replaced by the cast's input with the cap as the op's `softcap`; and the self-conditioning output, when its only
reader is a cast or the copy into the step's state buffer (to the model dtype), is written in that dtype by the op
(`sc_dtype`). Both compute the same values in the same order, slice by slice (`kernels.sample`).

Stage: the joint-graph pre pass (`joint_custom_pre_pass`), before Inductor's own joint-graph rewrites: those rewrite
`x * c - amax(x * c)` (its softmax-scale pattern) when the logits come from a multiply such as the final softcap,
which would make the region's shape depend on what precedes it.
"""

from __future__ import annotations

import functools
import operator

import torch

from ...step import sampler
from . import op as _sample_op  # noqa: F401  (registers torch.ops.dgemma.sample_step)

NAME = "sample_step_fusion"
STAGE = "joint_custom_pre_pass"


def _search(logits, temperature, greedy, uniform):
    return tuple(sampler.sample_step(logits, temperature, greedy, uniform))


def _replace(logits, temperature, greedy, uniform):
    return torch.ops.dgemma.sample_step(logits, temperature, greedy, uniform)


def _search_masked(logits, temperature, greedy, uniform, allowed, constrained):
    return tuple(sampler.sample_step(logits, temperature, greedy, uniform, allowed, constrained))


def _replace_masked(logits, temperature, greedy, uniform, allowed, constrained):
    return torch.ops.dgemma.sample_step(logits, temperature, greedy, uniform, allowed=allowed,
                                        constrained=constrained)


def _large_enough(min_logits_bytes: int):
    """The match filter: the region's logits, counted as float32, span at least `min_logits_bytes`."""

    def check(match) -> bool:
        val = match.kwargs["logits"].meta.get("val")
        return isinstance(val, torch.Tensor) and 4 * val.numel() >= min_logits_bytes

    return check


@functools.cache
def _patterns(min_logits_bytes: int):
    """The PatternMatcherPass holding one traced pattern per structural variant (built once per process and
    threshold), each filtered by `_large_enough`."""
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    matcher = PatternMatcherPass(pass_name=NAME)
    B, C = 2, 3
    for dtype in (torch.float32, torch.bfloat16):
        for V in (11, sampler.SAMPLE_CHUNK + 11):  # one chunk, no pad / several chunks, the last one padded
            example = [torch.randn(B, C, V, dtype=dtype), torch.rand(B), torch.zeros(B, dtype=torch.bool),
                       torch.rand(B, C)]
            # the step's region: with the first-position mask of constrained rows (per-row tensors); registered
            # first, since the matcher tries patterns in order and the unmasked one matches the masked region's tail
            mask = [torch.full((B, -(-V // 32)), -1, dtype=torch.int32), torch.zeros(B, dtype=torch.bool)]
            register_replacement(_search_masked, _replace_masked, example + mask, fwd_only, [matcher],
                                 extra_check=_large_enough(min_logits_bytes))
            register_replacement(_search, _replace, example, fwd_only, [matcher],
                                 extra_check=_large_enough(min_logits_bytes))
    return matcher


_aten, _prims = torch.ops.aten, torch.ops.prims


def _call(node, target, nargs: int) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target
            and len(node.args) == nargs and not node.kwargs)


def _softcap_input(node: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """(x, cap) if `node` is mul(tanh(div(x, cap)), cap) with one user at each step, else None."""
    cap = node.args[1] if _call(node, _aten.mul.Tensor, 2) else None
    if not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0:  # a config may hold an int cap
        return None
    tanh = node.args[0]
    if not (_call(tanh, _aten.tanh.default, 1) and len(tanh.users) == 1):
        return None
    div = tanh.args[0]
    if not (_call(div, _aten.div.Tensor, 2) and div.args[1] == cap and len(div.users) == 1):
        return None
    return div.args[0], float(cap)


def _float32_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """x if `node` is a float32 cast of x with one user, else None."""
    if _call(node, _prims.convert_element_type.default, 2) and node.args[1] == torch.float32 and len(node.users) == 1:
        return node.args[0]
    return None


SC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes the op writes self-conditioning probabilities in (its CUDA kernel's too)."""


def _fold(graph: torch.fx.Graph, node: torch.fx.Node) -> dict[str, int]:
    """Fold the logits' cast and softcap, and the self-conditioning output's cast, into one op call (see the module
    docstring); then recompute the op's and its outputs' fake values. Returns which folds happened (0 or 1 each)."""
    # the traced replacement passes the op's optional arguments positionally: as keywords from here on
    optional = ("softcap", "sc_dtype", "allowed", "constrained")
    kwargs = {**{k: a for k, a in zip(optional, node.args[4:]) if a is not None}, **node.kwargs}
    node.args = node.args[:4]
    logits = node.args[0]
    folded: list[torch.fx.Node] = []  # producers no longer read once the op reads their input
    val = logits.meta.get("val")
    # a softcap computed in float32 only (as the model's): one in a 16-bit dtype rounds after each op, the op would not
    if (len(logits.users) == 1 and isinstance(val, torch.Tensor) and val.dtype == torch.float32
            and (capped := _softcap_input(logits)) is not None):
        folded += [logits, logits.args[0], logits.args[0].args[0]]  # mul, tanh, div
        logits, kwargs["softcap"] = capped
    if (uncast := _float32_input(logits)) is not None:
        folded.append(logits)
        logits = uncast
    sc_reads = [u for u in node.users if u.target is operator.getitem and u.args[1] == 3]
    cast = None
    if len(sc_reads) == 1 and len(sc_reads[0].users) == 1:
        (user,) = sc_reads[0].users
        if _call(user, _prims.convert_element_type.default, 2) and user.args[1] in SC_DTYPES:
            cast, kwargs["sc_dtype"] = user, user.args[1]
        elif _call(user, _aten.copy.default, 2) and user.args[1] is sc_reads[0]:
            # copy_ into the state buffer converts on the way (round to nearest, as a cast does): write the
            # destination's dtype directly
            dst = user.args[0].meta.get("val")
            if isinstance(dst, torch.Tensor) and dst.dtype in SC_DTYPES and dst.dtype != torch.float32:
                kwargs["sc_dtype"] = dst.dtype
    node.args = (logits, *node.args[1:])
    node.kwargs = kwargs
    if cast is not None:
        cast.replace_all_uses_with(sc_reads[0])
        graph.erase_node(cast)
    for producer in folded:  # outermost first: each is unread once its reader is gone
        graph.erase_node(producer)
    def fake(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    args = [fake(a) for a in node.args]
    fake_kwargs = {k: fake(v) for k, v in kwargs.items()}  # the mask's bitmask and flags are graph nodes
    fake_mode = torch._guards.detect_fake_mode([a for a in args if isinstance(a, torch.Tensor)])
    assert fake_mode is not None, "sample_step_fusion: the joint graph's nodes carry no fake values"
    with fake_mode:
        out = node.target(*args, **fake_kwargs)
    node.meta["val"] = out
    if "eager_input_vals" in node.meta:  # the inputs Inductor constrains the lowering's to: the new ones
        node.meta["eager_input_vals"] = (tuple(args), fake_kwargs)
    for u in node.users:
        if u.target is operator.getitem:
            u.meta["val"] = out[u.args[1]]
    return {SOFTCAP_FOLDED: int("softcap" in kwargs), SC_DTYPE_FOLDED: int("sc_dtype" in kwargs)}


SOFTCAP_FOLDED = f"{NAME}.softcap_folded"
SC_DTYPE_FOLDED = f"{NAME}.sc_dtype_folded"


def apply(graph: torch.fx.Graph, min_logits_bytes: int = 0) -> dict[str, int]:
    """Rewrite every match in `graph` whose logits span at least `min_logits_bytes` as float32, folding casts and the
    softcap into each op. Returns counts: `NAME` the rewrites, `SOFTCAP_FOLDED` / `SC_DTYPE_FOLDED` the ops that
    took the softcap / the self-conditioning dtype in."""
    counts = {NAME: _patterns(min_logits_bytes).apply(graph), SOFTCAP_FOLDED: 0, SC_DTYPE_FOLDED: 0}
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.dgemma.sample_step.default)):
        for k, v in _fold(graph, node).items():
            counts[k] += v
    return counts
