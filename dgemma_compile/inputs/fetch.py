"""Fetching an http(s) URL for a client without letting the client aim the server at its own network (SSRF).

`fetch(url, policy)` reads at most `max_bytes` of a URL with urllib, under a `FetchPolicy`:

- every connection (the first request and each redirect hop) resolves the host itself and connects only to an
  address that passed the check, so a DNS answer cannot change between the check and the connection: loopback,
  private (RFC 1918, fc00::/7, 100.64.0.0/10 shared), link-local (169.254.0.0/16 and the cloud metadata endpoints
  in it, fe80::/10), multicast, reserved and unspecified addresses (and an IPv4 address mapped into IPv6 that is one
  of them) are refused unless `allow_private`;
- with `allowed_domains`, the first URL's host and each redirect's host must be one of them (exact host names,
  case-insensitive; vLLM's `--allowed-media-domains`);
- no proxies from the environment (a proxy would make the checked address the proxy's), at most `MAX_REDIRECTS`
  redirects, http and https only (also for redirects).

Errors (`FetchError`) say what was refused, never why a connection failed: a refused connection, a reset, a DNS
failure and a timeout all read "the image could not be fetched", so a client cannot scan ports or hosts through
the server. An HTTP error status from an allowed host is named ("HTTP 404").
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

MAX_REDIRECTS = 5
"""Redirects followed at most (each hop checked as the first request)."""

UNREACHABLE = "the image could not be fetched (unreachable, refused or timed out)"


class FetchError(Exception):
    """A fetch that was refused or failed; the message is safe to show a client (see the module docstring)."""


@dataclass(frozen=True)
class FetchPolicy:
    """What `fetch` may reach: `allow_private` lets it connect to non-public addresses (for local use: an image
    server on the same machine or network); `allowed_domains` (None: any host) the host names it may fetch from,
    redirects included; `timeout_s` seconds per connection and per read; `max_bytes` the most it reads."""

    allow_private: bool = False
    allowed_domains: frozenset[str] | None = None
    timeout_s: float = 10.0
    max_bytes: int = 8 * 2**20


def is_public(address: str) -> bool:
    """Whether an IP address (text) is one `fetch` may connect to without `allow_private`: not loopback, private,
    link-local, multicast, reserved or unspecified, also as an IPv4 address mapped into (or embedded in) IPv6."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("fe80::1%eth0") is not part of the address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d connects to a.b.c.d: judged as that address
            return is_public(str(ip.ipv4_mapped))
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None and not is_public(str(embedded)):
            return False
    return not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
                or ip.is_unspecified or not ip.is_global)


def _host_allowed(host: str | None, policy: FetchPolicy) -> bool:
    if not host:
        return False
    return policy.allowed_domains is None or host.lower().rstrip(".") in policy.allowed_domains


def _connector(policy: FetchPolicy):
    """`socket.create_connection`'s replacement: resolve, check every answer, connect to the first allowed one."""

    def connect(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None, **_):
        host, port = address
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise FetchError(UNREACHABLE) from None
        allowed = [i for i in infos if policy.allow_private or is_public(i[4][0])]
        if not allowed:
            raise FetchError("the image URL's host is not a public address (loopback, private, link-local, multicast "
                             "and reserved addresses are refused; dgemma serve --allow-private-image-urls allows them)")
        for family, kind, proto, _, sockaddr in allowed:  # each checked answer in turn, as create_connection
            sock = socket.socket(family, kind, proto)
            try:
                if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                    sock.settimeout(timeout)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError:
                sock.close()
        raise FetchError(UNREACHABLE)

    return connect


def _opener(policy: FetchPolicy) -> urllib.request.OpenerDirector:
    connect = _connector(policy)

    class HTTP(http.client.HTTPConnection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = connect

    class HTTPS(http.client.HTTPSConnection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = connect

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(HTTP, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(HTTPS, req, context=self._context)

    class Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = MAX_REDIRECTS

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            target = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl))
            if target.scheme not in ("http", "https"):
                raise FetchError("the image URL redirects to a scheme other than http(s)")
            if not _host_allowed(target.hostname, policy):
                raise FetchError("the image URL redirects to a host outside this server's allowed media domains "
                                 "(dgemma serve --allowed-media-domains)")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    # no ProxyHandler: proxies from the environment are not used (the checked address would be the proxy's)
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.UnknownHandler(), HTTPHandler(), HTTPSHandler(), Redirects(),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def fetch(url: str, policy: FetchPolicy) -> bytes:
    """The body of the http(s) `url` (at most `policy.max_bytes + 1` bytes read, so a caller sees when it is more),
    fetched under `policy` (see the module docstring).

    Raises:
        FetchError: another scheme, a host outside `allowed_domains`, a non-public address without `allow_private`
            (first request or any redirect hop), too many redirects, an HTTP error status, or any network failure
            (one message for all of them: refused, unreachable, timed out).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise FetchError("only http(s) URLs are fetched")
    if not _host_allowed(parts.hostname, policy):
        raise FetchError("the image URL's host is not one of this server's allowed media domains "
                         "(dgemma serve --allowed-media-domains)")
    try:
        with _opener(policy).open(url, timeout=policy.timeout_s) as resp:
            return resp.read(policy.max_bytes + 1)
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        if 300 <= e.code < 400:
            raise FetchError(f"the image URL's redirects were not followed (more than {MAX_REDIRECTS}, a loop, or to a "
                             "scheme other than http(s))") from None
        raise FetchError(f"the image could not be fetched (HTTP {e.code})") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, FetchError):
            raise e.reason from None
        raise FetchError(UNREACHABLE) from None
    except (OSError, ValueError, http.client.HTTPException):
        raise FetchError(UNREACHABLE) from None
