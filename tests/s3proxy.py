"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the loopback S3 server
(tests/s3server.py), for the tests of what shardpoint does when the network or
the object store misbehaves. Clients talk to it exactly as they would to S3; it
forwards every request byte for byte to the real server, except the ones the
test armed it to break:

- ``"500"``: answers ``500 InternalError`` (S3's XML error body) without forwarding;
- ``"503"``: answers ``503 SlowDown`` without forwarding;
- ``"reset"``: forwards, then sends half of the answer (half of its body, or half
  of its header when it has no body) and resets the connection (RST);
- ``"stall"``: reads the request, forwards nothing and answers nothing until the
  client gives up (its read timeout) or ``stall_s`` passes;
- ``"drop"``: forwards the request, so the server applies it, then closes the
  connection without a byte of the answer.

The schedule is the test's: :meth:`FaultProxy.arm` names the requests to break
by their index among the requests the proxy sees from then on (optionally only
those with some methods), so a seeded random choice of indexes puts the faults
at random, reproducible points of a save or a load; ``repeat`` breaks the retries
of a broken request too (same method and path), to outlast a client's attempts.
Ranks in other processes arm it over HTTP: ``POST /__fault_proxy__/arm`` with the
same arguments as JSON, ``GET /__fault_proxy__/state`` for what it saw and did
(:func:`control`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from tests.s3server import KEY, REGION, SECRET

KINDS = ("500", "503", "reset", "stall", "drop")
CONTROL = "/__fault_proxy__/"

_ERRORS = {
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclass
class Fault:
    """One fault the proxy injected."""

    index: int
    kind: str
    method: str
    path: str


@dataclass
class _Schedule:
    kind: str | None = None
    at: frozenset[int] = frozenset()
    methods: tuple[str, ...] | None = None
    repeat: int = 1
    seen: int = 0
    target: tuple[str, str] | None = None
    left: int = 0
    done: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)


class FaultProxy:
    """A threaded proxy from a free loopback port to ``upstream`` (``http://127.0.0.1:PORT``).
    Use as a context manager; :attr:`endpoint_url` and :attr:`storage_options` point
    clients at it."""

    def __init__(self, upstream: str, *, stall_s: float = 30.0) -> None:
        parts = urlsplit(upstream)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the fault proxy only forwards to loopback, not {upstream}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._sched = _Schedule()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()
        self._thread.join(timeout=10)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    # -- the schedule ------------------------------------------------------------

    def arm(self, kind: str | None, at: Iterable[int] = (), methods: Iterable[str] | None = None,
            repeat: int = 1) -> None:
        """Break the requests with these indexes (0-based, counted from now among
        requests whose method is in ``methods``, all when None) with ``kind``, and
        the next ``repeat - 1`` requests with the same method and path as the last
        one broken (its retries); ``kind=None`` only counts. Resets the counts and
        the record of faults."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self._sched = _Schedule(
                kind, frozenset(at), tuple(m.upper() for m in methods) if methods else None, repeat=repeat
            )

    def disarm(self) -> None:
        self.arm(None)

    @property
    def seen(self) -> int:
        """Requests counted since :meth:`arm` (those its ``methods`` match)."""
        with self._lock:
            return self._sched.seen

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._sched.done)

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request since :meth:`arm`."""
        with self._lock:
            return list(self._sched.requests)

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            s = self._sched
            s.requests.append((method, path))
            if s.methods is not None and method not in s.methods:
                return None
            i = s.seen
            s.seen += 1
            if s.kind is None:
                return None
            if s.left > 0 and s.target == (method, path):
                s.left -= 1
            elif i in s.at:
                s.target, s.left = (method, path), s.repeat - 1
            else:
                return None
            s.done.append(Fault(i, s.kind, method, path))
            return s.kind

    def _control(self, method: str, path: str, body: bytes) -> bytes:
        if method == "POST" and path.startswith(CONTROL + "arm"):
            args = json.loads(body or b"{}")
            self.arm(args.get("kind"), args.get("at", ()), args.get("methods"), args.get("repeat", 1))
            out: Any = {"ok": True}
        else:
            with self._lock:
                s = self._sched
                out = {"seen": s.seen, "faults": [f.__dict__ for f in s.done], "requests": len(s.requests)}
        data = json.dumps(out).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(data), data)

    # -- one client connection -----------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._conns.add(client)
        upstream: socket.socket | None = None
        try:
            rfile = client.makefile("rb")
            while not self._stop.is_set():
                req = _read_request(rfile, client)
                if req is None:
                    return
                method, path, raw = req
                if path.startswith(CONTROL):
                    client.sendall(self._control(method, path, raw.split(b"\r\n\r\n", 1)[1]))
                    continue
                kind = self._decide(method, path)
                if kind in _ERRORS:
                    client.sendall(_error(kind, method, path))
                    continue
                if kind == "stall":
                    self._stall(client)
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=120)
                    up_file = upstream.makefile("rb")
                upstream.sendall(raw)
                head, body = _read_response(up_file, method)
                if kind == "drop":  # applied by the server; the client never hears of it
                    _reset(client)
                    return
                if kind == "reset":
                    if len(body) >= 2:
                        client.sendall(head + body[: len(body) // 2])
                    else:
                        client.sendall(head[: len(head) // 2])
                    _reset(client)
                    return
                client.sendall(head + body)
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(client)
            for s in (upstream, client):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _stall(self, client: socket.socket) -> None:
        """Say nothing until the client hangs up (its timeout) or ``stall_s`` passes."""
        client.settimeout(0.2)
        waited = 0.0
        while waited < self.stall_s and not self._stop.is_set():
            try:
                if client.recv(65536) == b"":
                    return
            except TimeoutError:
                waited += 0.2
            except OSError:
                return


def _reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _error(kind: str, method: str, path: str) -> bytes:
    status, reason, code, message = _ERRORS[kind]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{path.split('?')[0]}</Resource><RequestId>shardpoint-fault-proxy</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: shardpoint-fault-proxy\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def _headers(f: BinaryIO) -> tuple[bytes, dict[str, str]] | None:
    """The header block (start line included) and the headers, lower-cased."""
    lines: list[bytes] = []
    while True:
        line = f.readline(65537)
        if not line:
            return None
        if not lines and line in (b"\r\n", b"\n"):
            continue
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    fields: dict[str, str] = {}
    for line in lines[1:-1]:
        name, _, value = line.decode("latin-1").partition(":")
        fields[name.strip().lower()] = value.strip()
    return b"".join(lines), fields


def _body(f: BinaryIO, fields: dict[str, str]) -> bytes:
    """The body as it came (chunked bodies raw, chunk headers and trailers included)."""
    if "chunked" in fields.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size_line = f.readline(65537)
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    t = f.readline(65537)
                    out += t
                    if t in (b"\r\n", b"\n", b""):
                        return bytes(out)
            out += _exactly(f, size + 2)
    return _exactly(f, int(fields.get("content-length", "0") or 0))


def _exactly(f: BinaryIO, n: int) -> bytes:
    data = f.read(n) if n else b""
    if len(data) != n:
        raise ValueError("connection closed in the middle of a message")
    return data


def _read_request(f: BinaryIO, client: socket.socket) -> tuple[str, str, bytes] | None:
    got = _headers(f)
    if got is None:
        return None
    head, fields = got
    method, path = head.split(b" ", 2)[:2]
    if fields.get("expect", "").lower() == "100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = b"".join(line + b"\r\n" for line in head.split(b"\r\n")[:-2] if not line.lower().startswith(b"expect:"))
        head += b"\r\n"
    return method.decode(), path.decode("latin-1"), head + _body(f, fields)


def _read_response(f: BinaryIO, method: str) -> tuple[bytes, bytes]:
    while True:
        got = _headers(f)
        if got is None:
            raise ValueError("the server closed the connection")
        head, fields = got
        status = int(head.split(b" ", 2)[1])
        if status != 100:
            break
    if method == "HEAD" or status in (204, 304):
        return head, b""
    return head, _body(f, fields)


@contextlib.contextmanager
def fault_proxy(upstream: str, **kwargs: Any) -> Iterator[FaultProxy]:
    with FaultProxy(upstream, **kwargs) as p:
        yield p


def control(endpoint_url: str, action: str, **args: Any) -> Any:
    """Arm the proxy at ``endpoint_url`` from another process (``action="arm"`` with
    :meth:`FaultProxy.arm`'s arguments) or read its state (``action="state"``)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    data = json.dumps(args).encode() if action == "arm" else None
    req = urllib.request.Request(endpoint_url + CONTROL + action, data=data, method="POST" if data else "GET")
    with opener.open(req, timeout=30) as r:
        return json.loads(r.read())
