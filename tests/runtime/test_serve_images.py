"""The server's image_url content parts (`data:` URLs) on a tiny multimodal checkpoint: the answer equals the eager
generator's on the same images, and every bad image is an OpenAI-shaped 400 naming the part, nothing else
disturbed."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import numpy as np
import pytest
from helpers import hf_model, image_token_ids, write_checkpoint
from test_serve import SLOTS, ServerThread, _post

import dgemma_compile as dg
from dgemma_compile.inputs.preprocess import ImageSources, num_soft_tokens, preprocess
from dgemma_compile.inputs.text import ImageSlots, encode_chat
from dgemma_runtime import build_engine
from dgemma_runtime.http.server import MAX_IMAGES, choice_seed

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    ref = hf_model(image_ids=image_token_ids(), use_bidirectional_attention="vision", vocab_size=64)
    d = write_checkpoint(tmp_path_factory.mktemp("mmserve"), ref, image_tokenizer=True)
    # the processor's saved settings (read by preprocess.image_processor): 70 soft tokens per image
    (d / "processor_config.json").write_text('{"image_processor": {"max_soft_tokens": 70}}')
    model, tok = dg.load(d), dg.load_tokenizer(d)
    engine = build_engine(model, max_batch=2, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    with ServerThread(engine, tok) as srv:
        yield srv, model, tok


def png_bytes(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(parts, **kw):
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 8, "max_denoising_steps": 3, "seed": 7,
            **kw}


@pytest.mark.slow  # HTTP + two generations
def test_image_url_answer_equals_the_eager_generator(mm_server):
    srv, model, tok = mm_server
    raws = [png_bytes(96, 48, 1), png_bytes(48, 48, 2)]
    parts = [{"type": "image_url", "image_url": {"url": data_url(raws[0])}}, {"type": "text", "text": "what"},
             {"type": "image_url", "image_url": {"url": data_url(raws[1]), "detail": "auto"}}]
    r = _post(srv, "/v1/chat/completions", chat(parts))
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["message"]["content"]
    # the same request through the library: preprocess, placeholders, eager generate (the engine's experts)
    imgs = preprocess(model, [PIL.open(io.BytesIO(b)).convert("RGB") for b in raws])
    slots = ImageSlots.for_model(tok, model, [num_soft_tokens(model, im) for im in imgs])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}, {"type": "image"}]}]
    ids = encode_chat(tok, messages, bos_token_id=model.config.bos_token_id, images=slots)
    cfg = srv.engine.config.replace(max_new_tokens=8, max_denoising_steps=3)
    out = dg.generate(model, [ids], cfg, seed=choice_seed(7, 0), images=[imgs], max_seq_len=SLOTS,
                      moe_impl=srv.engine.row_table.moe_impl)
    assert got == tok.decode(out.sequences[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert ids.count(image_token_ids()[0]) == sum(slots.soft_tokens) and 0 < max(slots.soft_tokens) <= 70


def test_bad_images_are_400s_naming_the_part(mm_server):
    srv = mm_server[0]
    raw = png_bytes(48, 48, 3)
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    text = {"type": "text", "text": "x"}
    cases = [
        ([text, part("http://127.0.0.1:1/a.png")], "messages[0].content[1]", "without --allow-image-urls"),
        ([part("data:text/plain,hello")], "messages[0].content[0]", "only data:image/...;base64 URLs"),
        ([part("data:image/png;base64,@@@")], "messages[0].content[0]", "not valid base64"),
        ([part(data_url(b"not an image at all"))], "messages[0].content[0]", "not an image pillow can read"),
        ([part(data_url(raw[: len(raw) // 2]))], "messages[0].content[0]", "could not decode"),
        ([part(data_url(raw))] * (MAX_IMAGES + 1), f"messages[0].content[{MAX_IMAGES}]",
         f"more than the {MAX_IMAGES} images"),
    ]
    for parts, param, message in cases:
        r = _post(srv, "/v1/chat/completions", chat(parts))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"] and err["type"] == "invalid_request_error"
    # a placeholder typed into the text, without its image: refused, as the generators refuse it
    r = _post(srv, "/v1/chat/completions", chat([{"type": "text", "text": "a <|image|> b"}]))
    assert r.status_code == 400 and "holds image placeholders" in r.json()["error"]["message"], r.text
    ok = _post(srv, "/v1/chat/completions", chat([text]))  # nothing else disturbed
    assert ok.status_code == 200 and srv.engine.idle()


class _Images(http.server.BaseHTTPRequestHandler):
    """127.0.0.1 only: /ok.png an image, /big.png more bytes than allowed, /slow.png answers after 2 s, else 404."""

    body = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path not in ("/ok.png", "/big.png", "/slow.png"):
            self.send_error(404)
            return
        if self.path == "/slow.png":
            time.sleep(2)
        data = self.body * (4 if self.path == "/big.png" else 1)
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.mark.slow  # HTTP: two servers and a fetch timeout
def test_file_and_http_urls_only_where_allowed(mm_server, tmp_path):
    _, model, tok = mm_server
    raw = png_bytes(48, 48, 4)
    (tmp_path / "ok.png").write_bytes(raw)
    _Images.body = raw
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{web.server_address[1]}"
    engine = build_engine(model, max_batch=1, max_seq_len=SLOTS, eager=True, tokenizer=tok)
    sources = ImageSources(directory=tmp_path, fetch=True, max_bytes=2 * len(raw), timeout_s=0.5, allow_private=True)
    part = lambda url: [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]  # noqa: E731
    try:
        with ServerThread(engine, tok, image_sources=sources) as srv:
            for url in (f"{base}/ok.png", f"file://{tmp_path / 'ok.png'}", str(tmp_path / "ok.png")):
                r = _post(srv, "/v1/chat/completions", chat(part(url), max_denoising_steps=1))
                assert r.status_code == 200, (url, r.text)
            for url, message in ((f"{base}/big.png", "more than the"), (f"{base}/slow.png", "timed out"),
                                 (f"{base}/missing.png", "fetched (HTTP 404)"), (f"file://{tmp_path}/../x.png", "outside the allowed"),
                                 (f"file://{tmp_path}/none.png", "file not found"), ("ftp://x/y.png", "unsupported")):
                r = _post(srv, "/v1/chat/completions", chat(part(url)))
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == "messages[0].content[0]", (url, r.text)
                assert message in err["message"], (url, err["message"])
        # fetching without --allow-private-image-urls: 127.0.0.1 is refused, the image server never reached
        public_only = ImageSources(fetch=True, timeout_s=0.5)
        with ServerThread(build_engine(model, max_batch=1, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok,
                          image_sources=public_only) as srv:
            r = _post(srv, "/v1/chat/completions", chat(part(f"{base}/ok.png")))
            assert r.status_code == 400 and "not a public address" in r.json()["error"]["message"], r.text
        # the defaults: data: URLs only
        with ServerThread(build_engine(model, max_batch=1, max_seq_len=SLOTS, eager=True, tokenizer=tok), tok) as srv:
            for url, message in ((f"{base}/ok.png", "without --allow-image-urls"),
                                 (str(tmp_path / "ok.png"), "without --image-dir")):
                r = _post(srv, "/v1/chat/completions", chat(part(url)))
                assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    finally:
        web.shutdown()
