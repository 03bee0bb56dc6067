"""Images on the paged KV cache and its prefix cache (`runtime/kv/image_pages.py`): an image request's tokens over paged
memory equal the static-cache eager generator's; the same image in a second request maps the first one's pages and
runs no vision encoder, with the same tokens; a different image behind the same placeholder ids never hits its pages;
a hit that ends between two images encodes only the second. Free pages hold NaN after every iteration (a row that read
one would change its tokens)."""

from __future__ import annotations

import pytest
import torch
from helpers import write_checkpoint
from test_images import image, multimodal, placeholders

import dgemma_compile as dg
from dgemma_compile.inputs.images import Image, ImagePrompt, digest, prepare
from dgemma_compile.model.kv_cache import new_paged_cache
from dgemma_runtime import Request, build_engine
from dgemma_runtime.kv.image_pages import cut_hit, page_keys

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

SLOTS, P = 96, 8  # page size = the test model's canvas (the encoder chunk)
# one image of 9 soft tokens (boi at 3, placeholders 4..12, eoi 13), then text: 23 tokens, image prefix [0, 16)
ONE = [2, 9, 13] + placeholders(9) + [4, 7, 30, 11, 12, 14, 15, 16, 17]
# two images: the first as in ONE, the second (4 soft tokens) at 21..24; 29 tokens, image prefix [0, 28)
TWO = [2, 9, 13] + placeholders(9) + [4, 7, 30, 11, 12, 14] + placeholders(4) + [30, 11, 5]


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    model = dg.load(write_checkpoint(tmp_path_factory.mktemp("mm_paged"), multimodal(seed=3)), attention="dense")
    cfg = dg.GenerationConfig(max_new_tokens=12, max_denoising_steps=6)
    return model, cfg


def _same(img: Image) -> Image:
    """An equal image in new tensors (as a second request's preprocessing gives it)."""
    return Image(img.pixel_values.clone(), img.position_ids.clone())


def _engine(model):
    return build_engine(model, eager=True, max_batch=2, max_seq_len=SLOTS, page_size=P, max_denoising_steps=16)


def _run(engine, model, prompt, imgs, cfg, seed=1) -> Request:
    req = engine.submit(Request(prompt=prompt, config=cfg, seed=seed, images=prepare(model, [prompt], [imgs])[0]))
    while not engine.idle():
        engine.step()
        engine.memory.pool.check()
        engine.row_table.cache.fill_pages(list(engine.memory.pool.free), float("nan"))
    return req


def _static(model, prompt, imgs, cfg, seed=1) -> list[int]:
    return dg.generate(model, [prompt], cfg, seed=seed, images=[imgs], moe_impl="dense",
                       max_seq_len=SLOTS).sequences[0]


def _item(img: Image) -> ImagePrompt:
    """ONE's image prompt without a model (what `prepare` makes of it for the canvas of 8)."""
    return ImagePrompt(runs=[(4, 9)], images=[img], digests=[digest(img)], length=len(ONE), chunk=8)


def test_page_keys_mix_image_content_and_forwards():
    """Salts: equal for an equal image, different for another image of the same size (same placeholder ids) and on
    every page the image touches; bounds: the ends of the prefix's forwards and of the step's full chunks."""
    a, b, c = _item(image(9, 1)), _item(_same(image(9, 1))), _item(image(9, 2))
    assert digest(a.images[0]) == digest(b.images[0]) != digest(c.images[0])
    ka, kb, kc = (page_keys(x, P) for x in (a, b, c))
    assert ka == kb and len(ka.salts) == len(ONE) // P
    assert all(sa != sc for sa, sc in zip(ka.salts, kc.salts))  # pages 0 and 1 both hold placeholders
    assert a.prefix == 16 and ka.bounds == {0, 4, 13, 16}  # [16, 23) is the step's last, partial chunk
    longer = ImagePrompt(runs=[(4, 9)], images=a.images, digests=a.digests, length=len(ONE) + 9, chunk=8)
    assert page_keys(longer, P).bounds == {0, 4, 13, 16, 24, 32}  # full chunks of the step from E = 16
    assert cut_hit([7, 8], P, ka.bounds) == [7, 8] and cut_hit([7], P, frozenset({0, 4})) == []
    with pytest.raises(ValueError, match="page_size: 12 is not a multiple of the encoder chunk 8"):
        page_keys(a, 12)


