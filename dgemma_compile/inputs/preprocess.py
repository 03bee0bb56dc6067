"""Image files -> `images.Image`, through transformers' own Gemma4 image processor (the PIL one: no torchvision).

`Gemma4ImageProcessorPil` resizes an image, keeping its aspect ratio, to sides that are multiples of
patch_size x pooling_kernel_size pixels holding at most max_soft_tokens x pooling^2 patches, rescales (by default to
[0, 1], no normalisation; a checkpoint's saved `resample`, `rescale_factor`, `do_normalize`, `image_mean` /
`image_std` are honoured, as transformers' `AutoImageProcessor` reads them), and cuts it into patches (`pixel_values` [max_patches, 3 * patch^2], `image_position_ids`
[max_patches, 2], (-1, -1) for padding; `num_soft_tokens_per_image`: the soft tokens the prompt must hold for it).
The processor's settings come from the checkpoint's `processor_config.json` (its `image_processor` entry) or
`preprocessor_config.json` when present, else from the vision config (patch and pooling sizes) and transformers'
default budget of 280 soft tokens. Needs pillow (`pip install pillow`). `open_image_url` reads an OpenAI
`image_url` (data:, file: inside an allowed directory, http(s) when allowed through `fetch.fetch`'s address and
domain checks, with a size limit and a timeout); every image's pixel count is bounded before it is decoded.

Every failure raises `ConfigError` naming the file or the parameter; nothing is half-read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..model.config import ConfigError
from .images import Image

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
"""The soft-token budgets the processor takes per image (`max_soft_tokens`)."""

DEFAULT_MAX_PIXELS = 32 * 2**20
"""The most pixels (width x height) an image may have before it is decoded: 33.5 M, ~100 MB as RGB (a 48 MP phone
photo is refused; `dgemma serve --max-image-pixels`)."""


def _pil():
    try:
        from PIL import Image as PILImage
        from PIL import UnidentifiedImageError
    except ImportError:
        raise ConfigError("image", "reading images needs pillow (pip install pillow)") from None
    return PILImage, UnidentifiedImageError


def read_image(path: str | Path, *, max_bytes: int = 32 * 2**20, max_pixels: int = DEFAULT_MAX_PIXELS):
    """The image at `path` as an RGB PIL image, fully decoded. Raises `ConfigError` naming the file: missing, larger
    than `max_bytes`, more than `max_pixels` pixels (width x height, read from the header before decoding), not an
    image, or truncated."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("image", f"{p}: file not found")
    size = p.stat().st_size
    if size > max_bytes:
        raise ConfigError("image", f"{p}: {size} bytes, more than the {max_bytes} allowed")
    return _decode(p, f"image: {p}", max_pixels)


def decode_data_url(url: str, name: str, *, max_bytes: int = 32 * 2**20, max_pixels: int = DEFAULT_MAX_PIXELS):
    """The image of a `data:image/...;base64,...` URL as an RGB PIL image, fully decoded. Raises `ConfigError` naming
    `name` (e.g. the request part): another scheme, not base64, more than `max_bytes` decoded, more than `max_pixels`
    pixels (checked before decoding), not an image, or truncated."""
    import base64
    import binascii

    head, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else url[:16]
        raise ConfigError(name, f"only data:image/...;base64 URLs are accepted, got a {scheme!r} URL")
    if len(data) > (max_bytes * 4) // 3 + 4:
        raise ConfigError(name, f"the image is more than the {max_bytes} bytes allowed")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(name, "the data URL is not valid base64") from None
    if len(raw) > max_bytes:
        raise ConfigError(name, f"the image is more than the {max_bytes} bytes allowed")
    return _decode_bytes(raw, name, max_pixels)


@dataclass(frozen=True)
class ImageSources:
    """Where an image URL may point, and the limits (the server's `--image-dir`, `--allow-image-urls`,
    `--allow-private-image-urls`, `--allowed-media-domains`, `--max-image-bytes`, `--max-image-pixels`): `data:`
    URLs always; `file:` URLs (or absolute paths) only inside `directory`; `http(s)` URLs only with `fetch`, through
    `fetch.fetch` (public addresses only unless `allow_private`; only hosts in `allowed_domains` when given, on every
    redirect hop too), read with a `timeout_s` per connection and read and at most `max_bytes`; every image at most
    `max_pixels` pixels, checked from its header before it is decoded."""

    directory: Path | None = None
    fetch: bool = False
    max_bytes: int = 8 * 2**20
    timeout_s: float = 10.0
    allow_private: bool = False
    allowed_domains: frozenset[str] | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS

    def policy(self):
        """The `fetch.FetchPolicy` of http(s) URLs."""
        from .fetch import FetchPolicy

        return FetchPolicy(allow_private=self.allow_private, allowed_domains=self.allowed_domains,
                           timeout_s=self.timeout_s, max_bytes=self.max_bytes)


