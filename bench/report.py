"""Raw measurements -> summary numbers, ratios against ours-compiled, markdown and CSV.

Ratios are "speedup of ours-compiled": other system's time / ours-compiled's time (per denoise step, per canvas,
time to first block, end to end), and ours-compiled tok/s / other tok/s; > 1 means ours-compiled is faster. Both
come from the same run. "paired" is the median over repeat rounds of (other pass / ours-compiled pass of the same
round): with interleaved repeats the two passes of a round ran back to back, so a slow spell of the machine cancels.
The AR baseline's "step" is one forward (one token).

Spread per system: min / median / p90 of every timed step, and of the pass time (one timed repeat over the whole
workload).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from . import roofline as rl
from .timing import median, p90, spread

BASE = "ours-compiled"
COLUMNS = [
    ("step_min_ms", "step ms min"), ("step_ms", "step ms median"), ("step_p90_ms", "step ms p90"),
    ("canvas_ms", "canvas ms"), ("ttfb_ms", "TTFB ms"),
    ("request_ms", "request ms"), ("tok_s", "tok/s"), ("tok_per_fwd", "tok/fwd"), ("forwards", "forwards"),
    ("fwd_per_canvas", "fwd/canvas"), ("compile_s", "compile s"), ("peak_mem_mb", "peak MB"),
]
SPREAD = [("repeats_timed", "repeats"), ("pass_min_ms", "pass ms min"), ("pass_ms", "pass ms median"),
          ("pass_p90_ms", "pass ms p90"), ("pass_p90_over_min", "p90 / min")]
RATIOS = [("step_ms", "per step"), ("canvas_ms", "per canvas"), ("ttfb_ms", "TTFB"), ("request_ms", "end to end"),
          ("tok_s", "tok/s"), ("pass_paired", "pass, paired")]


def summarize(r: dict) -> dict:
    """Medians and derived numbers of one system's raw result (`session.Session.result()`)."""
    if r.get("status") != "ok":
        return {"system": r["system"], "status": r.get("status", "n/a")}
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    rep = median(r["repeat_s"])
    step_min, step_med, step_p90 = spread(ms(r["step_s"]))
    pass_min, pass_med, pass_p90 = spread(ms(r["repeat_s"]))
    s = dict(system=r["system"], status="ok",
             step_min_ms=step_min, step_ms=step_med, step_p90_ms=step_p90,
             pass_min_ms=pass_min, pass_ms=pass_med, pass_p90_ms=pass_p90,
             pass_p90_over_min=pass_p90 / pass_min if pass_min else float("nan"),
             repeats_timed=len(r["repeat_s"]), pass_s=list(r["repeat_s"]),
             canvas_ms=median(ms(r["canvas_s"])), ttfb_ms=median(ms(r["ttfb_s"])),
             request_ms=median(ms(r["request_s"])),
             tok_s=r["tokens"] / rep if rep > 0 else float("nan"),
             tok_per_fwd=r["tokens"] / r["forwards"] if r["forwards"] else float("nan"),
             forwards=r["forwards"], tokens=r["tokens"],
             compile_s=r["compile_s"] if r["compile_s"] is not None else float("nan"),
             peak_mem_mb=r["peak_mem_mb"], steps_timed=len(r["step_s"]))
    if "forwards_per_canvas" in r.get("extra", {}):
        s["fwd_per_canvas"] = r["extra"]["forwards_per_canvas"]
    unit = r.get("extra", {}).get("unit_step_s")
    if unit:
        s["unit_step_ms"] = median(ms(unit))
    if "accuracy" in r.get("extra", {}):
        s["accuracy"] = r["extra"]["accuracy"]
    return s


def with_ratios(rows: list[dict]) -> list[dict]:
    base = next((r for r in rows if r["system"] == BASE and r["status"] == "ok"), None)
    for r in rows:
        for key, _ in RATIOS:
            if base is None or r["status"] != "ok":
                r[f"speedup_{key}"] = float("nan")
            elif key == "pass_paired":
                pairs = [o / b for o, b in zip(r["pass_s"], base["pass_s"]) if b > 0]
                r[f"speedup_{key}"] = median(pairs)
            elif key == "tok_s":
                r[f"speedup_{key}"] = base[key] / r[key] if r[key] else float("nan")
            else:
                r[f"speedup_{key}"] = r[key] / base[key] if base[key] else float("nan")
    return rows


def with_roofline(rows: list[dict], roof: rl.Roofline) -> list[dict]:
    for r in rows:
        if r["status"] != "ok":
            continue
        floor = roof.ar_floor_s if r["system"].startswith("ar") else roof.step_floor_s
        r["floor_ms"] = floor * 1e3
        r["floor_fraction"] = floor * 1e3 / r["step_ms"] if r["step_ms"] else float("nan")
    return rows


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def _ratio(x) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


@dataclass
class Section:
    """One workload's results."""

    title: str
    description: str
    rows: list[dict]
    raw: list[dict]
    roof: rl.Roofline | None


def section(title: str, description: str, raw: list[dict], roof: rl.Roofline | None) -> Section:
    rows = with_ratios([summarize(r) for r in raw])
    if roof is not None:
        rows = with_roofline(rows, roof)
    return Section(title=title, description=description, rows=rows, raw=raw, roof=roof)


