"""Per-call overhead of compiled units: direct calls of the compiled graph (`CompileOptions.direct_calls`), guard
skipping inside Dynamo calls (`CompileOptions.skip_guards`), and the checks that make them sound (the model's
`units.ModelFingerprint` and the units' owners, checked once per generate/warmup call). bench/overhead.py measures
what they save."""

import dataclasses
import logging
import types

import pytest
import torch
import torch._dynamo.eval_frame

import dgemma_compile as dg
from dgemma_compile.compile import CompileOptions, CompiledUnit, build
from dgemma_compile.compile.units import ModelChangedError, ModelFingerprint, UnitFactory
from dgemma_compile.model.config import ConfigError

PROMPTS = [[2, 5, 6, 7], [2, 9, 10]]


def _stance():
    """The current compiler stance. torch 2.13 has no public getter: `torch._dynamo.eval_frame._stance` is private."""
    return torch._dynamo.eval_frame._stance


def _counting_backend(counts: list):
    def backend(gm, example_inputs):
        counts.append(1)
        return gm.forward

    return backend


def _toy_unit(skip_guards: bool, counts: list):
    """A unit over a static buffer and a parameter, held by `buf` as a bucket's closure holds its buffers and the
    model (eager backend, counting compiles)."""
    buf = types.SimpleNamespace(x=torch.zeros(3), lin=torch.nn.Linear(3, 1, bias=False).requires_grad_(False))
    buf.lin.weight.data.fill_(1.0)
    unit = CompiledUnit("toy", lambda: buf.x.add_(buf.lin.weight.sum()), CompileOptions(skip_guards=skip_guards),
                        backend=_counting_backend(counts))
    return unit, buf


@pytest.mark.parametrize("skip_guards", [True, False])
def test_guards_are_skipped_inside_the_unit_only_after_its_first_call(skip_guards):
    """A parameter moved to float64 fails a guard: with guards evaluated the unit recompiles; with guards skipped
    (from the second call on: skipping before a compile is refused by torch) it runs its one entry unchecked, which
    is why the generator checks the model's fingerprint. After each call the stance is the default again, privately
    and by behaviour: under skip_guard_eval_unsafe a fresh compiled function's first call would be refused."""
    counts = []
    unit, buf = _toy_unit(skip_guards, counts)
    with torch.no_grad():
        unit()
        unit()
        assert buf.x.tolist() == [6.0, 6.0, 6.0] and len(counts) == 1
        buf.lin.to(torch.float64)
        unit()
    assert buf.x.tolist() == [9.0, 9.0, 9.0]
    # torch 2.11 (the GPU machine's) does not recompile either: it skips a parameter's tensor guards while its
    # module's __dict__ is unchanged (`skip_tensor_guards_with_matching_dict_tags`), and `.to()` swaps `.data` in
    # place; the generator's `ModelFingerprint` check is what catches such a change
    guarded = not skip_guards and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
    assert len(counts) == (2 if guarded else 1)
    assert _stance() == torch._dynamo.eval_frame.DynamoStance()
    fresh = torch.compile(lambda t: t + 1, backend="eager", fullgraph=True)
    assert fresh(torch.ones(1)).item() == 2.0


def test_skipping_keeps_the_callers_stance():
    """A caller's `fail_on_recompile` stays in force around and after a skipping call (the stance is process-global;
    the unit sets only skip_guard_eval_unsafe, and only for its own call)."""
    counts = []
    unit, buf = _toy_unit(True, counts)
    with torch.no_grad():
        unit()
        with torch.compiler.set_stance("fail_on_recompile"):
            unit()
            assert _stance().stance == "fail_on_recompile" and not _stance().skip_guard_eval_unsafe
    assert _stance() == torch._dynamo.eval_frame.DynamoStance()
    assert len(counts) == 1 and buf.x.tolist() == [6.0, 6.0, 6.0]


