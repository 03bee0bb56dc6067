"""Run one system on one workload in a fresh process: `python -m bench.worker IN.json OUT.json`.

IN holds {system, model: ModelSpec fields, workload: WorkloadSpec fields, device, dtype, threads}; OUT receives the
raw measurement of `systems.run`, or {"status": "n/a (reason)", "detail": traceback tail} when the system fails.
A fresh process per system keeps peak memory, compiled state and allocator state of one system away from the next.
"""

from __future__ import annotations

import json
import sys
import traceback


def failure(system: str, e: BaseException) -> dict:
    first = (str(e).strip().splitlines() or [""])[0]
    reason = f"{type(e).__name__}: {first}"[:160]
    return {"system": system, "status": f"n/a ({reason})", "detail": traceback.format_exc()[-3000:]}


def run_payload(payload: dict) -> dict:
    import torch

    torch.set_num_threads(int(payload["threads"]))
    from . import models, systems, workloads

    spec = models.ModelSpec(**payload["model"])
    wspec = workloads.WorkloadSpec(**payload["workload"])
    try:
        return systems.run(payload["system"], spec, wspec, payload["device"], payload.get("dtype"),
                           payload.get("max_seq_len"), payload.get("budget_s"))
    except Exception as e:  # noqa: BLE001 - a failing system is reported as n/a, never crashes the run
        return failure(payload["system"], e)


def main(argv: list[str]) -> int:
    payload = json.loads(open(argv[0]).read())
    result = run_payload(payload)
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
