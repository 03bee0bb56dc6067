"""Constrained outputs (docs/constrained.md): every returned text is valid whatever the weights, unconstrained batch
mates keep their solo tokens, the compiled generator gives the eager oracle's tokens, bad constraints are refused.

Regex and choice run on the demo model (27-character vocabulary, canvas 16); JSON on a random-weight tiny checkpoint
with a byte-level tokenizer (canvas 8), where nearly every output spans several canvases."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dgemma_compile as dg
from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.constraint import Constraint, ConstraintError, GrammarLibrary, bitmask_words
from dgemma_compile.step.sampler import MASKED_LOGIT, mask_first
from dgemma_compile.inputs.text import encode_prompt

DEMO_PROMPTS = ["sort 3 1 2 9 5=", "add 12 5=", "reverse 1 2 3="]
SCHEMAS = [  # the held set: nested objects, bounded arrays, enums, numbers, strings with patterns, optional fields
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                                 "y": {"type": "boolean"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 7]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                                      "note": {"type": "string", "maxLength": 3}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"type": "number", "minimum": -5, "maximum": 5},
                                      "ok": {"enum": [True, None]}},
     "required": ["v", "ok"], "additionalProperties": False},
]


def _ids(tok, prompts):
    return [encode_prompt(tok, p, bos_token_id=2) for p in prompts]


def _text(tok, seq):
    return tok.decode(seq, skip_special_tokens=True)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """(model, tokenizer): random weights (vocabulary 264, canvas 8) and a byte-level tokenizer of 259 ids."""
    from helpers import write_byte_tokenizer, write_checkpoint

    d = write_checkpoint(tmp_path_factory.mktemp("bytes"), vocab_size=264, canvas_length=8)
    write_byte_tokenizer(d)
    return dg.load(d), dg.load_tokenizer(d)


# ----- the device half ---------------------------------------------------------------------------------------------

@settings(max_examples=25)
@given(V=st.integers(1, 100), B=st.integers(1, 3), data=st.data())
def test_mask_first_masks_only_constrained_first_positions(V, B, data):
    C = 3
    logits = torch.randn(B, C, V, generator=torch.Generator().manual_seed(V * 7 + B))
    allowed = torch.tensor([[data.draw(st.booleans()) for _ in range(V)] for _ in range(B)])
    constrained = torch.tensor([data.draw(st.booleans()) for _ in range(B)])
    words = torch.zeros(B, bitmask_words(V), dtype=torch.int64)
    for v in range(V):
        words[:, v // 32] |= allowed[:, v].long() << (v % 32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # int32 bit patterns, as xgrammar's
    out = mask_first(logits.clone(), words, constrained)
    expect = logits.clone()
    expect[:, 0] = torch.where(allowed | ~constrained[:, None], logits[:, 0], MASKED_LOGIT)
    assert torch.equal(out, expect)  # bitwise: unconstrained rows and positions > 0 untouched


@pytest.mark.slow
# ----- regex and choice on the demo ---------------------------------------------------------------------------------

def test_demo_mixed_batch_valid_and_unconstrained_rows_keep_solo_tokens(demo):
    model, tok = demo
    ids = _ids(tok, DEMO_PROMPTS)
    cfg = dg.GenerationConfig(max_new_tokens=40, max_denoising_steps=16)
    cons = [Constraint.regex(r"[0-9]( [0-9])*"), Constraint.choice(["17", "yes", "1 7"]), None]
    out = dg.generate(model, ids, cfg, seed=0, constraint=cons, tokenizer=tok)
    solo = dg.generate(model, [ids[2]], cfg, seed=0)
    assert out.sequences[2] == solo.sequences[0]
    assert [s.finish_reason for s in out.stats] == ["eos", "eos", "eos"]
    # a regex that admits the right answer keeps it (the demo sorts: 1 2 3 5 9)
    assert _text(tok, out.sequences[0]) == "1 2 3 5 9"
    assert _text(tok, out.sequences[1]) in ("17", "yes", "1 7")
    assert out.sequences[0][-1] in model.generation_config.resolved(model.config).eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_demo_value_spanning_two_canvases(demo, seed):
    """A fixed-format value longer than a canvas: the kept prefix of each block, committed, carries it across."""
    model, tok = demo
    C = model.config.canvas_length
    pattern = r"[0-9]{12} [a-z]{2,6}=[0-9]{3}"  # at least 20 characters: more than one canvas of 16
    out = dg.generate(model, _ids(tok, ["add 12 5="]), dg.GenerationConfig(max_new_tokens=40, max_denoising_steps=4),
                      seed=seed, constraint=Constraint.regex(pattern), tokenizer=tok)
    text, stats = _text(tok, out.sequences[0]), out.stats[0]
    assert stats.finish_reason == "eos" and re.fullmatch(pattern, text), (text, stats)
    assert len(text) > C and stats.blocks >= 2


@pytest.mark.slow
def test_budget_too_small_returns_length_with_a_valid_prefix(demo):
    model, tok = demo
    choice = "9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9"
    out = dg.generate(model, _ids(tok, ["sort 3 1 2 9 5=", "add 12 5="]),
                      dg.GenerationConfig(max_new_tokens=4, max_denoising_steps=2),
                      seed=0, constraint=[Constraint.choice([choice]), Constraint.regex(r"[0-9]{30}")],
                      tokenizer=tok)
    for seq, stats in zip(out.sequences, out.stats):
        assert stats.finish_reason == "length" and len(seq) == 4
    assert _text(tok, out.sequences[0]) == choice[:4]
    assert re.fullmatch(r"[0-9]{4}", _text(tok, out.sequences[1]))


@pytest.mark.slow
def test_fast_mixed_pair_unconstrained_row_keeps_its_solo_tokens(demo):
    model, tok = demo
    ids = _ids(tok, ["add 12 5=", "sort 3 1 2 9 5="])
    cfg = dg.GenerationConfig(max_new_tokens=16, max_denoising_steps=6)
    out = dg.generate(model, ids, cfg, seed=0, constraint=[Constraint.regex(r"[0-9]+"), None], tokenizer=tok)
    assert out.sequences[1] == dg.generate(model, [ids[1]], cfg, seed=0).sequences[0]
    assert out.stats[0].finish_reason == "eos" and re.fullmatch(r"[0-9]+", _text(tok, out.sequences[0]))


def test_dead_end_and_unspellable_grammars(demo):
    model, tok = demo
    ids = _ids(tok, ["add 12 5="])
    with pytest.raises(ConstraintError, match="no token of the model's vocabulary can begin this regex"):
        dg.generate(model, ids, seed=0, constraint=Constraint.regex("x|y"), tokenizer=tok)
    out = dg.generate(model, ids, dg.GenerationConfig(max_new_tokens=8), seed=0,
                      constraint=Constraint.regex("ab|x"), tokenizer=tok)  # 'a' spells, 'b' does not: a dead end
    assert _text(tok, out.sequences[0]) == "a" and out.stats[0].finish_reason == "length"


def test_refusals_name_the_parameter(demo):
    model, tok = demo
    ids = _ids(tok, ["add 12 5="])
    with pytest.raises(ConfigError, match="^tokenizer:"):
        dg.generate(model, ids, constraint=Constraint.regex("[0-9]+"))
    with pytest.raises(ConstraintError, match="cannot compile this regex"):
        dg.generate(model, ids, constraint=Constraint.regex("([0-9]"), tokenizer=tok)
    with pytest.raises(ConstraintError, match="cannot compile this json_schema"):
        dg.generate(model, ids, constraint=Constraint.json_schema({"type": "foo"}), tokenizer=tok)
    with pytest.raises(ConfigError, match="^ignore_eos:"):
        dg.generate(model, ids, dg.GenerationConfig(ignore_eos=True), constraint=Constraint.regex("[0-9]+"),
                    tokenizer=tok)
    with pytest.raises(ConfigError, match="^constraint: give one Constraint"):
        dg.generate(model, ids, constraint=[None, None], tokenizer=tok)
    for bad in (lambda: Constraint("grammar", "x"), lambda: Constraint.choice([]), lambda: Constraint.choice("ab"),
                lambda: Constraint.regex(""), lambda: Constraint.json_schema("{not json")):
        with pytest.raises(ConfigError, match="^constraint:"):
            bad()


@pytest.mark.slow
def test_choice_with_quotes_and_backslashes(byte_model):
    model, tok = byte_model
    options = ['say "hi"', "a\\b", "tab\there"]
    out = dg.generate(model, _ids(tok, ["x", "y", "z"]), dg.GenerationConfig(max_new_tokens=24, max_denoising_steps=2),
                      seed=[0, 1, 2], constraint=Constraint.choice(options), tokenizer=tok)
    for seq, stats in zip(out.sequences, out.stats):
        assert stats.finish_reason == "eos" and _text(tok, seq) in options


@pytest.mark.slow
# ----- JSON on random weights ---------------------------------------------------------------------------------------

def test_json_schemas_always_valid_on_random_weights(byte_model):
    model, tok = byte_model
    seeds = [0, 1]
    cons = [Constraint.json_schema(s) for s in SCHEMAS for _ in seeds] + [Constraint.json_object(), None]
    prompts = _ids(tok, ["{"] * len(cons))
    cfg = dg.GenerationConfig(max_new_tokens=64, max_denoising_steps=2)
    out = dg.generate(model, prompts, cfg, seed=seeds * len(SCHEMAS) + [3, 4], constraint=cons, tokenizer=tok)
    C = model.config.canvas_length
    lib = GrammarLibrary.for_model(tok, model, [1])
    ended = 0
    for i, (seq, stats) in enumerate(zip(out.sequences[:-1], out.stats)):
        text = _text(tok, seq)
        if stats.finish_reason == "eos":
            ended += 1
            value = json.loads(text)
            if i < len(SCHEMAS) * len(seeds):
                jsonschema.validate(value, SCHEMAS[i // len(seeds)])
            else:
                assert isinstance(value, dict)
        else:  # the budget ran out first: a prefix a fresh matcher accepts whole
            assert stats.finish_reason == "length" and len(seq) == 64
            g = lib.matcher(cons[i])
            assert g.accept(seq) == len(seq)
    assert ended >= len(SCHEMAS)  # most end inside the budget
    assert max(len(s) for s in out.sequences[:-1]) > 2 * C  # values across several canvases
    solo = dg.generate(model, [prompts[-1]], cfg, seed=4)
    assert out.sequences[-1] == solo.sequences[0]


@pytest.mark.slow
def test_fused_commits_keep_the_prefix(byte_model):
    """Commit fusion commits the kept prefix (n_new < C) in the next block's first step: still valid JSON."""
    model, tok = byte_model
    out = dg.generate(model, _ids(tok, ["{", "["]), dg.GenerationConfig(max_new_tokens=64, max_denoising_steps=2),
                      seed=[5, 6], constraint=Constraint.json_schema(SCHEMAS[0]), tokenizer=tok, fuse_commit=True)
    assert out.fused_commits > 0
    for seq, stats in zip(out.sequences, out.stats):
        if stats.finish_reason == "eos":
            jsonschema.validate(json.loads(_text(tok, seq)), SCHEMAS[0])
    assert any(s.finish_reason == "eos" for s in out.stats)