def test_a_refused_skipping_call_reruns_with_every_guard(caplog):
    """Skipping keeps the tensor guards of inputs that are not parameters (the static buffers): a buffer rebound to
    another dtype makes torch refuse the skipping call before it runs; the unit logs it and reruns with every guard,
    which recompiles, and the step is applied once. The same path serves a unit whose cache entry was dropped by
    `torch._dynamo.reset()`."""
    counts = []
    unit, buf = _toy_unit(True, counts)
    with torch.no_grad():
        unit()
        unit()
        buf.x = torch.zeros(3, dtype=torch.float64)
        with caplog.at_level(logging.WARNING, logger="dgemma_compile"):
            unit()
    assert len(counts) == 2 and buf.x.tolist() == [3.0, 3.0, 3.0]
    assert "rerunning with every guard" in caplog.text
    assert _stance() == torch._dynamo.eval_frame.DynamoStance()


def test_skip_guards_must_be_a_bool():
    with pytest.raises(ConfigError, match="skip_guards"):
        CompileOptions(skip_guards=1)
    with pytest.raises(ConfigError, match="direct_calls"):
        CompileOptions(direct_calls="yes")


# ----- direct calls (Inductor, tiny graphs) -------------------------------------------------------------------------
def _owned_unit(fn_of_buf, options=None):
    """A unit made by `UnitFactory.unit` (Inductor, our backend) over `buf`, which owns a buffer and a module."""
    buf = types.SimpleNamespace(x=torch.zeros(3), lin=torch.nn.Linear(3, 1, bias=False).requires_grad_(False))
    buf.lin.weight.data.fill_(1.0)
    factory = UnitFactory(options or CompileOptions(), "cpu")
    return factory.unit("toy", lambda: fn_of_buf(buf), owners=(buf.lin, buf)), buf, factory


def _add_weight_sum(b) -> None:
    b.x.add_(b.lin.weight.sum())


def test_a_unit_calls_its_graph_directly_after_the_first_call(monkeypatch):
    """After one call through Dynamo the unit calls Inductor's compiled graph itself over the same tensors: the
    in-place step keeps being applied exactly once per call, and Dynamo is no longer entered (its compiled function
    is replaced by one that raises)."""
    unit, buf, factory = _owned_unit(_add_weight_sum)
    with torch.no_grad():
        unit()
        assert unit.direct is not None and unit.direct_refused is None
        monkeypatch.setattr(unit, "_compiled", lambda: pytest.fail("Dynamo was entered"))
        unit()
        unit()
        buf.lin.weight.data.fill_(2.0)  # in-place changes are read: the graph reads the very tensors
        unit()
    assert buf.x.tolist() == [15.0, 15.0, 15.0] and factory.compiles["toy"] == 1


@pytest.mark.parametrize("case", ["foreign input", "output"])
def test_direct_calls_are_refused_when_the_graph_is_not_only_the_owners_step(case, caplog):
    """A graph that reads a tensor its owners do not hold, or that returns an output (Dynamo would apply it), keeps
    going through Dynamo, with the reason logged and kept; results stay right."""
    foreign = torch.ones(3)

    def foreign_step(b):
        b.x.add_(foreign)

    def output_step(b):
        b.x.add_(1.0)
        return b.x * 2

    unit, buf, _ = _owned_unit(foreign_step if case == "foreign input" else output_step)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dgemma_compile"):
        unit()
        unit()
    assert unit.direct is None
    assert ("not a tensor of the unit's owners" if case == "foreign input" else "returns 1 output") in \
        unit.direct_refused
    assert "calls go through Dynamo" in caplog.text and buf.x.tolist() == [2.0, 2.0, 2.0]


def test_a_replaced_owner_tensor_sends_calls_back_through_dynamo(caplog):
    """`check_owners` (once per generate call): after a buffer is rebound, calls go through Dynamo again, which reads
    the new tensor (recompiling if its guards fail); without the check a direct call would update the old one."""
    unit, buf, _ = _owned_unit(_add_weight_sum, CompileOptions(skip_guards=False))
    with torch.no_grad():
        unit()
        unit.check_owners()  # nothing replaced: direct calls stay
        assert unit.direct is not None
        old = buf.x
        buf.x = torch.zeros(3)
        with caplog.at_level(logging.WARNING, logger="dgemma_compile"):
            unit.check_owners()
        unit()
    assert unit.direct is None and "replaced" in caplog.text
    assert buf.x.tolist() == [3.0, 3.0, 3.0] and old.tolist() == [3.0, 3.0, 3.0]