def open_image_url(url: str, name: str, sources: ImageSources = ImageSources()):
    """The image an OpenAI `image_url` names, as an RGB PIL image, under `sources`' rules. Raises `ConfigError`
    naming `name`: a scheme not allowed, a file outside the allowed directory, a fetch that is refused (a host not
    allowed, a non-public address), fails, times out or passes `max_bytes` (`fetch.fetch`: its messages never say
    why a connection failed), an image over `max_pixels`, and everything `decode_data_url` / `read_image` refuse."""
    import urllib.parse

    from .fetch import FetchError, fetch

    scheme = urllib.parse.urlsplit(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme == "data":
        return decode_data_url(url, name, max_bytes=sources.max_bytes, max_pixels=sources.max_pixels)
    if scheme == "file" or (scheme == "" and url.startswith("/")):
        if sources.directory is None:
            raise ConfigError(name, "local files are not served (the server was started without --image-dir)")
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme else url).resolve()
        root = Path(sources.directory).resolve()
        if not path.is_relative_to(root):
            raise ConfigError(name, f"{path} is outside the allowed image directory")
        try:
            return read_image(path, max_bytes=sources.max_bytes, max_pixels=sources.max_pixels)
        except ConfigError as e:
            raise ConfigError(name, e.problem if e.param == "image" else str(e)) from None
    if scheme in ("http", "https"):
        if not sources.fetch:
            raise ConfigError(name, "http(s) image URLs are not fetched (the server was started without "
                              f"--allow-image-urls)")
        try:
            raw = fetch(url, sources.policy())
        except FetchError as e:
            raise ConfigError(name, str(e)) from None
        if len(raw) > sources.max_bytes:
            raise ConfigError(name, f"the image is more than the {sources.max_bytes} bytes allowed")
        return _decode_bytes(raw, name, sources.max_pixels)
    raise ConfigError(name, f"unsupported image URL scheme {scheme or url[:16]!r} (data:, file: or http(s))")


def _decode(source, name: str, max_pixels: int):
    """A file or file-like object -> an RGB PIL image, its size checked against `max_pixels` from the header before
    any pixel is decoded. Raises ConfigError naming `name`."""
    PILImage, Unidentified = _pil()
    try:
        with PILImage.open(source) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise ConfigError(name, f"the image is {w}x{h} = {w * h} pixels, more than the {max_pixels} allowed "
                                  f"(dgemma serve --max-image-pixels)")
            im.load()  # decode now: a truncated file fails here, not later
            return im.convert("RGB")
    except Unidentified:
        raise ConfigError(name, "not an image pillow can read") from None
    except PILImage.DecompressionBombError:  # pillow's own bound (2 x Image.MAX_IMAGE_PIXELS), checked at open
        raise ConfigError(name, f"the image has more pixels than the {max_pixels} allowed "
                          f"(dgemma serve --max-image-pixels)") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ConfigError(name, f"could not decode the image ({e})") from None


def _decode_bytes(raw: bytes, name: str, max_pixels: int = DEFAULT_MAX_PIXELS):
    import io

    return _decode(io.BytesIO(raw), name, max_pixels)


PROCESSOR_SETTINGS = ("max_soft_tokens", "patch_size", "pooling_kernel_size", "resample", "do_resize", "do_rescale",
                      "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb")
"""The saved processor settings honoured (as transformers' `AutoImageProcessor` reads them); others are ignored."""


def image_processor(model, directory: str | Path | None = None, *, max_soft_tokens: int | None = None):
    """transformers' `Gemma4ImageProcessorPil` for `model`'s vision encoder (see the module docstring), with the
    checkpoint's saved settings (`PROCESSOR_SETTINGS`: resample, rescale, normalisation mean / std, patch and pooling
    sizes, the soft-token budget); `directory` (default `model.checkpoint.directory`) may hold them; `max_soft_tokens`
    overrides their budget. Raises `ConfigError`: a model without a vision encoder, a budget not in
    `SOFT_TOKEN_BUDGETS`, unreadable settings, patch or pooling sizes other than the vision tower's."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    if model.vision is None:
        raise ConfigError("image", "this model has no vision encoder (a text-only checkpoint, one whose image token id "
                          "is outside its vocabulary, or loaded with vision=False)")
    tower = model.vision.hf_config
    settings = {"patch_size": tower.patch_size, "pooling_kernel_size": tower.pooling_kernel_size}
    directory = directory if directory is not None else model.checkpoint.directory
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(directory) / name if directory is not None else None
        if path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(path, f"not valid JSON ({e})") from None
            saved = saved.get("image_processor", saved) if isinstance(saved, dict) else {}
            settings.update({k: saved[k] for k in PROCESSOR_SETTINGS if k in saved})
            for k in ("patch_size", "pooling_kernel_size"):  # the tower reads patches of its own size only
                if settings[k] != getattr(tower, k):
                    raise ConfigError(path, f"{k} {settings[k]!r} differs from the vision tower's "
                                      f"{getattr(tower, k)!r} (config.json vision_config)")
            break
    if max_soft_tokens is not None:
        settings["max_soft_tokens"] = max_soft_tokens
    budget = settings.get("max_soft_tokens", 280)
    if budget not in SOFT_TOKEN_BUDGETS:
        raise ConfigError("max_soft_tokens", f"must be one of {SOFT_TOKEN_BUDGETS}, got {budget!r}")
    return Gemma4ImageProcessorPil(**settings)


def preprocess(model, pil_images: Sequence, *, directory: str | Path | None = None,
               max_soft_tokens: int | None = None) -> list[Image]:
    """PIL images -> `images.Image`s for `model` (one processor call per image, so an image's patches never depend
    on its batch mates); `len(image.pixel_values)` is the processor's max_patches, the soft tokens
    (`num_soft_tokens(image)`) what its placeholder run must hold. Raises `ConfigError` as `image_processor`."""
    proc = image_processor(model, directory, max_soft_tokens=max_soft_tokens)
    out = []
    for im in pil_images:
        enc = proc(images=[im], return_tensors="pt")
        out.append(Image(enc["pixel_values"][0], enc["image_position_ids"][0]))
    return out


def num_soft_tokens(model, image: Image) -> int:
    """The soft tokens `model.vision` makes of `image`: its real patches / pooling^2 (what the processor's
    `num_soft_tokens_per_image` says)."""
    real = int((image.position_ids != -1).any(-1).sum())
    return real // model.vision.pooling
