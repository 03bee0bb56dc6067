"""Seeded and pinned canvases (`canvas.py`, issue 40 item 1): `generate(canvas=...)` on both generators, the engine,
the server's `diffusion_seed_canvas` / `diffusion_pinned` and `dgemma generate --template`.

- Pinned positions come back unchanged and free ones are generated, over a template that spans two blocks; a fully
  pinned block commits in its first step (one decoder pass).
- Rows without a canvas keep their solo tokens bit for bit beside a pinned row, on the eager oracle and on the driver
  (the compiled generator's eager step; slow tier: its compiled step), and the driver's pinned tokens are the
  oracle's.
- The constrained-output path composes: a template inside a JSON schema gives valid JSON holding the template.
- Bad canvases are ConfigErrors naming the parameter; the server's are 400s naming the field.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest
import torch

import dgemma_compile as dg
from dgemma_compile.step.canvas import BLANK, Canvas, parse_template
from dgemma_compile.compile import CompileOptions, build
from dgemma_compile.inputs.constraint import Constraint
from dgemma_compile.step.sampler import SampleStep, pin
from dgemma_compile.inputs.text import encode_prompt

SORT = "sort 5 3 9 1 2="
REV = "rev 1 2 3 4 5 6 7 8 9 0 1="  # answer "1 0 9 8 7 6 5 4 3 2 1": two blocks of 16
SLOTS = 256


def _ids(tok, model, text: str) -> list[int]:
    return encode_prompt(tok, text, bos_token_id=model.config.bos_token_id)


def _hot(model, max_new_tokens: int = 24, **kw):
    """A schedule hot enough that free positions are renoised for several steps on the demo."""
    return model.generation_config.replace(max_new_tokens=max_new_tokens, **kw).with_temperature(3.0)


def _check_pins(seq: list[int], canvas: Canvas) -> None:
    for i, t in enumerate(canvas.ids[:len(seq)]):
        if t is not None:
            assert seq[i] == t, (i, seq, canvas.ids)


# ----- the device rule -------------------------------------------------------------------------------------------------

def test_pin_keeps_unpinned_values_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    B, C, V = 3, 5, 11
    step = SampleStep(argmax=torch.randint(V, (B, C), generator=g), sampled=torch.randint(V, (B, C), generator=g),
                      entropy=torch.rand(B, C, generator=g), sc_probs=torch.rand(B, C, V, generator=g).softmax(-1))
    pinned = torch.zeros(B, C, dtype=torch.bool)
    pinned[1, 2] = pinned[2] = True
    ids = torch.randint(V, (B, C), generator=g)
    out = pin(step, pinned, ids)
    free = ~pinned
    for a, b in zip(out, step):
        assert torch.equal(a[free], b[free])
    assert torch.equal(out.argmax[pinned], ids[pinned]) and torch.equal(out.sampled[pinned], ids[pinned])
    assert (out.entropy[pinned] == 0).all() and out.sc_probs is step.sc_probs


def _one_hot_product(model, probs, pinned, ids, local=False):
    """What the step computed before pins moved to D width: probs made one-hot over the vocabulary at pinned
    positions, then the soft embedding (the reference the D-width pin must equal bit for bit)."""
    first = 0 if model.vocab_shard is None or not local else model.vocab_shard.start
    one_hot = (torch.arange(probs.shape[-1]) + first == ids[..., None]).to(probs.dtype)
    return model.self_conditioning_embedding(torch.where(pinned[..., None], one_hot, probs), local=local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pinned_self_conditioning_equals_the_one_hots_soft_embedding(demo, dtype):
    """`self_conditioning_embedding(..., pinned_BT, ids_BT)` selects the pinned tokens' rows at D width: the bits of
    the one-hot's soft embedding over the vocabulary (one nonzero term per output is the row exactly); other
    positions keep the product's bits."""
    import copy

    model = copy.deepcopy(demo[0]).to(dtype)
    g = torch.Generator().manual_seed(1)
    B, C, V = 3, 6, model.config.vocab_size
    probs = torch.rand(B, C, V, generator=g).softmax(-1)
    pinned = torch.zeros(B, C, dtype=torch.bool)
    pinned[0, 1] = pinned[2, 3:] = True
    ids = torch.randint(V, (B, C), generator=g)
    got = model.self_conditioning_embedding(probs, pinned_BT=pinned, ids_BT=ids)
    assert got.dtype == dtype
    assert torch.equal(got, _one_hot_product(model, probs, pinned, ids))
    plain = model.self_conditioning_embedding(probs)
    assert torch.equal(got[~pinned], plain[~pinned]) and not torch.equal(got, plain)


