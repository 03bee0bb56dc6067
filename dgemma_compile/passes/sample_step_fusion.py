"""Pass `sample_step_fusion`: the vocabulary-wide region of the denoise step -> one `dgemma::sample_step` call.

What it matches: the graph of `sampler.sample_step` (shift by the row max, scale by 1/T, argmax, chunked inverse-CDF
sample, entropy, self-conditioning logits) over any producer of the logits, with any temperature / greedy / uniform
inputs. The pattern is not written by hand: it is `sampler.sample_step` itself, traced by Inductor's `fwd_only` into
the same decomposed aten ops the captured step contains (integers, floats, dtypes and devices in it match any value,
so one pattern serves every B, C and V), in each of its structural variants: logits already float32 or cast from a
16-bit dtype, and a vocabulary that is or is not a whole number of sampler chunks (the padded last chunk adds a pad).

Why the rewrite is legal: the op computes `sampler.sample_step` itself (`ops.sample`), position by position, and a
match requires that no node inside the region is read outside it (the pattern matcher's rule for multi-output
patterns), so nothing else depended on an intermediate. Values are equal up to float reduction order (Inductor's
fused loops vs the op's ATen kernels); tokens are checked equal with the pass on and off (tests/test_passes.py, the
demo test set).

Stage: the joint-graph pre pass (`joint_custom_pre_pass`), before Inductor's own joint-graph rewrites: those rewrite
`x * c - amax(x * c)` (its softmax-scale pattern) when the logits come from a multiply such as the final softcap,
which would make the region's shape depend on what precedes it.
"""

from __future__ import annotations

import functools

import torch

from .. import sampler
from ..ops import sample as _sample_op  # noqa: F401  (registers torch.ops.dgemma.sample_step)

NAME = "sample_step_fusion"
STAGE = "joint_custom_pre_pass"


def _search(logits, temperature, greedy, uniform):
    return tuple(sampler.sample_step(logits, temperature, greedy, uniform))


def _replace(logits, temperature, greedy, uniform):
    return torch.ops.dgemma.sample_step(logits, temperature, greedy, uniform)


@functools.cache
def _patterns():
    """The PatternMatcherPass holding one traced pattern per structural variant (built once per process)."""
    from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

    matcher = PatternMatcherPass(pass_name=NAME)
    B, C = 2, 3
    for dtype in (torch.float32, torch.bfloat16):
        for V in (11, sampler.SAMPLE_CHUNK + 11):  # one chunk, no pad / several chunks, the last one padded
            example = [torch.randn(B, C, V, dtype=dtype), torch.rand(B), torch.zeros(B, dtype=torch.bool),
                       torch.rand(B, C)]
            register_replacement(_search, _replace, example, fwd_only, [matcher])
    return matcher


def apply(graph: torch.fx.Graph) -> int:
    """Rewrite every match in `graph`; returns the number of matches."""
    return _patterns().apply(graph)
