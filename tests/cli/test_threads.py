"""Thread recommendation (`dgemma_compile.cli.threads`): /proc/stat arithmetic, the policy, and a live busy process."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.cli import threads
from dgemma_compile.demo import DEMO_MODEL


def stat_text(user, idle, ncpu=2, iowait=0, steal=0):
    """A /proc/stat text with the given aggregate jiffies and `ncpu` per-CPU lines."""
    cpus = "\n".join(f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(ncpu))
    return f"cpu  {user} 0 0 {idle} {iowait} 0 0 {steal} 0 0\n{cpus}\nintr 0\nctxt 0\n"


def test_free_between_counts_idle_and_iowait_as_free_and_our_own_use_as_free():
    before = stat_text(user=1000, idle=1000)
    assert threads.free_between(before, stat_text(user=1100, idle=1100)) == pytest.approx(1.0)  # one of two busy
    assert threads.free_between(before, stat_text(user=1000, idle=1200)) == pytest.approx(2.0)
    assert threads.free_between(before, stat_text(user=1200, idle=1000)) == pytest.approx(0.0)
    assert threads.free_between(before, stat_text(user=1100, idle=1050, iowait=50)) == pytest.approx(1.0)
    assert threads.free_between(before, stat_text(user=1100, idle=1000, steal=100)) == pytest.approx(0.0)
    # 100 of the 200 jiffies were ours: nobody else is busy
    assert threads.free_between(before, stat_text(user=1100, idle=1100), own_jiffies=100) == pytest.approx(2.0)
    assert threads.free_between(before, before) is None


def test_cpu_ticks_rejects_other_text():
    with pytest.raises(ValueError):
        threads.cpu_ticks("intr 0\n")


def test_free_cpus_on_this_machine_is_within_its_cpu_count():
    free = threads.free_cpus(0.05)
    if free is None:
        pytest.skip("no /proc/stat")
    ncpu = threads.cpu_ticks(open("/proc/stat").read())[2]
    assert 0.0 <= free <= ncpu


def test_a_busy_process_is_seen_as_load():
    """A spin loop in another process takes about one CPU away (other load on the machine only takes more)."""
    if threads.free_cpus(0.01) is None:
        pytest.skip("no /proc/stat")
    ncpu = threads.cpu_ticks(open("/proc/stat").read())[2]
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 5\nwhile time.time() < t: pass"])
    try:
        time.sleep(0.3)
        free = threads.free_cpus(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert free <= ncpu - 0.6


def fake_model(params: int, canvas: int, device="cpu"):
    """Something with what `recommended_threads` reads: parameters (meta tensors, no memory), config, device."""
    weight = torch.empty(params, device="meta")
    return SimpleNamespace(parameters=lambda: iter([weight]), config=SimpleNamespace(canvas_length=canvas),
                           device=torch.device(device))


def test_small_models_get_one_thread_whatever_is_free():
    model = dg.load(DEMO_MODEL)
    assert threads.macs_per_forward(model) == sum(p.numel() for p in model.parameters()) * model.config.canvas_length
    assert threads.macs_per_forward(model) < threads.LAUNCH_BOUND_MACS
    for free in (None, 0.0, 2.0, 64.0):
        assert threads.recommended_threads(model, free=free) == 1
    assert threads.recommended_threads(model) == 1  # measured


@pytest.mark.parametrize("free,cpus,expected", [
    (2.0, 2, 2), (1.0, 2, 1), (1.69, 2, 1), (1.71, 2, 2), (0.1, 2, 1), (0.0, 2, 1), (7.9, 4, 4), (None, 4, 4),
])
def test_large_models_get_the_free_cpus(monkeypatch, free, cpus, expected):
    monkeypatch.setattr(threads, "process_cpus", lambda: cpus)
    big = fake_model(params=int(threads.LAUNCH_BOUND_MACS), canvas=256)
    assert threads.recommended_threads(big, free=free) == expected


def test_accelerator_models_get_one_thread():
    assert threads.recommended_threads(fake_model(10**9, 256, device="meta"), free=8.0) == 1


def test_the_library_sets_nothing():
    before = torch.get_num_threads()
    big = fake_model(params=int(threads.LAUNCH_BOUND_MACS), canvas=256)
    n = threads.recommended_threads(big, sample_s=0.01)
    assert 1 <= n <= threads.process_cpus() and torch.get_num_threads() == before


def test_process_cpus_is_within_the_affinity_mask():
    assert 1 <= threads.process_cpus() <= len(os.sched_getaffinity(0))