@pytest.mark.slow
def test_image_pages_shared_by_content_same_tokens(mm):
    """One engine, requests in turn: an image request equals the static path; the same image again maps the image
    prefix's pages and encodes nothing; another image with the same placeholder ids hits nothing (its first page
    already holds placeholders) and is encoded; a hit ending between two images encodes only the second; every
    request's tokens equal its static-cache solo run."""
    model, cfg = mm
    engine = _engine(model)
    st = engine.stats
    first = _run(engine, model, ONE, [image(9, 1)], cfg)
    want = _static(model, ONE, [image(9, 1)], cfg)
    assert first.sequence == want and len(want) > 0
    assert (st.images_encoded, st.image_prefix_tokens, st.prefix_hit_tokens) == (1, 16, 0)

    again = _run(engine, model, ONE, [_same(image(9, 1))], cfg)
    assert again.sequence == want
    assert again.images.encodes == 0 and st.images_encoded == 1 and st.prefix_hit_tokens == 16
    assert st.image_prefix_tokens == 16  # nothing of the second request's image prefix ran

    other = _run(engine, model, ONE, [image(9, 2)], cfg)
    assert other.sequence == _static(model, ONE, [image(9, 2)], cfg) != want
    assert other.images.encodes == 1 and st.prefix_hit_tokens == 16  # no page of the first image's was mapped

    two = _run(engine, model, TWO, [image(9, 1), image(6, 3)], cfg, seed=2)
    assert two.sequence == _static(model, TWO, [image(9, 1), image(6, 3)], cfg, seed=2)
    # pages [0, 16) of ONE's first image are TWO's too: mapped; the second image (page 2 on) is encoded
    assert two.images.encodes == 1 and st.prefix_hit_tokens == 32
    assert st.image_prefix_tokens == 16 + 16 + 12


@pytest.mark.slow
def test_concurrent_same_image_waits_and_maps(mm):
    """Two requests with the same image submitted together: the second waits for the first's image pages, then maps
    them (the image is encoded once); both equal the static path."""
    model, cfg = mm
    engine = _engine(model)
    reqs = [engine.submit(Request(prompt=ONE, config=cfg, seed=s, images=prepare(model, [ONE], [[im]])[0]))
            for s, im in ((1, image(9, 1)), (3, _same(image(9, 1))))]
    while not engine.idle():
        engine.step()
        engine.memory.pool.check()
        engine.row_table.cache.fill_pages(list(engine.memory.pool.free), float("nan"))
    assert [r.sequence for r in reqs] == [_static(model, ONE, [image(9, 1)], cfg, seed=s) for s in (1, 3)]
    assert engine.stats.images_encoded == 1 and engine.stats.prefix_hit_tokens == 16


def test_paged_read_write_slots_round_trip():
    """`PagedKVCache.write_slots` / `read_slots` through a scattered page table: what was written comes back, the
    slots before it stay zero."""
    cache = new_paged_cache(batch_size=2, max_seq_len=32, block_size=8, page_size=P, pool_pages=8,
                            layer_shapes=[(2, 4)], dtype=torch.float32, device="cpu")
    cache.map_pages(1, [cache.first_pool_page + 5, cache.first_pool_page + 2, cache.first_pool_page + 7])
    k = torch.randn(2, 19, 4)
    cache.write_slots(1, 0, 3, k, -k)
    got_k, got_v = cache.read_slots(1, 0, 22)
    assert torch.equal(got_k[:, 3:], k) and torch.equal(got_v[:, 3:], -k) and not got_k[:, :3].any()
    assert not cache.keys[0][cache.first_pool_page + 3].any()  # a page the row does not map: untouched