# ----- compiled against the eager oracle ---------------------------------------------------------------------------

@pytest.mark.slow
def test_compiled_constrained_equals_eager(demo, demo_gen):
    """Three requests over a bucket of 2 rows (one waits for a row), constrained and not: the compiled generator's
    tokens equal the eager oracle's, with one compile; the unconstrained row equals its solo run."""
    model, tok = demo
    gen = demo_gen
    ids = _ids(tok, DEMO_PROMPTS)
    cfg = dg.GenerationConfig(max_new_tokens=40, max_denoising_steps=8)
    cons = [Constraint.regex(r"[0-9]{12} [a-z]{2,6}=[0-9]{3}"), None, Constraint.choice(["3 2 1", "no"])]
    ref = dg.generate(model, ids, cfg, seed=[0, 1, 2], constraint=cons, tokenizer=tok, moe_impl=gen.moe_impl,
                      max_seq_len=256)
    out = gen.generate(ids, cfg, seed=[0, 1, 2], constraint=cons, tokenizer=tok)
    assert out.sequences == ref.sequences
    assert [s.finish_reason for s in out.stats] == [s.finish_reason for s in ref.stats]
    assert out.sequences[1] == gen.generate([ids[1]], cfg, seed=1).sequences[0]
    assert max(gen.ready.values()) == 1  # compiled, or loaded from the compile cache


