"""`bench/before_after.py`: the parts that decide what its report says, on synthetic worker results (the workers
themselves run other trees' code: exercised by running the tool, bench/results/before_after_cpu_*.md).
No speed assertions."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ lives beside the package, not inside it

from bench import before_after as ba  # noqa: E402


def test_ratios_are_of_the_medians_and_paired_per_round():
    ratio, paired = ba.ratios([2.0, 4.0, 9.0], [1.0, 4.0, 3.0])  # medians 4 / 3; per round 2, 1, 3
    assert ratio == pytest.approx(4 / 3) and paired == pytest.approx(2.0)
    assert ba.ratios([None, 1.0], [3.0, 1.0]) == (1.0, 1.0)  # a failed round drops out of both sides
    assert ba.ratios([1.0], [None]) == (None, None)


@pytest.mark.parametrize("better, ratio, paired, want", [
    ("higher", 1.0, 1.2, "yes"), ("higher", 0.9, 1.1, "mixed"), ("higher", 0.9, 0.95, "no"),
    ("lower", 0.8, 1.0, "yes"), ("lower", 1.1, 0.9, "mixed"), ("lower", 1.2, 1.01, "no"), ("higher", None, 1.0, "n/a")])
def test_verdict_needs_both_ratios(better, ratio, paired, want):
    assert ba.verdict(better, ratio, paired) == want


def test_every_tree_runs_first_in_some_round():
    labels = ["main", "old", "older"]
    assert [ba.rotation(labels, r)[0] for r in range(3)] == labels
    assert sorted(ba.rotation(labels, 4)) == sorted(labels)


def test_packages_follow_the_trees_pyproject(tmp_path):
    (tmp_path / "dgemma_compile").mkdir()
    assert ba.packages(tmp_path) == {"dgemma_compile": tmp_path / "dgemma_compile"}
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = {"dgemma_compile" = "dgemma_compile", '
                                             '"dgemma_runtime" = "runtime", "" = "src"}\n')
    assert ba.packages(tmp_path) == {"dgemma_compile": tmp_path / "dgemma_compile",
                                     "dgemma_runtime": tmp_path / "runtime"}


def test_report_rows_ratios_and_token_lines():
    trees = [dict(label=lab, path=f"/t/{lab}", root=f"/r/{lab}", packages=["dgemma_compile"], commit=lab,
                  subject="s", dirty=False) for lab in ("main", "old")]

    def worker(tok_s, seqs, scheme="v4"):
        return dict(threads=1, scheme=scheme, worker_s=1.0, maxrss_mb=100.0, warmup_s=0.1,
                    adaptive=dict(tok_s=tok_s, p50_ms=1000 / tok_s, exact=1.0, seqs=seqs),
                    fixed=dict(tok_s=tok_s / 2, p50_ms=2000 / tok_s, exact=1.0, seqs=seqs))

    results = {"demo_b1": {"main": [worker(110.0, [[1, 2]]), worker(120.0, [[1, 2]])],
                           "old": [worker(100.0, [[1, 2]]), worker(100.0, [[1, 3]])]}}
    plan = {"rounds": 2, "demo_b1": dict(prompts=1, fixed_steps=8), "demo_b8": dict(calls=1),
            "scaled_b1": dict(requests=1, new_tokens=1, prompt_len=1)}
    text = ba.report(["--before", "old=/t/old"], trees, results, plan, "start", "0/0/0")
    row = next(line for line in text.splitlines() if line.startswith("| demo b1 adaptive |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:8] == ["115.0", "100.0", "1.15x", "1.15x", "yes"]
    p50 = next(line for line in text.splitlines() if line.startswith("| demo b1 adaptive, request p50 |"))
    assert [c.strip() for c in p50.strip("|").split("|")][7] == "yes"  # lower is better there
    assert "demo_b1 adaptive: main against old: identical (0 of 1 requests differ); NOT stable across rounds in: old" \
        in text
