"""Compile reports: what `torch._dynamo.explain` says of each compile unit of a bucket, plus the compiles observed
while a short mixed workload runs (recompiles show up there) and our graph passes' matches in those compiles
(explain itself never reaches Inductor, where the passes run). `torch._dynamo.explain` resets Dynamo, so the
generator's compiled state is dropped and rebuilt: keep this out of a serving process."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..model.config import GenerationConfig
from .options import applied
from .units import PassMatches

if TYPE_CHECKING:
    from .generator import CompiledGenerator


@dataclass
class UnitReport:
    """What `torch._dynamo.explain` says of one compile unit, plus compiles seen during a workload."""

    unit: str
    graph_count: int
    graph_break_count: int
    break_reasons: list[dict]
    ops_per_graph: list[int]
    guard_count: int
    compiles_in_workload: int = 0  # compiled, or loaded from the compile cache (`CompiledGenerator.ready`)
    recompiles_in_workload: int = 0
    moe_impl: str = ""
    pass_matches: dict[str, int] | None = None
    """Our graph passes' matches in the unit's Inductor compile during the workload (None: unknown)."""
    pass_matches_source: str = ""
    """"compiled", "cache record" (served by the compile caches; the counts recorded with their entry), "unknown" or
    "no pass enabled" (`units.PassMatches`); empty: the workload did not compile the unit."""
    attention_kernel_options: dict | None = None
    """The FlexAttention kernel options of the unit's queries per layer type (`CompileOptions.attention_kernels`)."""

    def text(self) -> str:
        passes = (PassMatches(self.pass_matches, self.pass_matches_source).text() if self.pass_matches_source
                  else "passes=? (not compiled by the workload)")
        lines = [f"{self.unit}: graphs={self.graph_count} graph_breaks={self.graph_break_count} "
                 f"ops_per_graph={self.ops_per_graph} guards={self.guard_count} "
                 f"compiles_in_workload={self.compiles_in_workload} recompiles={self.recompiles_in_workload} "
                 f"moe_impl={self.moe_impl} {passes}"]
        for layer_type, opts in (self.attention_kernel_options or {}).items():
            lines.append(f"  attention {layer_type}: kernel_options={opts or 'defaults'}")
        for r in self.break_reasons:
            lines.append(f"  break: {r['reason']}\n    at: {r['user_stack']}")
        return "\n".join(lines)


def explain(gen: "CompiledGenerator", batch_size: int = 1, config: GenerationConfig | None = None,
            workload: Callable[["CompiledGenerator"], None] | None = None) -> list[UnitReport]:
    """Per compile unit: `torch._dynamo.explain` of the bucket serving `batch_size`, then the compiles seen while
    `workload(gen)` runs (default: `default_workload`)."""
    row_table = gen.row_table(config)
    view = row_table.view(row_table.size_for(gen.bucket_for(batch_size)))
    reports = []
    with torch.no_grad(), applied(gen.options):
        view.refresh()  # every row FREE: the step changes no row
        ex = torch._dynamo.explain(view.unit.fn)()
        reports.append(UnitReport(
            unit=view.name, graph_count=ex.graph_count, graph_break_count=ex.graph_break_count,
            break_reasons=[{"reason": str(b.reason), "user_stack": [str(f) for f in b.user_stack]}
                           for b in ex.break_reasons],
            ops_per_graph=[len(ops) for ops in ex.ops_per_graph], guard_count=len(ex.out_guards),
            moe_impl=gen.moe_impl, attention_kernel_options=gen.options.attention_kernels()["canvas"]))
    gen.reset()  # explain reset Dynamo; start from fresh compiled units
    gen.units.pass_matches.clear()  # report only what the workload's compiles matched
    before = Counter(gen.ready)  # a step loaded from the compile cache counts as its unit's compile
    (workload or default_workload)(gen)
    for r in reports:
        kind = r.unit.split("[")[0]
        seen = {name: n - before[name] for name, n in gen.ready.items() if name.startswith(kind + "[")}
        r.compiles_in_workload = sum(seen.values())
        r.recompiles_in_workload = sum(max(0, n - 1) for n in seen.values())
        matches = gen.units.pass_matches.get(r.unit)
        if matches is not None:
            r.pass_matches, r.pass_matches_source = matches.counts, matches.source
    return reports


def default_workload(gen: "CompiledGenerator") -> None:
    """Prompts of different lengths, block counts and batch sizes within the first bucket that holds two rows."""
    cfg = gen.model.generation_config.replace(max_denoising_steps=3)
    C = gen.model.config.canvas_length
    bos = gen.model.config.bos_token_id
    gen.generate([[bos] + [3] * 4], cfg.replace(max_new_tokens=C), seed=1)
    gen.generate([[bos] + [4] * (C + 3), [bos, 5]], cfg.replace(max_new_tokens=2 * C), seed=[2, 3])
