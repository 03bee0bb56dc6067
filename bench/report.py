"""Raw measurements -> summary numbers, ratios against ours-compiled, markdown and CSV.

Ratios are "speedup of ours-compiled": other system's time / ours-compiled's time (per denoise step, per canvas,
time to first block, end to end), and ours-compiled tok/s / other tok/s; > 1 means ours-compiled is faster. Both
come from the same run. "paired" is the median over repeat rounds of (other pass / ours-compiled pass of the same
round): with interleaved repeats the two passes of a round ran back to back, so a slow spell of the machine cancels.
The AR baseline's "step" is one forward (one token).

Spread per system: min / median / p90 of every timed step, and of the pass time (one timed repeat over the whole
workload).

Quantized systems (`ours-compiled-<scheme>`) get their own table beside bf16 `ours-compiled` of the same run: scheme,
weight bytes (the `QuantReport`'s) and quantized / baseline ratios (time: < 1 means quantized faster; tok/s: > 1).
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
    s["dtype"] = r.get("dtype", "")
    q = r.get("extra", {}).get("quant")
    if q:
        s.update(quant_scheme=q["scheme"], weight_bytes=q["bytes_after"], weight_bytes_before=q["bytes_before"],
                 quant_s=q.get("seconds", float("nan")))
    return s


def is_quantized(row: dict) -> bool:
    """A quantized system's row (ok or n/a): `ours-compiled-<scheme>`, or any row whose weights are quantized."""
    from .systems import QUANT_SYSTEMS

    return row["system"] in QUANT_SYSTEMS or row.get("quant_scheme", "none") != "none"


def with_ratios(rows: list[dict], base_system: str = BASE) -> list[dict]:
    """Each row's `speedup_*` ratios against `base_system`'s row (`RATIOS`; NaN where either failed)."""
    base = next((r for r in rows if r["system"] == base_system and r["status"] == "ok"), None)
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


def quant_rows(rows: list[dict]) -> list[dict]:
    """The quantized-vs-baseline table's rows: per quantized system, its scheme, weight bytes and the ratios of its
    numbers to `BASE`'s in the same run (`quant_*` keys; NaN where either row failed)."""
    base = next((r for r in rows if r["system"] == BASE and r["status"] == "ok"), None)
    out = []
    for r in rows:
        if not is_quantized(r):
            continue
        q = dict(r)
        ok = base is not None and r["status"] == "ok"
        div = lambda a, b: a / b if ok and b else float("nan")  # noqa: E731
        q["quant_weights"] = div(r.get("weight_bytes", float("nan")), base.get("weight_bytes") if ok else 0)
        q["quant_step"] = div(r.get("step_ms"), base["step_ms"] if ok else 0)
        q["quant_request"] = div(r.get("request_ms"), base["request_ms"] if ok else 0)
        q["quant_tok_s"] = div(r.get("tok_s"), base["tok_s"] if ok else 0)
        q["quant_pass_paired"] = r.get("speedup_pass_paired", float("nan")) if ok else float("nan")
        q["same_dtype"] = ok and r.get("dtype") == base.get("dtype")
        out.append(q)
    return out


QUANT_COLUMNS = [("quant_step", "step time"), ("quant_request", "end to end"), ("quant_tok_s", "tok/s"),
                 ("quant_pass_paired", "pass, paired")]


def quant_markdown(rows: list[dict]) -> list[str]:
    """The lines of the quantized-vs-baseline table (none when no row is quantized)."""
    qrows = quant_rows(rows)
    if not qrows:
        return []
    base = next((r for r in rows if r["system"] == BASE and r["status"] == "ok"), None)
    bdtype = base.get("dtype", "?") if base else "?"
    has_acc = any("accuracy" in r for r in rows)
    head = (["system", "scheme", "dtype", "weights MiB", "weights / base", "step ms median", "tok/s"]
            + [h for _, h in QUANT_COLUMNS] + (["accuracy"] if has_acc else []))
    out = ["", f"Quantized vs {bdtype} {BASE} (same run; `dg.quantize` in the worker after loading, untimed; weights: "
           "every parameter and buffer as the `QuantReport` counts them, a tied model's embedding table for the lookup "
           "and its quantized lm_head / self-conditioning copies included; step time, end to end, pass, paired: "
           f"quantized / {BASE}, < 1 means the quantized system is faster; tok/s: quantized / {BASE}, > 1 means it is "
           "faster):", "", "| " + " | ".join(head) + " |", "|---|---|---" + "|---:" * (len(head) - 3) + "|"]
    mb = lambda r: _fmt(r["weight_bytes"] / 2**20) if "weight_bytes" in r else "-"  # noqa: E731
    if base is not None:
        cells = [BASE, base.get("quant_scheme", "none"), bdtype, mb(base), "1.00x", _fmt(base["step_ms"]),
                 _fmt(base["tok_s"])] + ["1.00x"] * len(QUANT_COLUMNS)
        out.append("| " + " | ".join(cells + ([_fmt(base.get("accuracy"))] if has_acc else [])) + " |")
    for q in qrows:
        if q["status"] != "ok":
            out.append(f"| {q['system']} | {q['status']} |" + " |" * (len(head) - 2))
            continue
        cells = [q["system"], q.get("quant_scheme", "?"), q.get("dtype", "?"), mb(q), _ratio(q["quant_weights"]),
                 _fmt(q["step_ms"]), _fmt(q["tok_s"])] + [_ratio(q[k]) for k, _ in QUANT_COLUMNS]
        out.append("| " + " | ".join(cells + ([_fmt(q.get("accuracy"))] if has_acc else [])) + " |")
    if base is None:
        out += ["", f"No ratios: {BASE} (the baseline) did not run in this run."]
    for q in qrows:
        if q["status"] == "ok" and base is not None and not q["same_dtype"]:
            out += ["", f"WARNING: {q['system']} ran in {q.get('dtype')} and {BASE} in {bdtype}: the ratios mix "
                    "dtypes."]
    return out


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
    base: str = BASE


