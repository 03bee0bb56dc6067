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
slots as wide as the widest forward; the eager oracle (`oracle.py`) and the compiled generator both call it, so their
tokens agree.

Legend: L the image prefix's tokens, N soft tokens of one image, D hidden, S committed slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..model import forwards
from ..model.config import CONTEXT_LENGTH, ConfigError
from ..model.kv_cache import KVCache, PagedKVCache
from ..model.modes import ENCODER
from ..model.plan import build_plan, every_row

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
    """A validated prompt with images: its runs (start, length), its images, their content digests and its length.

    `prefix` = E, where the image prefix's own forwards end: the last run's end rounded up to a multiple of the
    encoder chunk (the canvas), or the prompt's last token when that is nearer; the step prefills [E, len) in chunks
    from there, so every forward boundary after the first image is where a text prompt's would be (a page-aligned
    prefix cache can map them, `dgemma_runtime.kv.image_pages`). `features(k)`: image k's soft tokens ([N_k, D], model
    dtype), computed by the vision encoder on first use only (`encodes` counts those runs), so an image whose
    prefix pages come from a cache never runs the tower."""

    runs: list[tuple[int, int]]
    images: list[Image]
    digests: list[bytes]
    length: int
    chunk: int
    vision: object = None
    encodes: int = 0
    _features: dict = field(default_factory=dict, repr=False)

    @property
    def last(self) -> int:
        """L: the end of the last run."""
        start, n = self.runs[-1]
        return start + n

    @property
    def prefix(self) -> int:
        """E: where the image prefix's forwards end (see the class docstring); L <= E < len(prompt)."""
        return min(-(-self.last // self.chunk) * self.chunk, self.length - 1)

    def feature(self, k: int) -> torch.Tensor:
        """Image k's soft tokens [N_k, D] (the vision encoder runs once per image, on first use)."""
        if k not in self._features:
            self._features[k] = self.vision.features(self.images[k].pixel_values, self.images[k].position_ids)
            self.encodes += 1
        return self._features[k]

    @property
    def features(self) -> list[torch.Tensor]:
        """Every image's soft tokens (`feature`)."""
        return [self.feature(k) for k in range(len(self.images))]


def digest(image: Image) -> bytes:
    """sha256 of an image's preprocessed content (pixel_values and position_ids, with their shapes and dtypes): the
    key a prefix cache mixes into its page hash chain, so two images share pages only when their patches are equal."""
    h = hashlib.sha256()
    for t in (image.pixel_values, image.position_ids):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def prepare(model, prompts: Sequence[Sequence[int]], images: Sequence[Sequence[Image] | None] | None
            ) -> list[ImagePrompt | None]:
    """Check each prompt against its images: one `ImagePrompt` per prompt with images, None for the others (all
    None without `images`). The vision encoder does not run here (`ImagePrompt.feature` runs it on first use); each
    image's shapes and soft tokens are checked now.

    Raises:
        ConfigError: naming `images` or `prompts[i]` / `images[i][k]`: images given to a model without a vision
            encoder, a list of the wrong length, placeholder runs and images that differ in number, a run whose length
            is not its image's soft tokens, a group above `MAX_GROUP`, a prompt that ends with an image (at least one
            token must follow the last image; the processor's eoi does), bad pixel_values / position_ids. Nothing
            runs before every prompt is checked.
    """
    R = len(prompts)
    vision = model.vision
    image_id = vision.config.image_token_id if vision is not None else None
    if images is None:
        if image_id is not None:
            for i, p in enumerate(prompts):
                if image_runs(p, image_id):
                    raise ConfigError(f"prompts[{i}]", f"holds image placeholders (id {image_id}) but no images were "
                                      f"given")
        return [None] * R
    if not isinstance(images, (list, tuple)) or len(images) != R:
        raise ConfigError("images", f"give one list of images (or None) per prompt ({R}), got "
                          f"{len(images) if isinstance(images, (list, tuple)) else type(images).__name__}")
    if vision is None and any(imgs for imgs in images):
        raise ConfigError("images", "this model has no vision encoder (a text-only checkpoint, one whose image token id "
                          "is outside its vocabulary, or loaded with vision=False)")
    out: list[ImagePrompt | None] = []
    for i, (p, imgs) in enumerate(zip(prompts, images)):
        imgs = list(imgs or [])
        runs = image_runs(p, image_id) if image_id is not None else []
        if len(runs) != len(imgs):
            raise ConfigError(f"prompts[{i}]", f"{len(runs)} image placeholder runs (id {image_id}) but {len(imgs)} "
                              f"images given")
        if not runs:
            out.append(None)
            continue
        for k, img in enumerate(imgs):
            if not isinstance(img, Image):
                raise ConfigError(f"images[{i}][{k}]", "must be a dgemma_compile.inputs.images.Image, got "
                                  f"{type(img).__name__}")
        start, n = runs[-1]
        if start + n >= len(p):
            raise ConfigError(f"prompts[{i}]", "ends with an image; at least one token must follow the last image "
                              f"(the processor writes eoi after each)")
        widest = max(n for _, n in runs)
        if widest > MAX_GROUP:
            raise ConfigError(f"prompts[{i}]", f"an image of {widest} soft tokens, more than the {MAX_GROUP} served")
        for k, ((_, n), img) in enumerate(zip(runs, imgs)):
            try:
                soft = vision.soft_tokens(img.pixel_values, img.position_ids)
            except ConfigError as e:
                raise ConfigError(f"images[{i}][{k}]", str(e)) from None
            if soft != n:
                raise ConfigError(f"images[{i}][{k}]", f"{soft} soft tokens, but its placeholder run in "
                                  f"prompts[{i}] holds {n}")
        out.append(ImagePrompt(runs=runs, images=imgs, digests=[digest(im) for im in imgs], length=len(p),
                               chunk=model.config.canvas_length, vision=vision))
    return out


def pieces(end: int, runs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int, int | None]]:
    """The image prefix's forwards up to `end` (`ImagePrompt.prefix`), as (start, end, run index or None for
    text): each run alone and whole; text cut at every multiple of `chunk` (the positions a text prompt's prefill
    chunks start at) and at the runs, so a forward boundary depends only on the tokens before it."""
    out: list[tuple[int, int, int | None]] = []
    at = 0
    for k, (start, n) in enumerate([*runs, (end, 0)]):
        while at < start:
            stop = min((at // chunk + 1) * chunk, start)
            out.append((at, stop, None))
            at = stop
        if n:
            out.append((start, start + n, k))
            at = start + n
    assert at == end, (at, end)
    return out


def _check_chunk(item: ImagePrompt, chunk: int) -> None:
    if chunk != item.chunk:
        raise ValueError(f"chunk: {chunk}, but the image prefix was prepared for chunks of {item.chunk} (the canvas)")


@torch.no_grad()
def encode_prefix(model, cache: KVCache, prompt: torch.Tensor, item: ImagePrompt, *, chunk: int,
                  moe_impl: str | None = None, start: int = 0) -> torch.Tensor:
    """Encode the image prefix of `prompt` (int64 [len]) from `start` (0, or the end of one of its `pieces`) into
    the one-row `cache`, which holds the prefix's first `start` tokens; returns the final-norm hidden states
    [E - start, D]. Each group is one forward of its width, with the image-group overlay when the checkpoint asks
    for it (`vision.VisionConfig.bidirectional_groups`); only the images from `start` on run the vision encoder.

    Raises:
        ValueError: a cache of more than one row, block slots narrower than the widest forward, a `start` that is
            not a piece boundary, a `chunk` other than the one the prompt was prepared for.
    """
    _check_chunk(item, chunk)
    widest = max(chunk, max(n for _, n in item.runs))
    if cache.batch_size != 1 or cache.block_size < widest:
        raise ValueError(f"cache: encode_prefix needs one row with block_size >= {widest}, got "
                         f"{cache.batch_size} rows, block_size {cache.block_size}")
    todo = [pc for pc in pieces(item.prefix, item.runs, chunk) if pc[0] >= start]
    if start and (not todo or todo[0][0] != start) and start != item.prefix:
        raise ValueError(f"start: {start} is not where one of the image prefix's forwards begins")
    bidirectional = model.vision.config.bidirectional_groups
    dev = cache.lengths.device
    outs = []
    for s, e, k in todo:
        T = e - s
        ids = prompt[s:e].to(dev)[None]
        n_new = torch.tensor([T], device=dev)
        groups = torch.zeros(1, T, dtype=torch.long, device=dev) if k is not None and bidirectional else None
        plan = build_plan(model, cache, T, mode=every_row(cache, ENCODER), n_new=n_new, groups=groups,
                          check_values=False)
        embeds = item.feature(k).to(dev)[None] if k is not None else None
        outs.append(model.forward_plan(ids, cache, plan, moe_impl=moe_impl, input_embeds=embeds)[0])
    return torch.cat(outs) if outs else torch.zeros(0, model.config.hidden_size, dtype=model.dtype, device=dev)


@torch.no_grad()
def prefill_images(model, cache, row: int, prompt: Sequence[int], item: ImagePrompt, *, chunk: int,
                   moe_impl: str | None = None, start: int = 0) -> torch.Tensor:
    """Encode `prompt`'s image prefix (`encode_prefix`) into row `row` of `cache` from `start`: through a scratch
    cache of one row and the same committed slots (holding the row's first `start` slots), then copied into the
    row's committed slots [start, E); sets `cache.lengths[row]` = E. Returns the hidden states [E - start, D].

    `cache`: a static `KVCache` (the row empty, `start` 0), or a `PagedKVCache` whose row holds `start` tokens in
    pages mapped for at least E slots (a prefix-cache hit: `start` the end of a piece, `pieces`).

    Raises:
        ConfigError: a static row that is not empty or a `start` other than 0, a paged row whose length is not
            `start`, an image prefix longer than the cache's committed slots.
        ValueError: as `encode_prefix` (`start` not a piece boundary).
    """
    L = item.prefix
    paged = isinstance(cache, PagedKVCache)
    held = int(cache.lengths[row])
    if not paged and (held != 0 or start != 0):
        raise ConfigError("cache", f"row {row} holds {held} tokens; images are encoded into an empty row")
    if paged and held != start:
        raise ConfigError("cache", f"row {row} holds {held} tokens, but the image prefix is to start at {start}")
    if L > cache.max_seq_len:
        raise ConfigError("max_seq_len", f"the image prefix is {L} tokens, more than the cache's {cache.max_seq_len}",
                          code=CONTEXT_LENGTH)
    widest = max(chunk, max(n for _, n in item.runs))
    scratch = model.new_cache(1, cache.max_seq_len, block_size=widest)
    if start:
        for layer, (dk, dv) in enumerate(zip(scratch.keys, scratch.values)):
            k, v = cache.read_slots(row, layer, start)
            dk[0, :, :start], dv[0, :, :start] = k, v
        scratch.lengths[0] = start
    hidden = encode_prefix(model, scratch, torch.as_tensor(list(prompt), dtype=torch.long), item, chunk=chunk,
                           moe_impl=moe_impl, start=start)
    for layer, (sk, sv) in enumerate(zip(scratch.keys, scratch.values)):
        if paged:
            cache.write_slots(row, layer, start, sk[0, :, start:L], sv[0, :, start:L])
        else:
            cache.keys[layer][row, :, start:L] = sk[0, :, start:L]
            cache.values[layer][row, :, start:L] = sv[0, :, start:L]
    cache.lengths[row] = L
    return hidden


@torch.no_grad()
def encode_prompts(model, cache: KVCache, prompts: Sequence[Sequence[int]], items: Sequence[ImagePrompt | None], *,
                   chunk: int | None = None, moe_impl: str | None = None) -> list[torch.Tensor]:
    """Encode a batch of prompts, with or without images, into an empty `cache` (one row each): image prefixes by
    `prefill_images`, then every row's remaining text by `forwards.encode` (chunks of the cache's block size).
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
    hidden = forwards.encode(model, ids, cache, torch.tensor([len(x) for x in rest], device=dev), moe_impl=moe_impl)
    return [hidden[r, :len(x)] if heads[r] is None else torch.cat([heads[r], hidden[r, :len(x)]])
            for r, x in enumerate(rest)]