@pytest.mark.slow
def test_the_generator_units_call_directly(tiny_compiled):
    """The step of every batch size the shared generator has run calls its graph directly (the demo's step: see
    bench/results/overhead_cpu_*.md); batch 1 included (its block mask's index tensor was once a view, which no owner
    held)."""
    model, gen = tiny_compiled
    cfg = dg.GenerationConfig(max_new_tokens=4, max_denoising_steps=2)
    gen.generate(PROMPTS, cfg, seed=0)
    views = gen.row_table(cfg).views()
    assert views
    for view in views:
        assert view.step.direct is not None, (view.name, view.step.direct_refused)


@pytest.mark.slow
def test_direct_calls_give_the_same_tokens_as_dynamo_calls_with_every_guard(tiny_compiled):
    """The shared generator calls its graphs directly (the default); one with `direct_calls=False, skip_guards=False`
    (every call through Dynamo, every guard evaluated) on the same (unchanged) model and the same static shapes (the
    cache size can move float near-ties) gives the same tokens and stats, call after call."""
    model, skipping = tiny_compiled
    assert skipping.options.direct_calls and skipping.options.skip_guards
    guarded = build(model, dataclasses.replace(skipping.options, batch_buckets=(2,), skip_guards=False,
                                               direct_calls=False))
    cfg = dg.GenerationConfig(max_new_tokens=12, max_denoising_steps=4, t_min=0.5, t_max=1.5, eos_token_ids=(1,))
    for seed in (3, 4):
        a = skipping.generate(PROMPTS, cfg, seed=[seed, seed + 10])
        b = guarded.generate(PROMPTS, cfg, seed=[seed, seed + 10])
        assert a.sequences == b.sequences and a.stats == b.stats
    assert _stance() == torch._dynamo.eval_frame.DynamoStance()


@pytest.mark.slow
def test_a_changed_model_makes_generate_raise(tiny_dir):
    """After build and a generate: a replaced parameter's data, a changed model attribute, and `model.to(float64)`
    each make the next generate (and warmup) raise, naming what changed; restoring the model makes it run again with
    the same tokens. Own model: the shared one must not be mutated."""
    model = dg.load(tiny_dir)
    gen = build(model, CompileOptions(batch_buckets=(1,), max_seq_len=64))
    cfg = dg.GenerationConfig(max_new_tokens=8, max_denoising_steps=3, eos_token_ids=(1,))
    first = gen.generate(PROMPTS[:1], cfg, seed=1)

    p = model.layers[0].mlp.up_proj.weight
    original = p.data
    p.data = p.data.clone()
    with pytest.raises(ModelChangedError, match=r"model changed since build\(\): parameter "
                                                r"layers\.0\.mlp\.up_proj\.weight: data_ptr .*build a new generator"):
        gen.generate(PROMPTS[:1], cfg, seed=1)
    with pytest.raises(ModelChangedError, match="up_proj"):
        gen.warmup(1)
    p.data = original
    assert gen.generate(PROMPTS[:1], cfg, seed=1).sequences == first.sequences

    attention = model.attention
    model.attention = "dense" if attention != "dense" else "flex"
    with pytest.raises(ModelChangedError, match="attribute attention"):
        gen.generate(PROMPTS[:1], cfg, seed=1)
    model.attention = attention

    model.to(torch.float64)
    with pytest.raises(ModelChangedError,
                       match=r"model changed since build\(\): parameter \S+: dtype torch\.float32 -> torch\.float64, "
                             r".*\(and \d+ more\)"):
        gen.generate(PROMPTS[:1], cfg, seed=1)


def test_fingerprint_names_added_and_removed_tensors():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fp = ModelFingerprint.of(m)
    assert fp.changes(m) == []
    m.register_buffer("extra", torch.zeros(1))
    del m[0].bias
    m[0].bias = None
    assert fp.changes(m) == ["parameter 0.bias removed", "buffer extra added"]
