"""`dgemma explain`: the compile report (graphs, breaks, pass matches) of the model's step."""

from __future__ import annotations

import json

from ..demo import DEMO_MODEL
from .args import ExplainArgs
from .run import SLOT_ROUNDING, _quantize


MOE_RULE = ("loop = transformers' summation order (eager default, parity tests); grouped = torch._grouped_mm (compiled "
            "bf16 with E/K > 4; compiled float32 on CPU with a canvas of >= 256 tokens, as an eager call inside the "
            "step); gathered = each assignment's expert rows gathered, one fused loop nest (compiled, everything "
            "else); dense = every expert on every token (explicit only)")


def explain_command(args: ExplainArgs) -> int:
    import dataclasses

    from .. import CompileOptions, build, load

    model = load(args.model if args.model is not None else DEMO_MODEL)
    _quantize(model, args.quant)
    # one bucket that also serves the default workload's two-row batch; 256 slots as `dgemma generate` uses for a
    # short request, so both commands share Inductor's on-disk cache
    reports = build(model, CompileOptions(batch_buckets=(max(2, args.batch_size),), max_seq_len=SLOT_ROUNDING)
                    ).explain(args.batch_size)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
    else:
        print("\n".join(r.text() for r in reports))
        print(f"moe_impl rule (kernels.moe.op.resolve_moe_impl): {MOE_RULE}")
    return 0