LEGEND = (
    "Columns: step = one denoise step (AR: one one-token forward), min, median and p90 over every timed step; canvas = "
    "median time per canvas (block 0 from its first step; later blocks include the previous block's commit "
    "pass; AR: C tokens); TTFB = request start to the first canvas final, prefill included; request = median "
    "generate call; tok/s = generated tokens per pass / median pass time (prefill included); tok/fwd = generated "
    "tokens / decoder forwards (summed over rows); forwards per pass; compile s apart from every timing; peak MB "
    "during the timed passes. Spread: pass = one timed repeat over the whole workload, min / median / p90 over the "
    "repeats (p90 / min: how much the machine moved under this system).")


def markdown(meta: dict, sections: list[Section]) -> str:
    out = [f"# dgemma_compile benchmark: `{meta['model']}` on {meta['device_tag']} ({meta['date']})", ""]
    for k in ("command", "checkpoint", "device", "dtype", "threads", "versions", "isolation", "schedule", "memory",
              "load", "started", "finished", "note"):
        if meta.get(k):
            out.append(f"- {k}: {meta[k]}")
    out += ["", LEGEND]
    for sec in sections:
        out += ["", f"## {sec.title}", "", sec.description, ""]
        has_acc = any("accuracy" in r for r in sec.rows)
        head = ["system"] + [h for _, h in COLUMNS] + (["accuracy"] if has_acc else [])
        out += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        for r in sec.rows:
            if r["status"] != "ok":
                out.append(f"| {r['system']} | {r['status']} |" + " |" * (len(head) - 2))
                continue
            cells = [_fmt(r.get(k, float("nan"))) for k, _ in COLUMNS] + ([_fmt(r.get("accuracy"))] if has_acc else [])
            out.append(f"| {r['system']} | " + " | ".join(cells) + " |")
        out += ["", "Spread over the timed repeats:", "", "| system | " + " | ".join(h for _, h in SPREAD) + " |",
                "|---" + "|---:" * len(SPREAD) + "|"]
        for r in sec.rows:
            if r["status"] == "ok":
                out.append(f"| {r['system']} | " + " | ".join(_fmt(r[k]) for k, _ in SPREAD) + " |")
        out += ["", f"Speedup of {BASE} (other time / {BASE} time; tok/s: {BASE} / other; pass, paired: median over "
                f"rounds of other pass / {BASE} pass of the same round; > 1: {BASE} faster):", "",
                "| system | " + " | ".join(h for _, h in RATIOS) + " |", "|---" + "|---:" * len(RATIOS) + "|"]
        for r in sec.rows:
            if r["status"] == "ok" and r["system"] != BASE:
                out.append(f"| {r['system']} | " + " | ".join(_ratio(r[f"speedup_{k}"]) for k, _ in RATIOS) + " |")
        if sec.roof is not None:
            out += ["", "Roofline (bench/roofline.py; mean context over the blocks):", ""] + rl.describe(sec.roof)
            out += ["", "| system | floor ms per step/forward | measured median ms | fraction of floor |", "|---|---:|---:|---:|"]
            for r in sec.rows:
                if r["status"] == "ok":
                    out.append(f"| {r['system']} | {r['floor_ms']:.3f} | {_fmt(r['step_ms'])} | {r['floor_fraction']:.2%} |")
        out += ["", "How each system was timed:", ""]
        for raw in sec.raw:
            line = f"- {raw['system']}: {raw.get('timing', '')}"
            notes = raw.get("notes") or []
            if raw.get("status") == "ok" and "unit_step_s" in raw.get("extra", {}):
                u = [x * 1e3 for x in raw["extra"]["unit_step_s"]]
                notes = notes + [f"compiled denoise unit alone: median {_fmt(median(u))} ms, p90 {_fmt(p90(u))} ms"]
            if raw.get("status") != "ok" and raw.get("detail"):
                notes = notes + [raw["detail"]]
            out.append(line + ("; " + "; ".join(notes) if notes else ""))
    return "\n".join(out) + "\n"


CSV_FIELDS = ["model", "device", "device_name", "dtype", "date", "workload", "batch", "prompt_len", "output_len",
              "steps", "repeats", "system", "status", "step_min_ms", "step_ms", "step_p90_ms", "unit_step_ms", "canvas_ms", "ttfb_ms",
              "request_ms", "repeats_timed", "pass_min_ms", "pass_ms", "pass_p90_ms", "pass_p90_over_min", "tok_s",
              "tok_per_fwd", "tokens", "forwards", "compile_s", "peak_mem_mb", "speedup_step_ms", "speedup_canvas_ms",
              "speedup_ttfb_ms", "speedup_request_ms", "speedup_tok_s", "speedup_pass_paired",
              "floor_ms", "floor_fraction", "accuracy", "python", "torch", "transformers", "dgemma_compile", "threads"]


def write_csv(path: Path, meta: dict, sections: list[tuple[dict, Section]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for wspec, sec in sections:
            for r in sec.rows:
                row = {**meta["versions_dict"], "model": meta["model"], "device": meta["device_tag"],
                       "device_name": meta["device"], "dtype": meta["dtype"], "date": meta["date"],
                       "threads": meta["threads_n"], "workload": wspec["kind"], **{k: wspec[k] for k in
                       ("batch", "prompt_len", "output_len", "steps", "repeats")}, **r}
                w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else f"{v:.6g}" if isinstance(v, float)
                                else v) for k, v in row.items()})
