"""Tiny random DiffusionGemma checkpoints written by transformers itself, for parity and loader tests."""

from __future__ import annotations

import string
from pathlib import Path

import torch

VOCAB_CHARS = string.ascii_lowercase + string.digits + " .,=+-"


def hf_model(*, vocab_size=64, hidden_size=32, intermediate_size=48, layer_types=("sliding_attention", "full_attention"),
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
             sliding_window=4, num_experts=4, top_k_experts=2, moe_intermediate_size=16, canvas_length=8, seed=0,
             image_ids=None, **extra):
    """A float32 `DiffusionGemmaForBlockDiffusion` with random weights, non-trivial norm weights, router scales and
    layer scalars (the encoder's differ from the decoder's), and a tiny vision tower. `image_ids` (image, boi, eoi)
    puts the image token ids inside the vocabulary (transformers' defaults are outside a tiny one: such a checkpoint
    loads text-only); `use_bidirectional_attention="vision"` (in `extra`) turns on the image-group mask."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig

    torch.manual_seed(seed)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8)
    text = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                num_hidden_layers=len(layer_types), layer_types=list(layer_types), num_attention_heads=num_attention_heads,
                num_key_value_heads=num_key_value_heads, head_dim=head_dim, global_head_dim=global_head_dim,
                num_global_key_value_heads=num_global_key_value_heads, sliding_window=sliding_window,
                num_experts=num_experts, top_k_experts=top_k_experts, moe_intermediate_size=moe_intermediate_size,
                **extra)
    ids = {} if image_ids is None else dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"), image_ids))
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length, **ids)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1 + 0.3 * torch.randn_like(b))
    return model


IMAGE_TOKENS = ("<|image|>", "<|boi|>", "<|eoi|>")


def write_tokenizer(directory: Path, images: bool = False) -> None:
    """A character-level tokenizer (pad 0, eos 1, bos 2, unk) with a chat template, saved as transformers does;
    `images`: also the image, boi and eoi tokens (`IMAGE_TOKENS`, ids `image_token_ids()`) and a template that renders
    each {"type": "image"} part as the image token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for ch in VOCAB_CHARS:
        vocab[ch] = len(vocab)
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if images:
        fast.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
        fast.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
                              "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|image|>{% else %}"
                              "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")
    fast.save_pretrained(str(directory))


def _byte_chars() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE vocabularies (GPT-2's convention): printable
    Latin-1 bytes stand for themselves, the others are shifted past 255 in order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shift = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in keep else chr(256 + shift)
        shift += b not in keep
    return out


GEMMA4_TOOL_MARKERS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>", "<tool|>", "<|tool_response>",
                       "<tool_response|>", "<|turn>", "<turn|>")
"""Gemma4's tool and turn markers, special tokens 259.. of `write_byte_tokenizer(tools=True)` (single tokens, as in
the release's tokenizer)."""


def write_byte_tokenizer(directory: Path, tools: bool = False) -> None:
    """A byte-level tokenizer (pad 0, eos 1, bos 2, then the 256 bytes, no merges: every text encodes, byte by
    byte), saved as transformers does; 259 ids. `tools`: plus Gemma4's markers (`GEMMA4_TOOL_MARKERS`, 268 ids) and
    the Gemma4-shaped chat template of tests/fixtures/gemma4_tools (tool declarations, calls, tool responses)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for b, ch in _byte_chars().items():
        vocab[ch] = 3 + b
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if tools:
        fast.add_special_tokens({"additional_special_tokens": list(GEMMA4_TOOL_MARKERS)})
        fast.chat_template = (Path(__file__).parent / "fixtures" / "gemma4_tools" / "chat_template.jinja").read_text()
    fast.save_pretrained(str(directory))


def image_token_ids() -> tuple[int, int, int]:
    """The (image, boi, eoi) ids of `write_tokenizer(images=True)`: right after its characters and unk."""
    first = 3 + len(VOCAB_CHARS) + 1
    return first, first + 1, first + 2


def write_checkpoint(directory: Path, model=None, *, generation: dict | None = None, tokenizer: bool = False,
                     image_tokenizer: bool = False, **kw) -> Path:
    """save_pretrained a tiny model (built with `hf_model(**kw)` unless given) and optionally a generation config
    and a tokenizer. Returns the directory."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    model = model if model is not None else hf_model(**kw)
    if generation is not None:
        model.generation_config = DiffusionGemmaGenerationConfig(**generation)
    model.save_pretrained(str(directory))
    if tokenizer or image_tokenizer:
        write_tokenizer(directory, images=image_tokenizer)
    return Path(directory)