def test_pinned_self_conditioning_under_tensor_parallel_adds_no_collective():
    """Two ranks' vocabulary slices (one process, torch's fake process group: its all-reduce returns the rank's own
    term, so the two ranks' terms are summed here): the pinned row comes from the rank that holds it, zero from the
    other, inside the product's one all-reduce; the sum equals the one-hot's soft embedding bit for bit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dgemma_compile.demo import DEMO_MODEL
    from dgemma_compile.parallel.vocab import VocabParallelProduct, local_rows, vocab_range

    model = dg.load(DEMO_MODEL)
    g = torch.Generator().manual_seed(2)
    B, C, V = 2, 5, model.config.vocab_size
    probs = torch.rand(B, C, V, generator=g).softmax(-1)
    pinned = torch.rand(B, C, generator=g) < 0.5
    ids = torch.randint(V, (B, C), generator=g)
    table = model.embed_tokens.weight.detach()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    one_hot = torch.nn.functional.one_hot(ids, V).to(probs.dtype)
    try:
        got, want = 0, 0
        for rank in range(2):
            start, _ = vocab_range(V, rank, 2)
            product = VocabParallelProduct(torch.nn.Parameter(local_rows(table, rank, 2), requires_grad=False),
                                           start, V, dist.group.WORLD)
            got = got + product(probs, pinned, ids)
            want = want + product(torch.where(pinned[..., None], one_hot, probs))  # the one-hot, as before
    finally:
        dist.destroy_process_group()
    assert torch.equal(got, want)
    assert torch.equal(got[pinned], table[ids[pinned]])


def test_parse_template(demo):
    _, tok = demo
    ids = parse_template("sort _ _=", tok)
    assert [tok.decode([t]) if t is not None else None for t in ids] == list("sort ") + [None, " ", None, "="]
    assert parse_template(BLANK * 3, tok) == [None] * 3


# ----- the eager oracle ------------------------------------------------------------------------------------------------

def test_pinned_positions_unchanged_free_filled_across_two_blocks(demo):
    """A template over 24 positions (two blocks of 16): every pinned position comes back, the free ones are
    generated; the free positions hold digits (the model fills the answer's slots)."""
    model, tok = demo
    template = "_ 0 _ 8 _ 6 _ 4 _ 2 _"  # the second block starts inside it
    cfg = _hot(model, ignore_eos=True, max_new_tokens=24)
    out = dg.generate(model, [_ids(tok, model, REV)], cfg, seed=3, canvas=template, tokenizer=tok, max_seq_len=SLOTS)
    seq = out.sequences[0]
    cv = Canvas(tuple(parse_template(template, tok)))
    assert len(seq) == 24 and len(out.stats[0].steps_per_block) == 2
    _check_pins(seq, cv)
    text = tok.decode(seq[:len(cv.ids)], skip_special_tokens=True)
    assert all(text[i].isdigit() for i in range(0, len(template), 4)), text


def test_fully_pinned_block_commits_in_its_first_step(demo):
    """Block 0 entirely pinned: one decoder pass, its tokens the canvas; block 1 (free) denoises as usual."""
    model, tok = demo
    C = model.config.canvas_length
    ids = tok.encode("9 9 9 9 9 9 9 9 ", add_special_tokens=False)
    assert len(ids) == C
    cfg = _hot(model, max_new_tokens=2 * C, ignore_eos=True)
    out = dg.generate(model, [_ids(tok, model, REV)], cfg, seed=1, canvas=[ids], max_seq_len=SLOTS)
    assert out.stats[0].steps_per_block[0] == 1 and out.sequences[0][:C] == ids
    assert out.stats[0].steps_per_block[1] > 1
    # fused commits: the same
    fused = dg.generate(model, [_ids(tok, model, REV)], cfg, seed=1, canvas=[ids], max_seq_len=SLOTS,
                        fuse_commit=True)
    assert fused.stats[0].steps_per_block[0] == 1 and fused.sequences[0][:C] == ids


def test_unpinned_batch_mates_keep_their_solo_tokens(demo):
    model, tok = demo
    cfg = _hot(model)
    prompts = [_ids(tok, model, SORT), _ids(tok, model, REV), _ids(tok, model, SORT)]
    out = dg.generate(model, prompts, cfg, seed=[3, 4, 5], canvas=[None, "_ _ _ 7 _ _", None], tokenizer=tok,
                      max_seq_len=SLOTS)
    plain = dg.generate(model, prompts, cfg, seed=[3, 4, 5], max_seq_len=SLOTS)
    assert out.sequences[0] == plain.sequences[0] and out.sequences[2] == plain.sequences[2]
    assert out.stats[0].steps_per_block == plain.stats[0].steps_per_block
    _check_pins(out.sequences[1], Canvas(tuple(parse_template("_ _ _ 7 _ _", tok))))


def test_seeded_not_pinned_is_a_warm_start(demo):
    """`Canvas(pinned=False)`: the block starts from its tokens but they are not held; a greedy schedule then
    gives tokens that need not be the seed's (and the run differs from the pinned one somewhere)."""
    model, tok = demo
    seed_ids = tuple(tok.encode("7 7 7 7 7", add_special_tokens=False))
    cfg = _hot(model, max_new_tokens=16)
    warm = dg.generate(model, [_ids(tok, model, SORT)], cfg, seed=2, canvas=[Canvas(seed_ids, pinned=False)],
                       max_seq_len=SLOTS)
    held = dg.generate(model, [_ids(tok, model, SORT)], cfg, seed=2, canvas=[Canvas(seed_ids)], max_seq_len=SLOTS)
    assert held.sequences[0][:len(seed_ids)] == list(seed_ids)
    assert warm.sequences[0][:len(seed_ids)] != list(seed_ids)  # the model's sorted answer wins over the seed


def test_bad_canvases_name_the_parameter(demo):
    model, tok = demo
    p = [_ids(tok, model, SORT)]
    cfg = model.generation_config.replace(max_new_tokens=8)
    V = model.config.vocab_size
    for bad, match in [([[1, 2], [3]], r"canvas: give"), ([[V]], r"canvas\[0\]: token ids"),
                       ([[True]], r"canvas\[0\]: token ids"), ([[None, None]], r"canvas\[0\]: no position"),
                       ([[]], r"canvas\[0\]: an empty"), ([[5] * 9], r"canvas\[0\]: 9 positions, more than "
                                                                   r"max_new_tokens=8"), ([3.5], r"canvas\[0\]")]:
        with pytest.raises(dg.ConfigError, match=match):
            dg.generate(model, p, cfg, canvas=bad, tokenizer=tok)
    with pytest.raises(dg.ConfigError, match="tokenizer"):
        dg.generate(model, p, cfg, canvas="_ 1")


# ----- the driver (the compiled generator's step) ---------------------------------------------------------------------

def _pinned_batch(model, tok):
    prompts = [_ids(tok, model, REV), _ids(tok, model, SORT)]
    return prompts, _hot(model, ignore_eos=True), ["_ 0 _ 8 _ 6 _ 4 _ 2 _", None]


def test_driver_pinned_equals_the_oracle(demo):
    """The driver over the eager step: the pinned request's tokens and steps are the oracle's, its batch mate keeps
    its solo tokens."""
    model, tok = demo
    prompts, cfg, canvases = _pinned_batch(model, tok)
    gen = build(model, CompileOptions(batch_buckets=(2,), max_seq_len=SLOTS))
    gen.defer(None)  # the step runs eagerly: no compile in the fast tier
    out = gen.generate(prompts, cfg, seed=[3, 4], canvas=canvases, tokenizer=tok)
    plain = gen.generate(prompts, cfg, seed=[3, 4])
    assert out.sequences[1] == plain.sequences[1]
    ref = dg.generate(model, prompts[:1], cfg, seed=3, canvas=canvases[:1], tokenizer=tok, max_seq_len=SLOTS,
                      moe_impl=gen.moe_impl)
    assert out.sequences[0] == ref.sequences[0]
    assert out.stats[0].steps_per_block == ref.stats[0].steps_per_block
    _check_pins(out.sequences[0], Canvas(tuple(parse_template(canvases[0], tok))))


@pytest.mark.slow  # compiles the demo's step (the session's `demo_gen`, shared with other slow tests)
def test_compiled_pinned_equals_the_oracle(demo, demo_gen):
    """The compiled step: pinned tokens equal the oracle's, the unpinned batch mate its solo run's, a fully pinned
    block one pass; the pins are data (no recompile after the first call)."""
    model, tok = demo
    prompts, cfg, canvases = _pinned_batch(model, tok)
    plain = demo_gen.generate(prompts, cfg, seed=[3, 4])
    out = demo_gen.generate(prompts, cfg, seed=[3, 4], canvas=canvases, tokenizer=tok)
    assert out.sequences[1] == plain.sequences[1]
    ref = dg.generate(model, prompts[:1], cfg, seed=3, canvas=canvases[:1], tokenizer=tok, max_seq_len=SLOTS,
                      moe_impl=demo_gen.moe_impl)
    assert out.sequences[0] == ref.sequences[0]
    assert out.stats[0].steps_per_block == ref.stats[0].steps_per_block
    C = model.config.canvas_length
    ids = tok.encode("9 9 9 9 9 9 9 9 ", add_special_tokens=False)
    compiles = dict(demo_gen.compiles)
    full = demo_gen.generate(prompts[:1], cfg.replace(max_new_tokens=C), seed=1, canvas=[ids])
    assert full.stats[0].steps_per_block == [1] and full.sequences[0] == ids
    assert dict(demo_gen.compiles) == compiles  # other pins, no recompile: the pins are data


def test_engine_pinned_request(demo):
    """The serving engine (the same driver): a pinned request's tokens are the oracle's."""
    from dgemma_compile.step.row_table import RowTable
    from dgemma_runtime import Engine, Request

    model, tok = demo
    prompts, cfg, canvases = _pinned_batch(model, tok)
    cfg = cfg.resolved(model.config)
    cv = Canvas(tuple(parse_template(canvases[0], tok)))
    engine = Engine(model, RowTable(model, (1, 2), max_seq_len=SLOTS, max_denoising_steps=64), tokenizer=tok)
    req = engine.submit(Request(prompt=prompts[0], config=cfg, seed=3, canvas=cv))
    while not engine.idle():
        engine.step()
    ref = dg.generate(model, prompts[:1], cfg, seed=3, canvas=[cv], max_seq_len=SLOTS, moe_impl="dense")
    assert req.sequence == ref.sequences[0]
    _check_pins(req.sequence, cv)
    with pytest.raises(dg.ConfigError, match=r"canvas: token ids must be integers in \[0, 27\)"):
        engine.submit(Request(prompt=prompts[0], config=cfg, seed=3, canvas=Canvas((None, 27))))


# ----- constrained outputs -------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["code", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """(model, tokenizer): random weights (vocabulary 264, canvas 8) and a byte-level tokenizer of 259 ids."""
    from helpers import write_byte_tokenizer, write_checkpoint

    d = write_checkpoint(tmp_path_factory.mktemp("bytes"), vocab_size=264, canvas_length=8)
    write_byte_tokenizer(d)
    return dg.load(d), dg.load_tokenizer(d)


def test_template_inside_a_json_schema(byte_model):
    """A template inside a JSON schema on random weights: whatever ends with eos is valid JSON under the schema, and
    its pinned characters are the template's (the grammar masks each block's first position, the pins hold theirs)."""
    model, tok = byte_model
    template = '{"code": "___", "n": __}'
    cfg = dg.GenerationConfig(max_new_tokens=40, max_denoising_steps=3)
    seeds = [0, 1, 2, 3]
    out = dg.generate(model, [encode_prompt(tok, "x", bos_token_id=2)] * len(seeds), cfg, seed=seeds,
                      constraint=Constraint.json_schema(SCHEMA), canvas=template, tokenizer=tok)
    for seq, st in zip(out.sequences, out.stats):
        text = tok.decode(seq, skip_special_tokens=True)
        assert st.finish_reason == "eos", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch(r'\{"code": "[A-Z][0-9]{2}", "n": [0-9]{1,2}\}', text), text  # the template's text
        assert st.steps_per_block[0] == 1  # '{"code":' is the whole first canvas (C = 8): pinned, one pass


# ----- the server ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pin_server(demo):
    from test_serve import eager_demo_server

    with eager_demo_server(demo) as srv:
        yield srv


def test_server_seed_canvas(pin_server, demo):
    model, tok = demo
    body = {"model": "dgemma-demo", "prompt": REV, "max_tokens": 24, "seed": 3, "temperature": 3.0,
            "ignore_eos": True, "diffusion_seed_canvas": "_ 0 _ 8 _ 6 _ 4 _ 2 _"}
    r = httpx.post(pin_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text[2::4][:5] == "08642", text
    ids = [None, 11] + [None] * 10  # "_7": id lists too (11 is "7")
    chat = {"model": "dgemma-demo", "messages": [{"role": "user", "content": SORT}], "max_tokens": 16, "seed": 1,
            "diffusion_seed_canvas": ids}
    r = httpx.post(pin_server.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"][1] == "7"


@pytest.mark.parametrize("extra, field", [
    ({"diffusion_pinned": True}, "diffusion_pinned"),
    ({"diffusion_seed_canvas": ""}, "diffusion_seed_canvas"),
    ({"diffusion_seed_canvas": [99]}, "diffusion_seed_canvas"),
    ({"diffusion_seed_canvas": "_" * 40}, "diffusion_seed_canvas"),
    ({"diffusion_seed_canvas": "_1", "diffusion_pinned": "yes"}, "diffusion_pinned"),
    ({"diffusion_seed_canvas": "_1", "n": 2, "diffusion_seed_canvas_x": 1}, "diffusion_seed_canvas_x"),
    ({"diffusion_read_only": [0]}, "diffusion_read_only"),
])
def test_server_canvas_400s_name_the_field(pin_server, extra, field):
    body = {"model": "dgemma-demo", "prompt": SORT, "max_tokens": 16, **extra}
    r = httpx.post(pin_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.text


# ----- the CLI -------------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a subprocess
def test_cli_template():
    """`dgemma generate --template`: the pinned characters come back; a template longer than the budget exits 2
    naming --template's parameter."""
    cmd = [sys.executable, "-m", "dgemma_compile.cli", "generate", "--eager", "--seed", "1", SORT]
    out = subprocess.run(cmd + ["--template", "_ 7 _", "--max-new-tokens", "16"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0][1:4] == " 7 ", out.stdout
    bad = subprocess.run(cmd + ["--template", "_ 7 _ 8 _", "--max-new-tokens", "4"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "template: 9 positions, more than max_new_tokens=4" in bad.stderr


def test_openapi_lists_the_canvas_fields(pin_server):
    doc = httpx.get(pin_server.url + "/openapi.json", timeout=30).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        canvas, pinned = props["diffusion_seed_canvas"], props["diffusion_pinned"]
        kinds = [a.get("type") for a in canvas["anyOf"]]
        assert kinds == ["string", "array", "null"] and "'_'" in canvas["description"]
        assert canvas["anyOf"][1]["items"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
        assert [a.get("type") for a in pinned["anyOf"]] == ["boolean", "null"]
