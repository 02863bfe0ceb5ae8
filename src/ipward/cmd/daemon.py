"""What the long-running parts (agent, controller) share at their edge: the HTTP
endpoint for `/metrics` (Prometheus text) and `/healthz`, the `--metrics-address`
option, a store probe with a deadline, and store URLs with their secrets hidden."""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import click
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ipward.core import log
from ipward.core.errors import InvalidConfig
from ipward.core.policy import ADD_GRACE
from ipward.store import Store

SECRET_OPTIONS = ("password", "key")

# Shared by `ipward agent`, `ipward controller` and `ipward gc` (the rules of ipward.gc).
add_grace_option = click.option(
    "--add-grace",
    type=click.FloatRange(0),
    default=ADD_GRACE,
    show_default=True,
    help="Seconds after its ADD before a record can be judged leaked (its sandbox may not"
    " be listed yet).",
)


def parse_address(text: str) -> tuple[str, int] | None:
    """`HOST:PORT` or `[V6]:PORT` -> (host, port); "off" -> None."""
    if text.strip().lower() == "off":
        return None
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidConfig(f"--metrics-address {text!r}: expected HOST:PORT or 'off'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def redact(url: str) -> str:
    """A store URL fit for logs: the values of secret options replaced."""
    parts = urllib.parse.urlsplit(url)
    if not any(option in parts.query for option in SECRET_OPTIONS):
        return url
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    hidden = [(k, "***" if k in SECRET_OPTIONS else v) for k, v in query]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(hidden)))


class HealthProbe:
    """`store.revision()` with a deadline. One probe at a time: concurrent callers share
    the probe in flight, so a hung store never piles up threads."""

    def __init__(self, store: Store, timeout: float = 2.0) -> None:
        self._store = store
        self._timeout = timeout
        self._lock = threading.Lock()
        self._current: dict[str, Any] | None = None

    def check(self) -> tuple[bool, str]:
        with self._lock:
            probe = self._current
            if probe is None or probe["done"].is_set():
                probe = {"done": threading.Event(), "ok": False, "reason": ""}
                self._current = probe
                threading.Thread(
                    target=self._run, args=(probe,), name="health-probe", daemon=True
                ).start()
        if not probe["done"].wait(self._timeout):
            return False, f"store did not answer within {self._timeout:g}s"
        return probe["ok"], probe["reason"]

    def _run(self, probe: dict[str, Any]) -> None:
        try:
            revision = self._store.revision()
            probe["ok"], probe["reason"] = True, f"store at revision {revision}"
        except Exception as e:  # any failure is "unhealthy", with its reason
            probe["reason"] = f"store: {type(e).__name__}: {e}"
        probe["done"].set()


def start_http(
    address: tuple[str, int],
    registry: CollectorRegistry,
    health: Callable[[], tuple[bool, str]],
    name: str,
) -> ThreadingHTTPServer:
    """Serve `/metrics` from `registry` and `/healthz` (200 or 503 with the text that
    `health` gives) on `address`, in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        server_version = name

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, text = health()
                self._send(200 if ok else 503, f"{text}\n".encode(), "text/plain; charset=utf-8")
            else:
                self._send(404, b"not found: try /metrics or /healthz\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http", client=self.client_address[0], request=format % args)

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET

    try:
        server = Server(address, Handler)
    except OSError as e:
        raise InvalidConfig(f"--metrics-address {address[0]}:{address[1]}: {e.strerror}") from e
    threading.Thread(target=server.serve_forever, args=(0.1,), name="metrics", daemon=True).start()
    return server
