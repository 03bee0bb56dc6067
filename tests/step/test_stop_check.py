"""The block loop's stop-check policies: the oracle's tokens and stats, and a bounded number of wasted forwards."""

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.demo import DEMO_MODEL, tasks
from dgemma_compile.oracle import run_block_diffusion
from dgemma_compile.step.requests import plan_requests
from dgemma_compile.oracle import EagerSteps
from dgemma_compile.step.stop_check import StopCheck, resolve


def flags(*values):
    return [torch.tensor(v) for v in values]


@pytest.mark.parametrize("mode,k,stops_after", [("sync", 1, 3), ("deferred", 1, 4), ("every_k", 2, 4),
                                                ("every_k", 4, 4), ("every_k", 5, 5)])
def test_policies_stop_when_the_host_learns(mode, k, stops_after):
    """All rows finish at step 3: sync sees it at once, deferred one step late, every_k at the next multiple of k."""
    copies = []

    def copy(flag):
        copies.append(bool(flag))
        return lambda value=bool(flag): value

    check = StopCheck(mode, k=k, copy=copy)
    seen = [check.done(f) for f in flags(False, False, True, True, True, True)]
    assert seen.index(True) + 1 == stops_after
    assert (copies != []) == (mode == "deferred"), "only the deferred policy goes through the copy"
    check.begin_block()
    assert check.steps == 0 and check.pending is None


def test_auto_resolves_by_device_and_bad_modes_are_refused():
    assert resolve("auto", "cpu") == "sync" and resolve("auto", "cuda") == "deferred"
    assert resolve("every_k", "cpu") == "every_k"
    with pytest.raises(ValueError, match="stop_check"):
        resolve("later", "cpu")
    with pytest.raises(ValueError, match="stop_check_k"):
        StopCheck("every_k", k=0)


DEMO_SETTINGS = dict(max_denoising_steps=8, max_new_tokens=40)  # blocks stop after ~2 of 8 steps; several blocks


def _demo_run(check: StopCheck, fuse_commit: bool = False):
    """Four held-out demo prompts through the eager block loop under `check` (and commit fusion if asked)."""
    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    cfg = model.generation_config.replace(**DEMO_SETTINGS)
    texts = [p for _, p, _ in tasks.make_split("heldout", 4, seed=0)]
    cfgs, prompts, seeds, _ = plan_requests(model, [tok(t)["input_ids"] for t in texts], cfg, [3, 4, 5, 6])
    runner = EagerSteps(model, cfgs, seeds, 256, "loop", fuse_commit=fuse_commit)
    return run_block_diffusion(model, runner, prompts, cfgs, stop_check=check)


@pytest.fixture(scope="module")
def oracle():
    """The synchronous, unfused run every late policy is compared with (deterministic: computed once)."""
    return _demo_run(StopCheck("sync"))


@pytest.mark.slow
@pytest.mark.parametrize("mode,k", [("deferred", 1), pytest.param("every_k", 3, marks=pytest.mark.slow)])
def test_late_checks_give_the_oracles_tokens_with_bounded_waste(oracle, mode, k):
    """On the demo model (its blocks stop after ~2 of 8 steps), prompts long enough for several blocks."""
    late = _demo_run(StopCheck(mode, k=k))
    assert late.sequences == oracle.sequences and late.stats == oracle.stats
    assert oracle.wasted_forwards == [0] * len(oracle.forwards_per_block)
    early = [b for b, n in enumerate(oracle.forwards_per_block) if n < DEMO_SETTINGS["max_denoising_steps"]]
    assert early, "some block stopped early, so a late check has something to waste"
    bound = 1 if mode == "deferred" else k - 1
    assert all(0 <= w <= bound for w in late.wasted_forwards)
    assert [f - w for f, w in zip(late.forwards_per_block, late.wasted_forwards)] == oracle.forwards_per_block


@pytest.mark.slow
def test_deferred_check_with_commit_fusion_issues_the_fused_forward_one_step_late(oracle):
    """Commit fusion under the deferred check: the host learns a block finished one step late (at most one wasted,
    frozen-only forward), then the commit rides in the next block's first step; tokens and stats equal the
    synchronous, unfused oracle's on the demo model."""
    late = _demo_run(StopCheck("deferred"), fuse_commit=True)
    assert late.sequences == oracle.sequences and late.stats == oracle.stats
    blocks = len(oracle.forwards_per_block)
    assert blocks > 1 and (oracle.commits, oracle.fused_commits) == (blocks - 1, 0)
    assert (late.commits, late.fused_commits) == (0, blocks - 1)
    assert all(0 <= w <= 1 for w in late.wasted_forwards) and any(late.wasted_forwards)
    assert [f - w for f, w in zip(late.forwards_per_block, late.wasted_forwards)] == oracle.forwards_per_block