def section(title: str, description: str, raw: list[dict], roof: rl.Roofline | None, base: str = BASE) -> Section:
    """One workload's section; its speedup table is against `base` (`--base`; default ours-compiled)."""
    rows = with_ratios([summarize(r) for r in raw], base)
    if roof is not None:
        rows = with_roofline(rows, roof)
    return Section(title=title, description=description, rows=rows, raw=raw, roof=roof, base=base)


LEGEND = (
    "Columns: step = one denoise step (ours-compiled: one iteration of its compiled step, prefill chunks and "
    "separate commits included; AR: one one-token forward), min, median and p90 over every timed step; canvas = "
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
        b = sec.base
        out += ["", f"Speedup of {b} (other time / {b} time; tok/s: {b} / other; pass, paired: median over "
                f"rounds of other pass / {b} pass of the same round; > 1: {b} faster):", "",
                "| system | " + " | ".join(h for _, h in RATIOS) + " |", "|---" + "|---:" * len(RATIOS) + "|"]
        for r in sec.rows:
            if r["status"] == "ok" and r["system"] != b:
                out.append(f"| {r['system']} | " + " | ".join(_ratio(r[f"speedup_{k}"]) for k, _ in RATIOS) + " |")
        out += quant_markdown(sec.rows)
        if sec.roof is not None:
            out += ["", "Roofline (bench/roofline.py; mean context over the blocks):", ""] + rl.describe(sec.roof)
            if any(is_quantized(r) for r in sec.rows):
                out += ["", "The floors are at the model dtype's bytes for every row, quantized ones included (their "
                        "weights read fewer bytes; their weight sizes are in the table above)."]
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
                notes = notes + [f"compiled step alone: median {_fmt(median(u))} ms, p90 {_fmt(p90(u))} ms"]
            if raw.get("status") != "ok" and raw.get("detail"):
                notes = notes + [raw["detail"]]
            out.append(line + ("; " + "; ".join(notes) if notes else ""))
    return "\n".join(out) + "\n"


CSV_FIELDS = ["model", "device", "device_name", "dtype", "date", "workload", "batch", "prompt_len", "output_len",
              "steps", "repeats", "system", "status", "step_min_ms", "step_ms", "step_p90_ms", "unit_step_ms", "canvas_ms", "ttfb_ms",
              "request_ms", "repeats_timed", "pass_min_ms", "pass_ms", "pass_p90_ms", "pass_p90_over_min", "tok_s",
              "tok_per_fwd", "tokens", "forwards", "compile_s", "peak_mem_mb", "speedup_step_ms", "speedup_canvas_ms",
              "speedup_ttfb_ms", "speedup_request_ms", "speedup_tok_s", "speedup_pass_paired",
              "floor_ms", "floor_fraction", "accuracy", "quant_scheme", "weight_bytes", "weight_bytes_before",
              "quant_weights", "quant_step", "quant_request", "quant_tok_s", "quant_pass_paired",
              "python", "torch", "transformers", "dgemma_compile", "threads"]


def write_csv(path: Path, meta: dict, sections: list[tuple[dict, Section]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for wspec, sec in sections:
            quant = {q["system"]: q for q in quant_rows(sec.rows)}
            for r in sec.rows:
                r = quant.get(r["system"], r)
                row = {**meta["versions_dict"], "model": meta["model"], "device": meta["device_tag"],
                       "device_name": meta["device"], "dtype": meta["dtype"], "date": meta["date"],
                       "threads": meta["threads_n"], "workload": wspec["kind"], **{k: wspec[k] for k in
                       ("batch", "prompt_len", "output_len", "steps", "repeats")}, **r}
                w.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else f"{v:.6g}" if isinstance(v, float)
                                else v) for k, v in row.items()})
