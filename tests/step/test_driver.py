"""The one driver (`driver.Driver`) and the step's per-row report (`rows.Report`) it follows.

- The report against the eager oracle's transitions (Hypothesis over prompt lengths, token and step budgets, eos
  ids -- so eos positions --, fused and separate commits, constrained rows): each row reports its prefill chunks, then
  per block of the oracle's `steps_per_block` its commit and its denoise steps, an event at each block's last step
  and `done` at the last block exactly when the device ends the request (never for a constrained one); the driver's
  tokens are the oracle's.
- The driver's host side: an admission that fails leaves its row FREE on both sides, a host retirement frees the
  row for the next request.

The generator (`compile/generator.py`) and the engine (`runtime/engine.py`) are thin users of the driver, tested
through their own behaviour (tests/compile/test_compile.py, test_serve*.py, test_kv_paged.py, test_parallel_serve.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.inputs.constraint import Constraint, row_grammars
from dgemma_compile.step.driver import Driver
from helpers import RowReq
from dgemma_compile.step.phases import FREE
from dgemma_compile.step.rows import Report, RowReport

SLOTS = 128


def _expected(prompt_len: int, steps_per_block: list[int], C: int, fused: bool, device_ends: bool
              ) -> list[RowReport]:
    """The reports a row gives, iteration by iteration, for the oracle's transitions: its prefill chunks, then per
    block its commit (block > 0; fused: the block's first step too) and its denoise steps, the last one an event."""
    out, prefilled = [], 0
    while prefilled < prompt_len:
        n = min(C, prompt_len - prefilled)
        prefilled += n
        out.append(RowReport(n, prefilled, False, False, 0, 0, False, False))
    last = len(steps_per_block) - 1
    for k, s in enumerate(steps_per_block):
        first = 1
        if k > 0:
            if fused:
                out.append(RowReport(0, prefilled, True, True, k, 1, s == 1, s == 1 and k == last and device_ends))
                first = 2
            else:
                out.append(RowReport(0, prefilled, False, True, k, 0, False, False))
        for n in range(first, s + 1):
            out.append(RowReport(0, prefilled, True, False, k, n, n == s, n == s and k == last and device_ends))
    return out


@st.composite
def batches(draw):
    """1-3 requests (prompt ids, token budget, step budget, seed), an extra eos id or none, fused or separate commits,
    whether request 0 is constrained (then no extra eos)."""
    R = draw(st.integers(1, 3))
    prompts = [[2] + draw(st.lists(st.integers(4, 26), min_size=0, max_size=40)) for _ in range(R)]
    budgets = [draw(st.integers(1, 48)) for _ in range(R)]
    steps = [draw(st.integers(1, 5)) for _ in range(R)]
    constrained = draw(st.booleans())
    eos = None if constrained else draw(st.one_of(st.none(), st.integers(4, 14)))
    return prompts, budgets, steps, eos, draw(st.booleans()), constrained


@pytest.mark.slow  # ~30 s: 12 examples, each an eager oracle run and an eager bucket's
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_the_report_follows_the_eager_oracles_transitions(demo, batch):
    model, tok = demo
    prompts, budgets, steps, eos, fused, constrained = batch
    C = model.config.canvas_length
    base = model.generation_config
    if eos is not None:
        base = base.replace(eos_token_ids=(*base.eos_token_ids, eos))
    cfgs = [base.replace(max_new_tokens=n, max_denoising_steps=s).resolved(model.config)
            for n, s in zip(budgets, steps)]
    seeds = list(range(7, 7 + len(prompts)))
    cons = [Constraint.regex(r"[0-9]( [0-9])*") if constrained and r == 0 else None for r in range(len(prompts))]
    ref = dg.generate(model, prompts, cfgs, seed=seeds, moe_impl="dense", max_seq_len=SLOTS, fuse_commit=fused,
                      constraint=cons, tokenizer=tok)

    row_table = RowTable(model, tuple(range(1, len(prompts) + 1)), max_seq_len=SLOTS, max_denoising_steps=8,
                    config=cfgs[0], fuse_commit=fused, moe_impl="dense")
    driver = Driver(row_table)
    grammars = row_grammars(model, cons, cfgs, tok)
    reqs = [RowReq(p, c, s, g) for p, c, s, g in zip(prompts, cfgs, seeds, grammars)]
    for b, req in enumerate(reqs):
        driver.admit(b, req)
    seen: list[list[RowReport]] = [[] for _ in reqs]
    while (it := driver.step()) is not None:
        for b, rep in it.reports.items():
            seen[b].append(rep)
        for f in it.finished:
            _, done = driver.finalize(f)
            assert not (f.report.done and not done), "the device ended a request the host would not"
            if done:
                driver.retire(f.row, device_done=f.report.done)
    for r, req in enumerate(reqs):
        st_ = ref.stats[r]
        assert req.sequence == ref.sequences[r], f"request {r}: tokens differ from the eager oracle's"
        assert req.stats.steps_per_block == st_.steps_per_block
        device_ends = cons[r] is None  # the device never ends a constrained row
        assert seen[r] == _expected(len(prompts[r]), st_.steps_per_block, C, fused, device_ends), f"request {r}"
    assert all(int(p) == FREE for p in row_table.row_state.phase)


def test_report_columns_are_the_host_records_fields():
    assert [c.name.lower() for c in Report] == list(RowReport._fields)
    rep = RowReport.of([3, 5, 1, 0, 2, 4, 1, 0])
    assert rep == RowReport(3, 5, True, False, 2, 4, True, False) and rep.stepped is True


def test_driver_frees_a_row_whose_admission_failed_and_a_row_the_host_retired(demo):
    """A prompt longer than the bucket's slots fails admission: the row stays FREE on the host and the device, and
    the next request takes it; a request the host retires mid-block frees its row (FREE, frozen) at once."""
    model, _ = demo
    cfg = model.generation_config.resolved(model.config)
    row_table = RowTable(model, (1, 2), max_seq_len=32, max_denoising_steps=16, config=cfg)
    driver = Driver(row_table)
    with pytest.raises(ValueError, match="more than the 32 slots"):
        driver.admit(0, RowReq([2] + [5] * 40, cfg, 0))
    assert driver.free() == [0, 1] and int(row_table.row_state.phase[0]) == FREE
    a, b = RowReq([2, 5, 6], cfg, 0), RowReq([2, 7, 8], cfg, 1)
    driver.admit(0, a)
    driver.admit(1, b)
    first = driver.step()
    assert first.size == 2 and first.busy == [0, 1] and first.refresh_s is not None
    assert all(rep.encoded == 3 and rep.prefilled == 3 for rep in first.reports.values())
    assert driver.step().refresh_s is None  # nothing changed on the host: the step keeps its own plan filled
    assert driver.retire(1) is b and driver.busy() == [0]
    assert int(row_table.row_state.phase[1]) == FREE and bool(row_table.state.finished[1])
    it = driver.step()
    assert it.size == 1 and list(it.reports) == [0] and it.refresh_s is not None  # smaller size, refreshed


def _kv_rows_nonzero(row_table: RowTable) -> list[bool]:
    c = row_table.cache
    return [any(bool(t[b].ne(0).any()) for t in (*c.keys, *c.values)) for b in range(row_table.rows)]


def test_clear_zeroes_every_row_a_step_or_an_admission_wrote(demo):
    """`RowTable.clear` zeroes only the rows written since the cache was last zeroed (a step over a size writes its
    rows' block slots; an admission its row), and after it every key, value and length is zero, whatever sizes ran:
    a new driver (every generate call makes one) starts from an all-zero cache, as before the partial zeroing."""
    model, _ = demo
    cfg = model.generation_config.resolved(model.config).replace(max_new_tokens=16, max_denoising_steps=2)
    row_table = RowTable(model, (1, 2, 4), max_seq_len=64, max_denoising_steps=8, config=cfg)
    driver = Driver(row_table)  # the first clear zeroes every row (fresh buffers are treated as written)
    assert _kv_rows_nonzero(row_table) == [False] * 4
    driver.admit(0, RowReq([2, 5, 6, 7], cfg, 0))
    for _ in range(3):
        assert driver.step().size == 1
    assert _kv_rows_nonzero(row_table) == [True, False, False, False]  # a size-1 step wrote row 0 alone
    Driver(row_table)
    assert _kv_rows_nonzero(row_table) == [False] * 4 and int(row_table.cache.lengths.abs().sum()) == 0
    driver = Driver(row_table)
    driver.admit(0, RowReq([2, 5, 6], cfg, 1))
    driver.admit(2, RowReq([2, 9, 8, 7, 6], cfg, 2))  # a size-4 step: rows 0-3, row 1 and 3 FREE
    while (it := driver.step()) is not None:
        for f in it.finished:
            if driver.finalize(f)[1]:
                driver.retire(f.row, device_done=f.report.done)
    assert _kv_rows_nonzero(row_table)[0] and _kv_rows_nonzero(row_table)[2]
    driver.clear()
    assert _kv_rows_nonzero(row_table) == [False] * 4 and int(row_table.cache.lengths.abs().sum()) == 0
