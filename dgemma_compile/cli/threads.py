"""How many intra-op CPU threads a generation should use: a recommendation; nothing here sets anything.

Why it matters: a small model is launch-bound (each op is microseconds of work), so extra OpenMP threads only add
fork/join cost, and a thread that waits on a core another process keeps busy stalls every op. Measured on a 2-core
machine with one other busy process: the demo model at torch's default 2 threads ran at 1.9 tok/s, at 1 thread at
619 tok/s (`bench/threads.py` keeps the table). A large model is compute-bound and gains from every core that is
free, and only from those.

`recommended_threads(model)` combines the two: 1 thread below `LAUNCH_BOUND_MACS` of work per denoise forward,
otherwise the number of CPUs free over a short `/proc/stat` sample (at least 1, at most this process's CPUs).
Front ends apply it (`torch.set_num_threads`) before compiling: Inductor's CPU kernels are generated for the
thread count in force when they compile.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

# Below this many multiply-accumulates per denoise forward (parameters x canvas length, an upper bound for MoE), one
# op takes a few microseconds per thread and intra-op threads cost more than they give. The demo model (2.3 M
# parameters, canvas 16) does 3.7e7; the 93 M-parameter scaled bench model with canvas 256 does 2.4e10.
LAUNCH_BOUND_MACS = 1e8

# A CPU counts as free when at least this share of it was idle during the sample (0.7 free of a core rounds to one).
_ROUND_UP_FROM = 0.7


def process_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (`cpu.max`) if any."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def cpu_ticks(proc_stat_text: str) -> tuple[int, int, int]:
    """(busy, total, CPUs) from the text of /proc/stat: jiffies of the aggregate `cpu` line (idle + iowait count as
    idle, steal as busy) and the number of `cpuN` lines."""
    lines = proc_stat_text.splitlines()
    fields = lines[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("no aggregate cpu line")
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    ncpu = sum(1 for line in lines if line[:3] == "cpu" and line[3:4].isdigit())
    return sum(values) - values[3] - values[4], sum(values), ncpu


def free_between(before: str, after: str, own_jiffies: int = 0) -> float | None:
    """CPUs other processes left idle between two /proc/stat texts, given this process's own jiffies in between
    (our use is not someone else's load). None when no time passed."""
    busy0, total0, ncpu = cpu_ticks(before)
    busy1, total1, _ = cpu_ticks(after)
    total = total1 - total0
    if total <= 0 or ncpu == 0:
        return None
    busy_others = min(total, max(0, busy1 - busy0 - own_jiffies))
    return ncpu * (1.0 - busy_others / total)


def _own_jiffies() -> int:
    """utime + stime of this process, in jiffies (/proc/self/stat fields 14 and 15)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def free_cpus(sample_s: float = 0.2) -> float | None:
    """CPUs left idle by other processes over a `sample_s`-second sample of /proc/stat (about 1.0 on a 2-CPU machine
    with one busy process). None where /proc/stat cannot be read (not Linux)."""
    try:
        before, own0 = Path("/proc/stat").read_text(), _own_jiffies()
        time.sleep(sample_s)
        after, own1 = Path("/proc/stat").read_text(), _own_jiffies()
        return free_between(before, after, own1 - own0)
    except (OSError, ValueError, IndexError):
        return None


def macs_per_forward(model) -> float:
    """Multiply-accumulates of one denoise forward, bounded above by parameters x canvas length."""
    return sum(p.numel() for p in model.parameters()) * model.config.canvas_length


def recommended_threads(model, *, sample_s: float = 0.2, free: float | None = -1.0) -> int:
    """Intra-op threads for generating with `model` on this machine now (for `torch.set_num_threads`; sets nothing).

    - 1 for a model on an accelerator (the host only launches work) or a launch-bound one (fewer than
      `LAUNCH_BOUND_MACS` multiply-accumulates per denoise forward);
    - otherwise the CPUs other processes left free over a `sample_s`-second /proc/stat sample, rounded (a CPU counts
      when 70% of it is idle), at least 1 and at most `process_cpus()`; all of `process_cpus()` without /proc/stat.

    `free` replaces the measurement (for tests); the default -1 measures.
    """
    device = getattr(model, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return 1
    if macs_per_forward(model) < LAUNCH_BOUND_MACS:
        return 1
    limit = process_cpus()
    if free is not None and free < 0:
        free = free_cpus(sample_s)
    if free is None:
        return limit
    return max(1, min(limit, math.floor(free + 1 - _ROUND_UP_FROM)))


__all__ = ["LAUNCH_BOUND_MACS", "cpu_ticks", "free_between", "free_cpus", "macs_per_forward", "process_cpus",
           "recommended_threads"]
