"""A forward in which no row samples skips the vocabulary region (`CompileOptions.skip_idle_vocabulary`, issue 39):
the lm_head, the sampler and the self-conditioning product run only where some row steps.

The observable: the region writes every row's `DenoiseState.entropy` (the mean entropy of the logits it computed,
frozen rows included); a forward that skips it leaves the previous step's values. Checked on a lone request's
commit-only forward (unfused commits: every block after the first begins with one), in the eager step (where the
lm_head's calls are also counted) and in the compiled step of the demo generator (where the region sits in a
`torch.cond`); the tokens are the oracle's either way (the compiled step's parity tests, tests/compile/test_compile.py, run
with the option on, the CPU default).
"""

from __future__ import annotations

import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.compile import CompileOptions
from dgemma_compile.model.config import ConfigError
from dgemma_compile.step.driver import Driver
from helpers import RowReq

SLOTS = 128


def _config(model):
    """Two blocks, sampled at temperature 1 (greedy rows have entropy 0 whatever the logits), 3 steps a block."""
    return model.generation_config.replace(max_new_tokens=2 * model.config.canvas_length, max_denoising_steps=3,
                                           t_min=1.0, t_max=1.0, stop_early=False, eos_token_ids=()
                                           ).resolved(model.config)


def _commit_only_forward(driver: Driver, request) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Run `request` alone up to its first finished block, then the next forward (a commit with no row sampling):
    (entropy before that forward, entropy after it, the tokens of the whole request)."""
    driver.admit(0, request)
    while True:
        it = driver.step()
        if it.finished:
            _, done = driver.finalize(it.finished[0])
            assert not done
            break
    before = driver.row_table.state.entropy.clone()
    it = driver.step()
    rep = it.reports[0]
    assert rep.committed and not rep.stepped, "the forward after a finished block is a commit-only one"
    after = driver.row_table.state.entropy.clone()
    while (it := driver.step()) is not None:
        for f in it.finished:
            _, done = driver.finalize(f)
            if done:
                driver.retire(f.row, device_done=f.report.done)
    return before, after, request.sequence


@pytest.mark.parametrize("skip", [True, False])
def test_the_eager_step_runs_the_lm_head_only_where_a_row_samples(demo, monkeypatch, skip):
    model, _ = demo
    cfg = _config(model)
    calls = []
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda *a, **k: calls.append(1) or logits(*a, **k))
    row_table = RowTable(model, (1,), max_seq_len=SLOTS, max_denoising_steps=8, config=cfg, skip_idle_vocabulary=skip)
    driver = Driver(row_table)
    n = []
    real_step = driver.step

    def counted():
        n.append(len(calls))
        return real_step()

    driver.step = counted
    before, after, tokens = _commit_only_forward(driver, RowReq([2, 5, 6, 7], cfg, 3))
    forwards, heads = len(n) - 1, len(calls)  # the last driver call found no busy row
    ref = dg.generate(model, [[2, 5, 6, 7]], cfg, seed=3, moe_impl="dense", max_seq_len=SLOTS)
    assert tokens == ref.sequences[0]
    # 1 prefill forward, 3 steps, 1 commit, 3 steps: the lm_head in the 6 steps only, or in every forward
    assert forwards == 8 and heads == (6 if skip else 8)
    if skip:
        assert torch.equal(after, before), "a forward with no row sampling kept the previous step's entropy"
    else:
        assert not torch.equal(after, before), "the region ran on the commit's logits"


def test_the_compiled_step_skips_the_region_in_a_commit_only_forward(demo, demo_gen):
    """The demo generator (the CPU default: the option on) over its bucket of 2 rows, one request."""
    model, _ = demo
    assert demo_gen.skip_idle_vocabulary
    # the checkpoint's structural config (stop_early, eos ids): the bucket the other tests compiled
    cfg = model.generation_config.replace(max_new_tokens=2 * model.config.canvas_length, max_denoising_steps=3,
                                          t_min=1.0, t_max=1.0, ignore_eos=True).resolved(model.config)
    before, after, tokens = _commit_only_forward(Driver(demo_gen.row_table(cfg)), RowReq([2, 5, 6, 7], cfg, 3))
    assert torch.equal(after, before)
    ref = dg.generate(model, [[2, 5, 6, 7]], cfg, seed=3, moe_impl=demo_gen.moe_impl,
                      max_seq_len=demo_gen.options.max_seq_len)
    assert tokens == ref.sequences[0]


def test_the_option_resolves_per_device_and_refuses_cuda_graphs():
    assert CompileOptions().idle_vocabulary_skip("cpu") and not CompileOptions().idle_vocabulary_skip("cuda")
    assert CompileOptions(skip_idle_vocabulary=False).idle_vocabulary_skip("cpu") is False
    assert CompileOptions(skip_idle_vocabulary=True, cuda_graphs=False).idle_vocabulary_skip("cuda")
    with pytest.raises(ConfigError) as e:
        CompileOptions(skip_idle_vocabulary=True).idle_vocabulary_skip("cuda")
    assert e.value.param == "skip_idle_vocabulary"
    with pytest.raises(ConfigError) as e:
        CompileOptions(skip_idle_vocabulary="yes")
    assert e.value.param == "skip_idle_vocabulary"
    # tensor-subclass weights (torchao's quantized ones): torch.cond has no rule for them (tests/quant/test_quant.py and
    # the quantized explain and bench rows run the compiled step that results)
    assert CompileOptions().idle_vocabulary_skip("cpu", subclass_weights=True) is False
    with pytest.raises(ConfigError) as e:
        CompileOptions(skip_idle_vocabulary=True).idle_vocabulary_skip("cpu", subclass_weights=True)
    assert e.value.param == "skip_idle_vocabulary"
