"""The daemons' scaffold: what `ipward agent` and `ipward controller` share at their edge.
Signals (SIGTERM/SIGINT: stop, a second one cuts the drain short), the store opened and
its schema checked before anything is served (waited for while unreachable), the shared
options (`--store`, `--metrics-address`, `--log-file`, `--log-level`, `--add-grace`),
log set-up, the HTTP endpoint for `/metrics` (Prometheus text) and `/healthz`, a store
probe with a deadline, and store URLs with their secrets hidden."""

from __future__ import annotations

import errno
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import click
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ipward.core import log
from ipward.core.errors import InvalidConfig, IpwardError
from ipward.core.policy import ADD_GRACE
from ipward.store import (
    Store,
    StoreDamaged,
    StoreError,
    StoreUnreachable,
    open_store_waiting,
    refuse_damaged,
)

SECRET_OPTIONS = ("password", "key")

HEALTH_TIMEOUT = 2.0  # seconds the store probe of /healthz waits for revision()

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

    def __init__(self, store: Store, timeout: float = HEALTH_TIMEOUT) -> None:
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
    in_use_for: float = 0.0,
) -> ThreadingHTTPServer:
    """Serve `/metrics` from `registry` and `/healthz` (200 or 503 with the text that
    `health` gives) on `address`, in a daemon thread. An address in use is tried again
    for up to `in_use_for` seconds (the process before this one may still hold it)."""

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

    deadline, said = time.monotonic() + in_use_for, False
    while True:
        try:
            server = Server(address, Handler)
            break
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise InvalidConfig(
                    f"--metrics-address {address[0]}:{address[1]}: {e.strerror}"
                ) from e
            if not said:
                said = True
                log.info(
                    "metrics address in use; trying again", address=address[0], port=address[1]
                )
            time.sleep(0.5)
    threading.Thread(target=server.serve_forever, args=(0.1,), name="metrics", daemon=True).start()
    return server


def http_url(server: ThreadingHTTPServer) -> str:
    """Where `start_http`'s server answers, for logs."""
    address, port = server.server_address[:2]
    host = address.decode() if isinstance(address, bytes) else str(address)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def stop_http(server: ThreadingHTTPServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def metrics_option(default: str) -> Callable[[Callable], Callable]:
    return click.option(
        "--metrics-address",
        default=default,
        show_default=True,
        help="HOST:PORT for /metrics and /healthz, or 'off'.",
    )


def store_option(note: str = "") -> Callable[[Callable], Callable]:
    return click.option(
        "--store",
        "store_url",
        envvar="IPWARD_STORE",
        help=f"Store URL (else IPWARD_STORE, else the global --store).{note}",
    )


log_file_option = click.option(
    "--log-file", type=click.Path(dir_okay=False), help="Append logs here (else stderr)."
)
log_level_option = click.option(
    "--log-level", type=click.Choice(list(log.LEVELS)), default="info", show_default=True
)


def start(
    ctx: click.Context, store_url: str | None, log_file: str | None, log_level: str, name: str
) -> str:
    """A daemon command's first step: its logs set up; the store URL it serves (its
    `--store`, else the global one)."""
    log.configure(log_file, log_level, name)
    url = store_url or getattr(ctx.obj, "store_url", None)
    if not url:
        raise InvalidConfig("no store: give --store or IPWARD_STORE")
    return url


class Signals:
    """SIGTERM and SIGINT while a daemon runs (installed before anything that takes
    time, so a stop asked for during start is not lost; the previous handlers come back
    on exit): the first sets `stop`, a second one `cut_short` (the drain ends early).
    `on_stop` runs in the handler too."""

    def __init__(self, on_stop: Callable[[], None] | None = None) -> None:
        self.stop = threading.Event()
        self.cut_short = threading.Event()
        self.count = 0
        self.on_stop = on_stop
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.count += 1
        if self.stop.is_set():
            self.cut_short.set()
        self.stop.set()
        if self.on_stop is not None:
            self.on_stop()


def open_daemon_store(url: str, stop: threading.Event, error: type[IpwardError]) -> Store | None:
    """The daemon's store, its schema checked before anything is served; waited for while
    it cannot be reached (None: stopped meanwhile). One that is not usable (106), that
    reports damage to its data (serving from it could hand out a held address) or a bad
    URL is permanent: logged, and raised as `error`."""
    try:
        store = open_store_waiting(url, stop)
    except StoreError as e:
        log.error("store not usable; not starting", store=redact(url), error=str(e))
        raise error(f"store {redact(url)}: {e}") from e
    if store is None:
        return None
    try:
        refuse_damaged(redact(url), store.integrity_problems())
    except StoreDamaged as e:
        store.close()
        log.error("store damaged; not starting", store=redact(url), error=str(e))
        raise error(str(e)) from e
    except StoreUnreachable as e:  # gone again: served as any other outage (11)
        log.warning("store unreachable at start; its integrity not checked", error=str(e))
    return store
