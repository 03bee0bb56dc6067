"""Prompts with images: placeholder runs, their soft tokens, and the image prefix's own encoder forwards.

A prompt holds each image as a contiguous run of `image_token_id` placeholders (the processor writes boi, N image
tokens, eoi); the image's soft tokens (`vision.VisionEncoder.features`, N x D) replace the placeholders' embeddings
(transformers' `masked_scatter`; the embedding scale is not applied to them), and, when the checkpoint sets
`use_bidirectional_attention = "vision"`, each run is one image group that attends bidirectionally within itself in
the encoder (`masks.py`).

A group split over two causal forwards would lose that (a token's state at layer l reads its group-mates' states at
layer l - 1), so every group is encoded whole in one forward. Groups are 70-1120 soft tokens and the step's prefill
rows are a canvas wide (256 released, 16 on the demo): rather than widening every row of every step to the largest
group (x4.4 the released step's tokens, x70 the demo's, for denoise steps too), the prompt's *image prefix* -- its
tokens up to the end of its last image -- runs in forwards of its own (`encode_prefix`): text in chunks of at most
`chunk` tokens, each group alone in one forward of its width. They run once per request, before the row is admitted;
the text after the last image goes through the step's prefill rows as any prompt does, so the step never sees an
image and text-only requests run exactly the graphs they ran before. Largest group served: `MAX_GROUP` soft tokens.

`prefill_images` writes a row of any cache through a one-row scratch cache with as many committed slots as the
target (the attention reduces over the same slots, so the keys are those a direct encode would write) and block
slots as wide as the widest forward; the eager oracle (`generate.py`) and the compiled generator both call it, so their
tokens agree.

Legend: L the image prefix's tokens, N soft tokens of one image, D hidden, S committed slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ConfigError
from .kv_cache import KVCache
from .plan import build_plan

MAX_GROUP = 1120
"""The largest image group served (soft tokens of one image): the processor's largest budget (70/140/280/560/1120)."""


@dataclass(frozen=True)
class Image:
    """One preprocessed image: pixel_values float [P, 3 * patch^2] (rescaled patches), position_ids int64 [P, 2] ((x,
    y) per patch, (-1, -1) for padding), as transformers' Gemma4 image processor gives them per image."""

    pixel_values: torch.Tensor
    position_ids: torch.Tensor