# ----- the command line ---------------------------------------------------------------------------------------------

def test_cli_constraint_errors(capsys, tmp_path):
    from dgemma_compile.cli import main

    assert main(["generate", "sort 1 2=", "--regex", "([0-9]", "--eager"]) == 2
    assert "dgemma: error: constraint: the grammar library cannot compile this regex" in capsys.readouterr().err
    assert main(["generate", "sort 1 2=", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "dgemma: error: --json-schema: cannot read" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{nope")
    assert main(["generate", "sort 1 2=", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    # one kind per invocation (argparse's own error: status 2, returned as every other)
    assert main(["generate", "sort 1 2=", "--regex", "[0-9]", "--choice", "1"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_regex_and_choice(capsys):
    from dgemma_compile.cli import main

    assert main(["generate", "sort 3 1 2 9 5=", "--regex", "[0-9]( [0-9])*", "--eager",
                 "--max-denoising-steps", "8"]) == 0
    out = capsys.readouterr()
    assert out.out == "1 2 3 5 9\n" and "finish=eos" in out.err
    assert main(["generate", "sort 3 1 2 9 5=", "--choice", "9 9", "--choice", "1 2", "--eager",
                 "--max-denoising-steps", "8"]) == 0
    assert capsys.readouterr().out.strip() in ("9 9", "1 2")


def test_row_grammar_accept_peek_and_bitmask(demo):
    model, tok = demo
    lib = GrammarLibrary.for_model(tok, model, [1])
    g = lib.matcher(Constraint.regex(r"[0-9]( [0-9])*"))
    ids = tok("1 2+3", add_special_tokens=False)["input_ids"]
    digits = set(tok("0123456789", add_special_tokens=False)["input_ids"])

    def allowed():
        m = g.bitmask()
        return {v for v in range(model.config.vocab_size) if (int(m[v // 32]) >> (v % 32)) & 1}

    assert allowed() == digits
    assert g.peek(ids) == 3 and allowed() == digits  # peeking leaves the state where it was
    assert g.accept(ids) == 3 and not g.terminated  # "1 2" kept, "+" rejected
    assert allowed() == {tok.convert_tokens_to_ids(" "), 1}  # a space or the eos that completes it
    assert g.accept([1, 5]) == 1 and g.terminated and not g.dead_end and not bool(g.bitmask().any())


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
def test_engine_constrained_rows_equal_the_oracle(demo, fuse):
    """The serving engine (eager step, paged KV with the prefix cache, 2 rows for 3 requests): each request's tokens
    equal its solo `generate` run with the same constraint and commit fusion; drafts of the constrained request are
    prefixes its grammar accepts."""
    from dgemma_runtime import build_engine
    from dgemma_runtime.engine import Request

    model, tok = demo
    engine = build_engine(model, max_batch=2, max_seq_len=256, eager=True, tokenizer=tok, page_size=16,
                          fuse_commit=fuse)
    cfg = model.generation_config.replace(max_new_tokens=40, max_denoising_steps=8).resolved(model.config)
    pattern = r"[0-9]{12} [a-z]{2,6}=[0-9]{3}"
    cases = [("add 12 5=", Constraint.regex(pattern)), ("rev 1 2 3 4 5 6 7 8 9 0 1=", None),
             ("sort 3 1 2=", Constraint.choice(["1 2 3", "no"]))]
    events: dict[int, list] = {i: [] for i in range(len(cases))}
    reqs = [engine.submit(Request(prompt=_ids(tok, [p])[0], config=cfg, seed=i, constraint=c,
                                  draft_every=1 if i == 0 else 0, on_event=events[i].append))
            for i, (p, c) in enumerate(cases)]
    while not engine.idle():
        engine.step()
    for i, ((p, c), req) in enumerate(zip(cases, reqs)):
        ref = dg.generate(model, _ids(tok, [p]), cfg, seed=i, constraint=c, tokenizer=tok, moe_impl="dense",
                          max_seq_len=256, fuse_commit=fuse)
        assert req.sequence == ref.sequences[0] and req.stats.finish_reason == ref.stats[0].finish_reason
    assert re.fullmatch(pattern, _text(tok, reqs[0].sequence))
    committed, drafts = [], 0
    for e in events[0]:  # in order: each draft extends what the blocks before it kept
        if e.draft:
            drafts += 1
            g = GrammarLibrary.for_model(tok, model, [1]).matcher(cases[0][1])
            assert g.accept(committed + e.tokens) == len(committed) + len(e.tokens)
        else:
            committed += e.tokens
    assert drafts


@settings(max_examples=20)
@given(V=st.integers(1, 200), data=st.data())
def test_pack_bitmask_is_xgrammars_layout(V, data):
    from dgemma_compile.inputs.constraint import pack_bitmask

    allowed = torch.tensor([data.draw(st.booleans()) for _ in range(V)])
    words = pack_bitmask(allowed)
    assert words.dtype == torch.int32 and words.shape == (bitmask_words(V),)
    unpacked = [(int(words[v // 32]) >> (v % 32)) & 1 == 1 for v in range(V)]
    assert unpacked == allowed.tolist()
    # the device half reads it the same way
    logits = torch.zeros(1, 1, V)
    out = mask_first(logits, words[None], torch.tensor([True]))
    assert (out[0, 0] == 0).tolist() == allowed.tolist()
