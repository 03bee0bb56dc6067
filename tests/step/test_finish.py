"""The end rule of a block: the host's `finish.finalize_row` and its device twin `finish.request_done` agree (Hypothesis
over budgets, eos positions and block counts), and the step accepts the ends only the host decides (a row retired
mid-block stays FREE and untouched while its batch mate goes on exactly as alone)."""

import torch
from hypothesis import given, strategies as st

import dgemma_compile as dg
from dgemma_compile.step.row_table import RowTable
from dgemma_compile.step.finish import finalize_row, request_done
from dgemma_compile.step.requests import RequestStats
from dgemma_compile.step.phases import FREE

C, EOS, PAD = 8, (1, 7), 0


@st.composite
def requests(draw):
    """A token budget, whether the request ignores eos, and the argmax canvases of up to 6 blocks, each with an eos
    id at a drawn position or none."""
    budget, ignore = draw(st.integers(1, 6 * C)), draw(st.booleans())
    blocks = []
    for _ in range(draw(st.integers(1, 6))):
        row = draw(st.lists(st.integers(2, 40).filter(lambda t: t not in EOS), min_size=C, max_size=C))
        eos_at = draw(st.one_of(st.none(), st.integers(0, C - 1)))
        if eos_at is not None:
            row[eos_at] = draw(st.sampled_from(EOS))
            if draw(st.booleans()):  # a second eos later in the canvas
                row[draw(st.integers(eos_at, C - 1))] = EOS[0]
        blocks.append(row)
    return budget, ignore, blocks


@given(requests())
def test_host_and_device_end_rules_agree(request):
    budget, ignore, blocks = request
    cfg = dg.GenerationConfig(max_new_tokens=budget, eos_token_ids=EOS, pad_token_id=PAD, ignore_eos=ignore)
    sequence, stats = [], RequestStats()
    emitted = 0  # the device's count: C per finished block of a request that goes on
    eos = torch.tensor(sorted(EOS))
    for row in blocks:
        device = bool(request_done(torch.tensor([row]), torch.tensor([emitted]), torch.tensor([budget]), eos,
                                   torch.tensor([ignore]))[0])
        keep, host = finalize_row(row, cfg, sequence, stats, steps=1)
        assert device == host, (row, budget, emitted)
        if host:
            assert stats.finish_reason == ("length" if ignore else stats.finish_reason) in ("eos", "length")
            assert len(sequence) == budget if ignore else len(sequence) <= budget
            break
        emitted += C
        assert len(sequence) == emitted and keep == row  # what the device's count assumes: a kept block is whole


def test_the_step_accepts_a_row_the_host_retired(demo):
    """Two requests in an eager bucket; the host retires row 1 in the middle of its first block (a stop string or a
    cancellation): the step leaves it FREE with its state untouched, and row 0's tokens equal its solo run."""
    model, _ = demo
    cfg = model.generation_config.resolved(model.config)
    prompt = [2, 5, 6, 7, 8]

    def held(b: RowTable) -> tuple[torch.Tensor, ...]:
        """Row 1's state that a later admission does not rewrite (the self-conditioning input is read only under
        `has_sc`, which admission clears)."""
        st = b.state
        return st.canvas[1], st.argmax[1], st.history[:, 1], st.steps[1:2], b.cache.lengths[1:2], b.inputs.block[1:2]

    def row_table() -> RowTable:
        return RowTable(model, (2,), max_seq_len=64, max_denoising_steps=64, config=cfg)

    def run(b: RowTable, retire_after: int | None) -> list[list[int]]:
        view = b.view(2)
        for row in range(2 if retire_after is not None else 1):
            b.admit(row, prompt, cfg, seed=row)
        view.refresh()
        canvases, frozen = [], None
        for k in range(12):
            if k == retire_after:
                b.retire(1)
                view.refresh()
                frozen = [t.clone() for t in held(b)]
            view.step()
            canvases.append(b.state.argmax[0].tolist())
            if frozen is not None:
                assert int(b.row_state.phase[1]) == FREE and not bool(b.row_state.event[1])
                for before, now in zip(frozen, held(b)):
                    assert torch.equal(before, now)
        return canvases

    retired = row_table()
    with_mate = run(retired, retire_after=2)
    assert with_mate == run(row_table(), retire_after=None)