def image_runs(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """The contiguous runs of `image_token_id` in `prompt`, as (start, length), in order (one per image)."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(prompt):
        if t == image_token_id:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


@dataclass
class ImagePrompt:
    """A validated prompt with images: its runs and each image's soft tokens ([N_k, D], model dtype, N_k = run k's
    length); `prefix` = L, the tokens up to the end of the last run (< len(prompt))."""

    runs: list[tuple[int, int]]
    features: list[torch.Tensor]

    @property
    def prefix(self) -> int:
        start, n = self.runs[-1]
        return start + n


def prepare(model, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Image] | None] | None
            ) -> list[ImagePrompt | None]:
    """Check each prompt against its images and run the vision encoder once per image: one `ImagePrompt` per prompt
    with images, None for the others (all None without `images`).

    Raises:
        ConfigError: naming `images` or `prompts[i]` / `images[i][k]`: images given to a model without a vision
            encoder, a list of the wrong length, placeholder runs and images that differ in number, a run whose length
            is not its image's soft tokens, a group above `MAX_GROUP`, a prompt that ends with an image (at least one
            token must follow the last image; the processor's eoi does), bad pixel_values / position_ids. Nothing
            runs before every prompt is checked.
    """
    R = len(prompts)
    vision = getattr(model, "vision", None)
    image_id = vision.config.image_token_id if vision is not None else None
    if images is None:
        if image_id is not None:
            for i, p in enumerate(prompts):
                if image_runs(p, image_id):
                    raise ConfigError(f"prompts[{i}]: holds image placeholders (id {image_id}) but no images were "
                                      f"given")
        return [None] * R
    if not isinstance(images, (list, tuple)) or len(images) != R:
        raise ConfigError(f"images: give one list of images (or None) per prompt ({R}), got "
                          f"{len(images) if isinstance(images, (list, tuple)) else type(images).__name__}")
    if vision is None and any(imgs for imgs in images):
        raise ConfigError("images: this model has no vision encoder (a text-only checkpoint, one whose image token id "
                          "is outside its vocabulary, or loaded with vision=False)")
    plans: list[tuple[list[tuple[int, int]], list[Image]] | None] = []
    for i, (p, imgs) in enumerate(zip(prompts, images)):
        imgs = list(imgs or [])
        runs = image_runs(p, image_id) if image_id is not None else []
        if len(runs) != len(imgs):
            raise ConfigError(f"prompts[{i}]: {len(runs)} image placeholder runs (id {image_id}) but {len(imgs)} "
                              f"images given")
        if not runs:
            plans.append(None)
            continue
        for k, img in enumerate(imgs):
            if not isinstance(img, Image):
                raise ConfigError(f"images[{i}][{k}]: must be a dgemma_compile.images.Image, got "
                                  f"{type(img).__name__}")
        start, n = runs[-1]
        if start + n >= len(p):
            raise ConfigError(f"prompts[{i}]: ends with an image; at least one token must follow the last image "
                              f"(the processor writes eoi after each)")
        widest = max(n for _, n in runs)
        if widest > MAX_GROUP:
            raise ConfigError(f"prompts[{i}]: an image of {widest} soft tokens, more than the {MAX_GROUP} served")
        plans.append((runs, imgs))
    out: list[ImagePrompt | None] = []
    for i, item in enumerate(plans):
        if item is None:
            out.append(None)
            continue
        runs, imgs = item
        feats = []
        for k, ((_, n), img) in enumerate(zip(runs, imgs)):
            try:
                f = vision.features(img.pixel_values, img.position_ids)
            except ConfigError as e:
                raise ConfigError(f"images[{i}][{k}]: {e}") from None
            if f.shape[0] != n:
                raise ConfigError(f"images[{i}][{k}]: {f.shape[0]} soft tokens, but its placeholder run in "
                                  f"prompts[{i}] holds {n}")
            feats.append(f.to(model.dtype))
        out.append(ImagePrompt(runs=runs, features=feats))
    return out


def pieces(prefix: int, runs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int, int | None]]:
    """The image prefix's forwards, as (start, end, run index or None for text): text in chunks of at most `chunk`
    tokens, each run alone and whole."""
    out: list[tuple[int, int, int | None]] = []
    at = 0
    for k, (start, n) in enumerate(runs):
        for s in range(at, start, chunk):
            out.append((s, min(s + chunk, start), None))
        out.append((start, start + n, k))
        at = start + n
    assert at == prefix
    return out


@torch.no_grad()
def encode_prefix(model, cache: KVCache, prompt: torch.Tensor, item: ImagePrompt, *, chunk: int,
                  moe_impl: str | None = None) -> torch.Tensor:
    """Encode the image prefix of `prompt` (int64 [len]) into the one-row `cache` after what it holds, in `pieces`;
    returns the final-norm hidden states [L, D]. Each group is one forward of its width, with the image-group
    overlay when the checkpoint asks for it (`vision.VisionConfig.bidirectional_groups`).

    Raises:
        ValueError: a cache of more than one row, or block slots narrower than the widest forward.
    """
    widest = max(chunk, max(n for _, n in item.runs))
    if cache.batch_size != 1 or cache.block_size < widest:
        raise ValueError(f"cache: encode_prefix needs one row with block_size >= {widest}, got "
                         f"{cache.batch_size} rows, block_size {cache.block_size}")
    bidirectional = model.vision.config.bidirectional_groups
    dev = cache.lengths.device
    outs = []
    for start, end, k in pieces(item.prefix, item.runs, chunk):
        T = end - start
        ids = prompt[start:end].to(dev)[None]
        n_new = torch.tensor([T], device=dev)
        groups = torch.zeros(1, T, dtype=torch.long, device=dev) if k is not None and bidirectional else None
        plan = build_plan(model, cache, T, mode="encoder", n_new=n_new, groups=groups)
        embeds = item.features[k].to(dev)[None] if k is not None else None
        outs.append(model.forward_plan(ids, cache, plan, moe_impl=moe_impl, input_embeds=embeds)[0])
    return torch.cat(outs)


@torch.no_grad()
def prefill_images(model, cache: KVCache, row: int, prompt: Sequence[int], item: ImagePrompt, *, chunk: int,
                   moe_impl: str | None = None) -> torch.Tensor:
    """Encode `prompt`'s image prefix (`encode_prefix`) into row `row` of `cache`, which must be empty there
    (`cache.lengths[row] == 0`): through a scratch cache of one row and the same committed slots, then copied into
    the row's committed slots; sets `cache.lengths[row]` = L. Returns the hidden states [L, D].

    Raises:
        ConfigError: a paged cache (`kv_cache.PagedKVCache`: not supported yet), a row that is not empty, or an image
            prefix longer than the cache's committed slots.
    """
    if not isinstance(cache, KVCache):
        raise ConfigError(f"cache: images need a static KVCache, got {type(cache).__name__} (paged caches do not "
                          f"take images yet)")
    L = item.prefix
    if int(cache.lengths[row]) != 0:
        raise ConfigError(f"cache: row {row} holds {int(cache.lengths[row])} tokens; images are encoded into an "
                          f"empty row")
    if L > cache.max_seq_len:
        raise ConfigError(f"max_seq_len: the image prefix is {L} tokens, more than the cache's {cache.max_seq_len}")
    widest = max(chunk, max(n for _, n in item.runs))
    scratch = model.new_cache(1, cache.max_seq_len, block_size=widest)
    hidden = encode_prefix(model, scratch, torch.as_tensor(list(prompt), dtype=torch.long), item, chunk=chunk,
                           moe_impl=moe_impl)
    for dst, src in ((cache.keys, scratch.keys), (cache.values, scratch.values)):
        for d, s in zip(dst, src):
            d[row, :, :L] = s[0, :, :L]
    cache.lengths[row] = L
    return hidden


@torch.no_grad()
def encode_prompts(model, cache: KVCache, prompts: Sequence[Sequence[int]], items: Sequence[ImagePrompt | None], *,
                   chunk: int | None = None, moe_impl: str | None = None) -> list[torch.Tensor]:
    """Encode a batch of prompts, with or without images, into an empty `cache` (one row each): image prefixes by
    `prefill_images`, then every row's remaining text by `DiffusionGemma.encode` (chunks of the cache's block size).
    Returns each prompt's final-norm hidden states [len, D] (what the parity tests compare with transformers'
    encoder). `chunk`: the image prefix's text chunks (default the canvas length, as the generators use)."""
    chunk = chunk or model.config.canvas_length
    R, dev = len(prompts), cache.lengths.device
    heads: list[torch.Tensor | None] = [None] * R
    for r, (p, item) in enumerate(zip(prompts, items)):
        if item is not None:
            heads[r] = prefill_images(model, cache, r, p, item, chunk=chunk, moe_impl=moe_impl)
    start = [0 if it is None else it.prefix for it in items]
    rest = [list(p)[s:] for p, s in zip(prompts, start)]
    T = max(len(x) for x in rest)
    ids = torch.zeros(R, T, dtype=torch.long, device=dev)
    for r, x in enumerate(rest):
        ids[r, :len(x)] = torch.tensor(x, dtype=torch.long)
    hidden = model.encode(ids, cache, torch.tensor([len(x) for x in rest], device=dev), moe_impl=moe_impl)
    return [hidden[r, :len(x)] if heads[r] is None else torch.cat([heads[r], hidden[r, :len(x)]])
            for r, x in enumerate(rest)]
