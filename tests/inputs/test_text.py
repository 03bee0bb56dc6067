"""Prompt assembly and incremental detokenization (`dgemma_compile.inputs.text`) on tokenizers built offline.

References are the `tokenizers` objects themselves (raw encode without special tokens, full decode) and the
templates rendered with jinja2 directly, never hard-coded ids.
"""

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from dgemma_compile.model.config import ConfigError
from dgemma_compile.model.loader import load_tokenizer
from dgemma_compile.inputs.text import (REPLACEMENT, Detokenizer, StopStrings, chat_template, encode_chat, encode_prompt, user_messages,
                                 with_one_bos)

SPECIALS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 as in Gemma
BOS = 2
CORPUS = ["hello world, the cat sat on the mat. unbelievable things happen " * 20, "sort 3 1 2 9 5= 1 2 3 5 9"]
TEMPLATE_NO_BOS = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
TEMPLATE_BOS = "{{ bos_token }}" + TEMPLATE_NO_BOS
TEMPLATE_NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")


def write_byte_bpe(directory: Path, *, bos_post_processor: bool, template: str | None = None,
                   template_in_config: str | None = None) -> Path:
    """A byte-level BPE (trained here on a tiny corpus: "é", "€" and most words outside it span several tokens) saved
    as transformers saves it; `template` goes to chat_template.jinja, `template_in_config` to tokenizer_config.json."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.token_to_id("<bos>") == BOS
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    if template is not None:
        fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    if template_in_config is not None:
        cfg_path = directory / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = template_in_config
        cfg_path.write_text(json.dumps(cfg))
    return directory


def raw_ids(directory: Path, text: str) -> list[int]:
    """The reference: the `tokenizers` object's own encoding, no special tokens."""
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def render(template: str, messages, add_generation_prompt=True) -> str:
    return jinja2.Environment().from_string(template).render(messages=messages, bos_token="<bos>",
                                                             add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module", params=[True, False], ids=["bos-post-processor", "no-post-processor"])
def bpe_dir(request, tmp_path_factory):
    return write_byte_bpe(tmp_path_factory.mktemp("bpe"), bos_post_processor=request.param, template=TEMPLATE_NO_BOS)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return load_tokenizer(write_byte_bpe(tmp_path_factory.mktemp("bpe1"), bos_post_processor=False))


# ----- prompt assembly ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["sort 3 1 2=", "héllo wörld €", "<bos>hello", " leading space"])
def test_raw_prompt_has_exactly_one_bos_with_or_without_a_post_processor(bpe_dir, text):
    tok = load_tokenizer(bpe_dir)
    ids = encode_prompt(tok, text, bos_token_id=BOS)
    body = [t for t in raw_ids(bpe_dir, text) if t != BOS] if text.startswith("<bos>") else raw_ids(bpe_dir, text)
    assert ids == [BOS] + body
    assert ids.count(BOS) == 1


def test_raw_prompt_without_a_model_bos_is_the_tokenizers_own(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert encode_prompt(tok, "hello", bos_token_id=None) == tok("hello")["input_ids"]


@pytest.mark.parametrize("template", [TEMPLATE_NO_BOS, TEMPLATE_BOS], ids=["template-no-bos", "template-bos"])
@pytest.mark.parametrize("post_processor", [True, False], ids=["bos-post-processor", "no-post-processor"])
def test_chat_prompt_has_exactly_one_bos(tmp_path, template, post_processor):
    d = write_byte_bpe(tmp_path, bos_post_processor=post_processor, template=template)
    messages = user_messages("sort 3 1 2=", system="be brief")
    ids = encode_chat(load_tokenizer(d), messages, bos_token_id=BOS)
    assert ids == [BOS] + raw_ids(d, render(TEMPLATE_NO_BOS, messages))
    assert ids.count(BOS) == 1


def test_chat_template_from_tokenizer_config_and_jinja_file_precedence(tmp_path):
    messages = user_messages("hi")
    only_config = write_byte_bpe(tmp_path / "config", bos_post_processor=True, template_in_config=TEMPLATE_NO_BOS)
    assert not (only_config / "chat_template.jinja").exists()
    assert encode_chat(load_tokenizer(only_config), messages, bos_token_id=BOS) == \
        [BOS] + raw_ids(only_config, render(TEMPLATE_NO_BOS, messages))
    other = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    both = write_byte_bpe(tmp_path / "both", bos_post_processor=True, template=other,
                          template_in_config=TEMPLATE_NO_BOS)
    # transformers reads chat_template.jinja first
    assert chat_template(load_tokenizer(both)) == other
    assert encode_chat(load_tokenizer(both), messages, bos_token_id=BOS) == \
        [BOS] + raw_ids(both, render(other, messages))


def test_missing_template_is_a_config_error(tmp_path):
    d = write_byte_bpe(tmp_path, bos_post_processor=True)
    with pytest.raises(ConfigError, match=r"^chat template: .* has none"):
        encode_chat(load_tokenizer(d), user_messages("hi"), bos_token_id=BOS)


def test_template_refusing_a_role_is_a_config_error(tmp_path):
    d = write_byte_bpe(tmp_path, bos_post_processor=True, template=TEMPLATE_NO_SYSTEM)
    tok = load_tokenizer(d)
    with pytest.raises(ConfigError, match="^chat template: System role not supported"):
        encode_chat(tok, user_messages("hi", system="x"), bos_token_id=BOS)
    assert encode_chat(tok, user_messages("hi"), bos_token_id=BOS) == [BOS] + raw_ids(d, "hi")


def test_literal_special_tokens_are_encodable(tiny_dir):
    """Special tokens written literally ("<bos>", "<eos>": a chat template's rendering) encode as those tokens, as
    the tokenizer splits them out; a leading "<bos>" collapses into the one BOS; stray characters are still named."""
    tok = load_tokenizer(tiny_dir)
    bos, eos = tok.convert_tokens_to_ids(tok.bos_token), tok.convert_tokens_to_ids(tok.eos_token)
    plain = encode_prompt(tok, "abc", bos_token_id=bos)
    assert encode_prompt(tok, tok.bos_token + "abc", bos_token_id=bos) == plain
    assert encode_prompt(tok, "abc" + tok.eos_token, bos_token_id=bos) == plain + [eos]
    with pytest.raises(ConfigError, match="^prompt: characters the model's tokenizer cannot encode: '✓'"):
        encode_prompt(tok, tok.bos_token + "abc ✓", bos_token_id=bos)


def test_empty_and_unencodable_text_names_the_field(tiny_dir, bpe):
    char_level = load_tokenizer(tiny_dir)  # has an unknown token
    with pytest.raises(ConfigError, match="^prompt: empty prompt"):
        encode_prompt(bpe, "", bos_token_id=BOS)
    with pytest.raises(ConfigError, match="^prompt: characters the model's tokenizer cannot encode: 'é✓'"):
        encode_prompt(char_level, "abc ✓ é é", bos_token_id=BOS)
    with pytest.raises(ConfigError, match="^system: characters the model's tokenizer cannot encode: '✓'"):
        encode_chat(char_level, user_messages("abc", system="✓"), bos_token_id=BOS)
    with pytest.raises(ConfigError, match="^system: empty system"):
        encode_chat(char_level, user_messages("abc", system=""), bos_token_id=BOS)
    with pytest.raises(ConfigError, match="^prompt: empty prompt"):
        encode_chat(char_level, user_messages(""), bos_token_id=BOS)
    assert encode_prompt(bpe, "é✓", bos_token_id=BOS)  # byte-level: everything encodes


def test_with_one_bos():
    assert with_one_bos([2, 2, 2, 5, 2], 2) == [2, 5, 2]
    assert with_one_bos([5, 6], 2) == [2, 5, 6]
    assert with_one_bos([], 2) == [2]
    assert with_one_bos([5], None) == [5]


# ----- incremental detokenization -------------------------------------------------------------------------------------
def reference(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, blocks) -> tuple[list[str], str]:
    """Push `blocks` one by one; check the invariants after each; return (deltas, finish delta)."""
    detok, ids, deltas = Detokenizer(tok), [], []
    for block in blocks:
        ids += block
        deltas.append(detok.push(block))
        assert detok.text == "".join(deltas)
        assert reference(tok, ids).startswith(detok.text)  # never ahead of (or different from) the full decode
        assert not detok.text.endswith(REPLACEMENT)  # an incomplete character is held back
    last = detok.finish()
    assert detok.text == "".join(deltas) + last == reference(tok, ids)
    return deltas, last


def split_at(ids, *cuts):
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def test_block_boundary_inside_a_multibyte_character(bpe):
    ids = bpe("sort é 1", add_special_tokens=False)["input_ids"]
    e_tokens = bpe("é", add_special_tokens=False)["input_ids"]
    assert len(e_tokens) == 2  # the byte-level BPE splits "é" into its two bytes
    cut = ids.index(e_tokens[0]) + 1  # between the two bytes
    deltas, last = stream(bpe, split_at(ids, cut))
    assert deltas[0] == reference(bpe, ids[:cut - 1])  # the lone lead byte is held back, no U+FFFD
    assert REPLACEMENT not in "".join(deltas) and last == ""


@pytest.mark.parametrize("text", ["€ 😀 x", "mathematics unbelievable"])
def test_every_single_cut(bpe, text):
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        stream(bpe, split_at(ids, cut))
    stream(bpe, [[t] for t in ids])  # one token per block


def test_block_boundary_inside_a_multi_token_word(bpe):
    ids = bpe("mathematics", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2  # a word outside the training corpus: several tokens
    deltas, _ = stream(bpe, split_at(ids, 2))
    assert deltas[0] == reference(bpe, ids[:2]) and deltas[0] + deltas[1] == "mathematics"


def test_special_tokens_are_skipped_next_to_a_boundary(bpe):
    text_ids = bpe("aé b", add_special_tokens=False)["input_ids"]
    eos, pad = bpe.eos_token_id, bpe.pad_token_id
    e0 = text_ids.index(bpe("é", add_special_tokens=False)["input_ids"][0])
    ids = [BOS] + text_ids[:e0 + 1] + [pad] + text_ids[e0 + 1:] + [eos]
    deltas, _ = stream(bpe, split_at(ids, 1, e0 + 2, e0 + 3, len(ids) - 1))
    assert "".join(deltas) == "aé b" and deltas[0] == "" and deltas[-1] == ""


def test_output_ending_on_an_incomplete_sequence(bpe):
    ids = bpe("ok 😀", add_special_tokens=False)["input_ids"][:-1]  # the emoji's last byte never comes
    deltas, last = stream(bpe, split_at(ids, 2))
    assert "".join(deltas) == reference(bpe, ids).rstrip(REPLACEMENT) == "ok "
    assert last == reference(bpe, ids)[len("ok "):] and last.startswith(REPLACEMENT)


def test_push_after_finish_is_an_error(bpe):
    d = Detokenizer(bpe)
    d.finish()
    with pytest.raises(ValueError):
        d.push([5])


@given(ids=st.lists(st.integers(0, 299), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6))
def test_any_ids_any_cuts(bpe, ids, cuts):
    ids = [t for t in ids if t < len(bpe)]
    stream(bpe, split_at(ids, *sorted(c for c in cuts if c <= len(ids))))


@pytest.fixture(scope="module")
def char_level(tiny_dir):
    return load_tokenizer(tiny_dir)


@given(text=st.text(alphabet="abc 12=<>", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_character_level_tokenizer(char_level, text, cuts):
    tok = char_level
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    stream(tok, split_at(ids, *sorted(c for c in cuts if c <= len(ids))))


# ----- stop strings --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [(), (3,), (5,), (6,), (7,), (2, 6)])
def test_stop_string_never_shown_even_across_blocks(bpe, cuts):
    """'déjà vu, stop here' split into blocks at every kind of place: the shown text is everything before the first
    'stop' (or 'vu,' - the earliest of several wins), whatever the blocks."""
    text = "déjà vu, stop here"
    ids = bpe.encode(text, add_special_tokens=False)
    for stops, want in ((["stop"], "déjà vu, "), (["here", "vu,"], "déjà "), (["absent"], text)):
        m = StopStrings(bpe, stops)
        shown = "".join(m.push(part) for part in split_at(ids, *[min(c, len(ids)) for c in cuts])) + m.finish()
        assert shown == want == m.text and m.stopped == (want != text)
        assert not any(s in shown for s in stops)


def test_stop_string_prefix_is_held_until_the_next_block_decides(bpe):
    m = StopStrings(bpe, ["stop"])
    ids = bpe.encode("go st", add_special_tokens=False)
    assert m.push(ids) == "go " and not m.stopped  # "st" could begin "stop"
    assert m.push(bpe.encode("ill", add_special_tokens=False)) == "still" and not m.stopped
    assert m.finish() == "" and m.text == "go still"


@pytest.mark.parametrize("bad", ["", [""], [3], 3])
def test_bad_stop_strings_name_the_field(bpe, bad):
    with pytest.raises(ConfigError, match="stop"):
        StopStrings(bpe, bad)


@pytest.mark.slow  # fast-tier budget; the stop-string unit tests stay fast
def test_stop_strings_end_the_request_on_the_demo():
    """Through the generator's stop hook: a stop string in the first block ends the request after it (no second
    block is denoised); one spanning the two blocks of a long reversal is cut out across the boundary."""
    import dgemma_compile as dg
    from dgemma_compile.demo import DEMO_MODEL, tasks

    model, tok = dg.load(DEMO_MODEL), dg.load_tokenizer(DEMO_MODEL)
    C = model.config.canvas_length
    prompt = next(p for t, p, a in tasks.make_split("heldout", 60, seed=0) if t == "rev" and len(a) > C + 2)
    ids = tok(prompt)["input_ids"]
    free = dg.generate(model, [ids], seed=0)
    answer = tok.decode(free.sequences[0], skip_special_tokens=True)
    assert tasks.check(prompt, answer) and free.stats[0].blocks == 2
    for stop in (answer[2:5], answer[C - 2:C + 1]):
        m = StopStrings(tok, [stop])
        out = dg.generate(model, [ids], seed=0, on_block=lambda _, new: m.push(new[0]),
                          stop=lambda *_: [0] if m.stopped else [])
        m.finish()
        assert m.text == answer[:answer.index(stop)] and out.stats[0].finish_reason == "stop"
        assert out.stats[0].blocks == (1 if answer.index(stop) + len(stop) <= C else 2)


def test_encodability_is_checked_by_encoding_the_text():
    """A word-level tokenizer knows words, not their characters: a text of known words encodes (refused before, when
    each character was checked alone); an unknown word is named."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<bos>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", bos_token="<bos>")
    assert encode_prompt(tok, "hello world hello", bos_token_id=1) == [1, 2, 3, 2]
    assert encode_prompt(tok, "hello [UNK]", bos_token_id=1) == [1, 2, 0]  # the unknown token written literally
    with pytest.raises(ConfigError, match=r"^prompt: text the model's tokenizer cannot encode: 'moon', 'sun'$"):
        encode_prompt(tok, "hello moon world sun moon", bos_token_id=1)
    with pytest.raises(ConfigError, match=r"^system: text the model's tokenizer cannot encode: 'hi'$"):
        encode_chat(tok, user_messages("hello", system="hi"), bos_token_id=1)
