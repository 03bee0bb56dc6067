#!/usr/bin/env python
"""Build the character-level tokenizer of the demo DiffusionGemma model.

Vocabulary: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3 (same special ids as the real
model's pad/eos/bos), then one token per character of ``dgemma_compile.demo.tasks.ALPHABET``.
A post-processor prepends ``<bos>`` (``tokenizer(prompt)`` -> ``[bos] + chars``) and the chat
template concatenates the user contents after ``<bos>`` (``apply_chat_template`` gives the same
ids as ``tokenizer(prompt)``; there is no role marker or generation prompt).

Usage: ``python tools/build_demo_tokenizer.py OUT_DIR`` writes tokenizer.json,
tokenizer_config.json (and whatever else ``PreTrainedTokenizerFast.save_pretrained`` writes).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
)


def build_tokenizer():
    """Return a ``PreTrainedTokenizerFast`` over the demo alphabet."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from dgemma_compile.demo.tasks import ALPHABET

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in ALPHABET:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    # BPE without merges = pure character tokenization, spaces included (no pre-tokenizer).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A $B",
        special_tokens=[("<bos>", BOS_ID)],
    )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.pad_token_id == PAD_ID and fast.eos_token_id == EOS_ID and fast.bos_token_id == BOS_ID
    return fast


def save_tokenizer(out_dir: str):
    fast = build_tokenizer()
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    fast = save_tokenizer(args.out_dir)
    print(f"wrote tokenizer with {len(fast)} tokens to {args.out_dir}")


if __name__ == "__main__":
    main()
