"""A small Kubernetes API client over one kept urllib3 connection pool: JSON requests and
watch streams (one JSON event per line of a chunked response).

urllib3 2.x does the HTTP and TLS (through an `ssl.SSLContext` built from the
connection's CA, client certificate and server name); this module only adds the
API's conventions: bearer tokens read per request, `Status` bodies turned into
`ApiError`, transport failures into `ApiUnreachable`.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import Iterator
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.exceptions import HTTPError

from ipward.core.errors import InvalidConfig
from ipward.kubeapi.config import Connection

JSON = "application/json"
# Metadata only (nodes, namespaces): a list asks for the List kind, a watch for the item.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"


class ApiError(Exception):
    """The server answered with an error status (its `Status` body, when it sent one)."""

    def __init__(self, status: int, reason: str, message: str, body: dict | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}

    @property
    def not_found(self) -> bool:
        """A clean NotFound: the API's Status with reason NotFound (a proxy's bare 404,
        or any other error, is not one)."""
        return self.status == 404 and self.reason == "NotFound"

    @property
    def expired(self) -> bool:
        return self.status == 410


class ApiUnreachable(Exception):
    """No usable answer: refused, reset, timed out, TLS failure, or a body that is not
    the API's JSON."""


def _ssl_context(conn: Connection) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if conn.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        if conn.ca_file or conn.ca_data:
            context = ssl.create_default_context(
                cafile=conn.ca_file or None, cadata=conn.ca_data or None
            )
    if conn.cert_file or conn.cert_data:
        if conn.cert_data:
            # load_cert_chain takes only paths: a private file, gone once loaded.
            with tempfile.TemporaryDirectory(prefix="ipward-k8s-") as tmp:
                cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
                for path, data in ((cert, conn.cert_data), (key, conn.key_data or conn.cert_data)):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                context.load_cert_chain(cert, key)
        else:
            context.load_cert_chain(conn.cert_file, conn.key_file or None)
    return context


class WatchStream:
    """One open watch: iterate for events (dicts); `close` from any thread ends it."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response
        self._closed = False
        self._ended = False  # the server ended the response cleanly: connection reusable

    def __iter__(self) -> Iterator[dict]:
        pending = b""
        try:
            for chunk in self._response.stream(65536):
                pending += chunk
                while b"\n" in pending:
                    line, _, pending = pending.partition(b"\n")
                    if line.strip():
                        yield _decode(line)
        except (HTTPError, OSError) as e:
            raise ApiUnreachable(f"watch stream broken: {e}") from e
        if self._closed:
            raise ApiUnreachable("watch stream closed by us")
        if pending.strip():
            raise ApiUnreachable(f"watch stream ended inside a line: {pending[:80]!r}")
        self._ended = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._ended:
            try:
                self._response.shutdown()  # wakes a reader blocked on the socket
            except (ValueError, RuntimeError, OSError):
                pass  # it ended or was released meanwhile
            self._response.close()  # and its connection: never reused mid-stream
        self._response.release_conn()


def _decode(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ApiUnreachable(f"not JSON: {e}: {raw[:80]!r}") from e
    if not isinstance(value, dict):
        raise ApiUnreachable(f"not a JSON object: {raw[:80]!r}")
    return value


class ApiClient:
    def __init__(self, conn: Connection, timeout: float = 10.0) -> None:
        self.conn = conn
        self.timeout = timeout
        parts = urlsplit(conn.server)
        if not parts.hostname:
            raise InvalidConfig(f"Kubernetes API server {conn.server!r}: no host")
        self._prefix = parts.path.rstrip("/")
        kwargs: dict = {"maxsize": 8, "block": False, "retries": False}
        try:
            if parts.scheme == "https":
                kwargs["ssl_context"] = _ssl_context(conn)
                if conn.insecure:
                    kwargs.update(cert_reqs="CERT_NONE", assert_hostname=False)
                if conn.tls_server_name:
                    kwargs["server_hostname"] = conn.tls_server_name
            self._pool = urllib3.connection_from_url(conn.server, **kwargs)
        except (OSError, ssl.SSLError, ValueError) as e:
            raise InvalidConfig(f"Kubernetes API {conn.server}: TLS setup: {e}") from e

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": "ipward"}
        token = self.conn.token_file.token() if self.conn.token_file else self.conn.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _url(self, path: str, query: dict[str, str] | None) -> str:
        return f"{self._prefix}{path}?{urlencode(query)}" if query else f"{self._prefix}{path}"

    def _open(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None,
        accept: str,
        body: dict | None,
        read_timeout: float,
    ) -> urllib3.BaseHTTPResponse:
        headers = self._headers(accept)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = (
                "application/merge-patch+json" if method == "PATCH" else "application/json"
            )
        try:
            response = self._pool.urlopen(
                method,
                self._url(path, query),
                body=data,
                headers=headers,
                preload_content=False,
                timeout=urllib3.Timeout(connect=self.timeout, read=read_timeout),
                retries=False,
            )
        except (HTTPError, OSError) as e:
            raise ApiUnreachable(f"{method} {path}: {e}") from e
        if response.status >= 400:
            raise _api_error(response.status, _read_all(response, f"{method} {path}"))
        return response

    def request(
        self,
        method: str,
        path: str,
        query: dict[str, str] | None = None,
        *,
        accept: str = JSON,
        body: dict | None = None,
        read_timeout: float | None = None,
    ) -> dict:
        """One request; the answer's JSON object. Raises ApiError, ApiUnreachable. A read
        waits at most `read_timeout` (default: the client's timeout) for the next bytes."""
        response = self._open(method, path, query, accept, body, read_timeout or self.timeout)
        return _decode(_read_all(response, f"{method} {path}"))

    def watch(
        self, path: str, query: dict[str, str], *, accept: str, read_timeout: float
    ) -> WatchStream:
        """Open a watch (`watch=1` is added); a read waiting longer than `read_timeout`
        for the next bytes fails the stream."""
        response = self._open("GET", path, {**query, "watch": "1"}, accept, None, read_timeout)
        return WatchStream(response)

    def close(self) -> None:
        self._pool.close()


def _read_all(response: urllib3.BaseHTTPResponse, what: str) -> bytes:
    try:
        return response.read()
    except (HTTPError, OSError) as e:
        raise ApiUnreachable(f"{what}: reading the answer (HTTP {response.status}): {e}") from e
    finally:
        response.release_conn()


def _api_error(status: int, raw: bytes) -> ApiError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")), body)
    return ApiError(status, "", raw[:200].decode("utf-8", "replace"))