def hf_cache(cache) -> dict:
    """transformers' keyword for a DiffusionGemma cache: `cache` (5.2x; `past_key_values` deprecated there) or
    `past_key_values` (before the rename: 5.17, the GPU image's)."""
    import inspect

    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaEncoderModel

    new = "cache" in inspect.signature(DiffusionGemmaEncoderModel.forward).parameters
    return {"cache" if new else "past_key_values": cache}


def softcap(ref, logits):
    """transformers' final soft-capping (as in DiffusionGemmaForBlockDiffusion.forward), read from its config."""
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(logits.float() / cap) * cap


def assert_sparsity_of_create_block_mask(mask_mod, B, q_len, kv_len, block_size):
    """`block_sparsity` gives create_block_mask's partial and full blocks, tensor for tensor (counts and order)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dgemma_compile.model.masks import block_sparsity

    ref = create_block_mask(mask_mod, B, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block_size)
    got = block_sparsity(mask_mod, B, q_len, kv_len, block_size, "cpu")
    zero = torch.zeros_like(ref.kv_num_blocks)
    want = (ref.kv_num_blocks, ref.kv_indices,
            zero if ref.full_kv_num_blocks is None else ref.full_kv_num_blocks,
            ref.kv_indices if ref.full_kv_indices is None else ref.full_kv_indices)
    for name, g, w in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), got, want):
        if name == "full_kv_indices" and ref.full_kv_indices is None:
            continue  # no full block anywhere: only the (zero) counts are compared
        assert g.dtype == torch.int32 and torch.equal(g, w.to(torch.int32)), name


def wait_for_health(proc, port: int, *, timeout_s: float) -> None:
    """Poll a `dgemma serve` subprocess's /health until it answers 200; fails if the process exits or `timeout_s`
    passes first."""
    import time

    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.time() < deadline, "dgemma serve did not come up"
        time.sleep(0.2)


def assert_same_parts(a, b, what: str) -> None:
    """Two weights hold the same parts bitwise: plain tensors, torchao tensors (codes, scales and an NVFP4 per-tensor
    scale) or `ExpertProjection`s (weight and scales); 1-byte parts compared as bytes (fp8 has NaN codes)."""
    from dgemma_compile.model.backbone import ExpertProjection
    from dgemma_compile.parallel.quantized import is_quantized

    def parts(t):
        if isinstance(t, ExpertProjection):
            return [t.quant, t.shape, t.weight] + t.scales()
        if is_quantized(t):
            return [type(t), t.shape, t.qdata, t.scale, getattr(t, "per_tensor_scale", None)]
        return [type(t), t.shape, t]

    for x, y in zip(parts(a), parts(b), strict=True):
        if isinstance(x, torch.Tensor):
            x, y = (t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (x, y))
            assert x.dtype == y.dtype and torch.equal(x, y), what
        else:
            assert x == y, what


class RowReq:
    """A `driver.RowRequest` for driving a bucket's rows in a test: a prompt's ids, its resolved config and seed,
    optionally a grammar (`constraint.RowGrammar`); no images, frames or canvas."""

    def __init__(self, prompt, config, seed, grammar=None):
        from dgemma_compile.step.requests import RequestStats

        self.prompt, self.config, self.seed, self.images, self.grammar = prompt, config, seed, None, grammar
        self.sequence, self.stats, self.frames, self.canvas = [], RequestStats(), False, None
