"""What every HTTP request passes before the app reads a byte of its body (an ASGI middleware).

In order: the Host header must name this server (DNS rebinding: a page on evil.example that
resolves its name to 127.0.0.1 reaches a server without a key, so only names the server knows
itself by pass); cross-origin requests get CORS headers only from --allowed-origins; the API key,
compared in constant time; and the declared body size. So an unauthorized or oversized body costs
one header read: no parsing, no memory. Every response says `X-Content-Type-Options: nosniff`, the
chat page also carries a Content-Security-Policy that lets it talk to this server only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
# the page's own script and style are inline; it fetches only this server
PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGES = ("/",)


def too_large(max_body_bytes: int) -> str:
    """The 413's message, whether the declared size (here) or the bytes read (the server) exceed it."""
    return f"the request body is larger than this server takes ({max_body_bytes / 2**20:g} MB; --max-body-mb)"


def protected(path: str) -> bool:
    """The routes the API key guards: the OpenAI and Ollama APIs and the tokenizer's."""
    return path.startswith(("/v1/", "/api/")) or path in ("/tokenize", "/detokenize", "/apply-template")


def split_list(value: str | None) -> tuple[str, ...]:
    """"a, b,c" -> ("a", "b", "c")."""
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class HostRule:
    """Which Host headers are served: `allowed` (comma-separated names, "*" for any), by default
    the localhost names and the bind address; bound to every interface, any IP address too (a
    rebinding attack needs a DNS name, never an address)."""

    def __init__(self, bind: str, allowed: str | None):
        names = split_list(allowed)
        self.any = "*" in names
        self.names = {n.lower() for n in names} | set(LOCAL_NAMES) | ({bind.lower()} if bind not in WILDCARD_BINDS else set())
        self.any_ip = bind in WILDCARD_BINDS

    def allows(self, header: str | None) -> bool:
        if self.any:
            return True
        if not header:
            return False
        name = host_name(header)
        return name in self.names or (self.any_ip and _is_ip(name))


class Gate:
    """The ASGI middleware: `service` gives the API key (read per request: a cluster sets it
    late), the rest are fixed at start."""

    def __init__(self, app, service, bind: str, allowed_hosts: str | None, allowed_origins: str | None, max_body_bytes: int):
        self.app, self.service, self.max_body_bytes = app, service, max_body_bytes
        self.hosts = HostRule(bind, allowed_hosts)
        self.origins = set(split_list(allowed_origins))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path, method = scope.get("path", ""), scope.get("method", "GET")
        origin = headers.get("origin")
        cors = self._cors_headers(origin)
        if not self.hosts.allows(headers.get("host")):
            return await refuse(send, 400, "this server does not answer to that Host header; start it with --allowed-hosts to add a name",
                                 "invalid_request_error", "invalid_host")
        if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            if not cors:
                return await refuse(send, 403, "cross-origin requests from this origin are not allowed (--allowed-origins)",
                                     "permission_error", "origin_not_allowed")
            return await _respond(send, 204, b"", cors + [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                                                          (b"access-control-allow-headers", b"authorization, content-type, x-api-key, anthropic-version"),
                                                          (b"access-control-max-age", b"600")])
        key = self.service.api_key
        if key is not None and protected(path):
            given = headers.get("authorization", "").encode("utf-8", "surrogateescape")
            anthropic = headers.get("x-api-key", "").encode("utf-8", "surrogateescape")  # Anthropic's clients send the key so
            if not (hmac.compare_digest(given, f"Bearer {key}".encode()) or hmac.compare_digest(anthropic, key.encode())):
                return await refuse(send, 401, "invalid API key", "authentication_error", "invalid_api_key", cors)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await refuse(send, 413, too_large(self.max_body_bytes), "invalid_request_error", "body_too_large", cors)
        extra = cors + [(b"x-content-type-options", b"nosniff")]
        if path in PAGES:
            extra.append((b"content-security-policy", PAGE_CSP.encode()))

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", ())) + extra)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _cors_headers(self, origin: str | None) -> list:
        if origin is None or not (origin in self.origins or "*" in self.origins):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def refuse(send, status: int, message: str, kind: str, code: str, headers: list = ()) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    await _respond(send, status, body, list(headers) + [(b"content-type", b"application/json")])


async def _respond(send, status: int, body: bytes, headers: list) -> None:
    # close: a client still sending a refused body must not have it read as the next request
    headers = headers + [(b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                         (b"x-content-type-options", b"nosniff")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
