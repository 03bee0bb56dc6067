"""`fetch.fetch` (the server's http(s) image URLs) never reaches a non-public address unless allowed, on the first
request or on any redirect hop; an allow-list of domains holds on redirects too; its errors do not tell a refused
port from a closed host; and an image's pixel count is bounded before it is decoded (`preprocess`)."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading

import pytest

from dgemma_compile.inputs import fetch as F
from dgemma_compile.model.config import ConfigError
from dgemma_compile.inputs.preprocess import ImageSources, decode_data_url, open_image_url


class _Site(http.server.BaseHTTPRequestHandler):
    """/ok: 200 "hello"; /to?u=URL: 302 to URL; counts the requests its server got."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.hits += 1
        if self.path.startswith("/to?u="):
            self.send_response(302)
            self.send_header("location", self.path.removeprefix("/to?u="))
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if self.path != "/ok":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *a):
        pass


@pytest.fixture
def site():
    """Start `_Site` servers on loopback addresses: `site(host)` -> (server, base URL)."""
    servers = []

    def start(host: str = "127.0.0.1"):
        srv = http.server.ThreadingHTTPServer((host, 0), _Site)
        srv.hits = 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://{host}:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True), ("127.0.0.1", False), ("127.8.9.10", False), ("::1", False),
    ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False), ("100.64.0.1", False),
    ("169.254.169.254", False), ("fe80::1", False), ("fe80::1%eth0", False), ("fc00::1", False),
    ("224.0.0.1", False), ("ff02::1", False), ("0.0.0.0", False), ("::", False), ("240.0.0.1", False),
    ("255.255.255.255", False), ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
    ("2002:7f00:1::", False), ("::ffff:8.8.8.8", True),
])
def test_is_public(address, public):
    assert F.is_public(address) is public


def test_loopback_refused_by_default_reached_when_allowed(site):
    srv, base = site()
    for url in (f"{base}/ok", f"http://localhost:{srv.server_address[1]}/ok"):
        with pytest.raises(F.FetchError, match="not a public address"):
            F.fetch(url, F.FetchPolicy())
    assert srv.hits == 0  # never connected
    assert F.fetch(f"{base}/ok", F.FetchPolicy(allow_private=True)) == b"hello"
    assert srv.hits == 1


def test_a_redirect_to_loopback_is_refused(site, monkeypatch):
    """127.0.0.2 plays a public host (the check is told so); its redirect to 127.0.0.1 or localhost is refused at
    that hop, and the target never sees a request."""
    public, pub = site("127.0.0.2")
    target, inner = site("127.0.0.1")
    real = F.is_public
    monkeypatch.setattr(F, "is_public", lambda a: a == "127.0.0.2" or real(a))
    assert F.fetch(f"{pub}/ok", F.FetchPolicy()) == b"hello"
    for to in (f"{inner}/ok", f"http://localhost:{target.server_address[1]}/ok"):
        with pytest.raises(F.FetchError, match="not a public address"):
            F.fetch(f"{pub}/to?u={to}", F.FetchPolicy())
    assert target.hits == 0 and public.hits == 3
    # allowed explicitly: followed
    assert F.fetch(f"{pub}/to?u={inner}/ok", F.FetchPolicy(allow_private=True)) == b"hello"


def test_allowed_domains_hold_on_every_hop(site):
    srv, base = site()
    port = srv.server_address[1]
    policy = F.FetchPolicy(allow_private=True, allowed_domains=frozenset({"localhost"}))
    assert F.fetch(f"http://localhost:{port}/ok", policy) == b"hello"
    with pytest.raises(F.FetchError, match="allowed media domains"):
        F.fetch(f"{base}/ok", policy)  # 127.0.0.1 is not "localhost"
    with pytest.raises(F.FetchError, match="redirects to a host outside"):
        F.fetch(f"http://localhost:{port}/to?u={base}/ok", policy)
    with pytest.raises(F.FetchError, match="to a scheme other than http"):
        F.fetch(f"http://localhost:{port}/to?u=file:///etc/passwd", policy)
    with pytest.raises(F.FetchError, match="redirects were not followed"):
        F.fetch(f"http://localhost:{port}/to?u=/to?u=/to?u=/to?u=/to?u=/to?u=/to?u=/ok", policy)
    assert srv.hits == 3 + 6


def test_errors_do_not_reveal_the_network(site):
    """A closed port, an unknown host and an HTTP error: no OS error text; the two network failures read alike."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    policy = F.FetchPolicy(allow_private=True, timeout_s=2)
    messages = []
    for url in (f"http://127.0.0.1:{port}/x", "http://no-such-host.invalid/x"):
        with pytest.raises(F.FetchError) as e:
            F.fetch(url, policy)
        messages.append(str(e.value))
    assert messages[0] == messages[1] == F.UNREACHABLE
    _, base = site()
    with pytest.raises(F.FetchError, match=r"\(HTTP 404\)$"):
        F.fetch(f"{base}/missing", policy)
    with pytest.raises(ConfigError) as e:
        open_image_url(f"http://127.0.0.1:{port}/x", "part", ImageSources(fetch=True, allow_private=True))
    assert str(e.value) == f"part: {F.UNREACHABLE}"


def test_pixels_bounded_before_decoding():
    PIL = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    PIL.new("RGB", (300, 200)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert decode_data_url(url, "part", max_pixels=300 * 200).size == (300, 200)
    with pytest.raises(ConfigError, match=r"part: the image is 300x200 = 60000 pixels, more than the 59999"):
        decode_data_url(url, "part", max_pixels=300 * 200 - 1)
    with pytest.raises(ConfigError, match="more than the 100 allowed"):
        open_image_url(url, "part", ImageSources(max_pixels=100))
