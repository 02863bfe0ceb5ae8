"""containerd's CRI (`runtime.v1.RuntimeService`) over its Unix socket, and `CriSource`, the
liveness source that asks a node's runtime which pod sandboxes it holds.

API: Kubernetes CRI `runtime.v1` (k8s.io/cri-api `pkg/apis/runtime/v1/api.proto`), served
by containerd 1.6 and later (and CRI-O). Only the messages and fields ipward uses are
declared, each with the field number of the published API; a field the runtime sends
that is not declared here is skipped on decode, as protobuf does for any unknown field.

Why no generated code: `protoc` output (`_pb2.py`) checks at import that the protobuf
runtime is the major version it was generated for, and the project supports protobuf
4.25 to 7.x. The schema is therefore the table `_MESSAGES` below, turned into a
`FileDescriptorProto` at import and loaded into a private descriptor pool (nothing is
registered in protobuf's default pool, so another copy of the CRI API in the same
process cannot clash with it). Calls go through `grpc.Channel.unary_unary` with the
messages' own serializers.

Errors: every RPC has a deadline. A failed call raises `CriError`, a
`LivenessUnavailable` carrying the gRPC status code: "could not ask the runtime" is
never turned into an empty answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ipward.cluster.liveness import (
    ClusterView,
    LivenessSource,
    LivenessUnavailable,
    NodeView,
    NotCovered,
    Sandbox,
)

__all__ = [
    "SANDBOX_NOTREADY",
    "SANDBOX_READY",
    "SERVICE",
    "CriClient",
    "CriCondition",
    "CriError",
    "CriRuntimeStatus",
    "CriSandbox",
    "CriSandboxStatus",
    "CriSource",
    "CriVersion",
]

PACKAGE = "runtime.v1"
SERVICE = f"{PACKAGE}.RuntimeService"
API_VERSION = "v1"

# -- the schema: one table, field numbers as in k8s.io/cri-api runtime/v1 api.proto ------
#
# A type is a scalar ("string", "bool", "int64", "uint32"), an enum or message declared
# here, "repeated <type>", or "map<string,string>".

_ENUMS: dict[str, list[tuple[str, int]]] = {
    "PodSandboxState": [("SANDBOX_READY", 0), ("SANDBOX_NOTREADY", 1)],
}

_MAP = "map<string,string>"

_MESSAGES: dict[str, list[tuple[str, int, str]]] = {
    "VersionRequest": [("version", 1, "string")],
    "VersionResponse": [
        ("version", 1, "string"),
        ("runtime_name", 2, "string"),
        ("runtime_version", 3, "string"),
        ("runtime_api_version", 4, "string"),
    ],
    "DNSConfig": [
        ("servers", 1, "repeated string"),
        ("searches", 2, "repeated string"),
        ("options", 3, "repeated string"),
    ],
    "PodSandboxMetadata": [
        ("name", 1, "string"),
        ("uid", 2, "string"),
        ("namespace", 3, "string"),
        ("attempt", 4, "uint32"),
    ],
    "LinuxPodSandboxConfig": [("cgroup_parent", 1, "string")],
    "PodSandboxConfig": [
        ("metadata", 1, "PodSandboxMetadata"),
        ("hostname", 2, "string"),
        ("log_directory", 3, "string"),
        ("dns_config", 4, "DNSConfig"),
        ("labels", 6, _MAP),
        ("annotations", 7, _MAP),
        ("linux", 8, "LinuxPodSandboxConfig"),
    ],
    "RunPodSandboxRequest": [
        ("config", 1, "PodSandboxConfig"),
        ("runtime_handler", 2, "string"),
    ],
    "RunPodSandboxResponse": [("pod_sandbox_id", 1, "string")],
    "StopPodSandboxRequest": [("pod_sandbox_id", 1, "string")],
    "StopPodSandboxResponse": [],
    "RemovePodSandboxRequest": [("pod_sandbox_id", 1, "string")],
    "RemovePodSandboxResponse": [],
    "PodSandboxStatusRequest": [
        ("pod_sandbox_id", 1, "string"),
        ("verbose", 2, "bool"),
    ],
    "PodIP": [("ip", 1, "string")],
    "PodSandboxNetworkStatus": [
        ("ip", 1, "string"),
        ("additional_ips", 2, "repeated PodIP"),
    ],
    "PodSandboxStatus": [
        ("id", 1, "string"),
        ("metadata", 2, "PodSandboxMetadata"),
        ("state", 3, "PodSandboxState"),
        ("created_at", 4, "int64"),  # nanoseconds
        ("network", 5, "PodSandboxNetworkStatus"),
        ("labels", 7, _MAP),
        ("annotations", 8, _MAP),
        ("runtime_handler", 9, "string"),
    ],
    "PodSandboxStatusResponse": [
        ("status", 1, "PodSandboxStatus"),
        ("info", 2, _MAP),  # verbose only; containerd: "info" -> JSON (pid, runtimeSpec...)
    ],
    "PodSandboxStateValue": [("state", 1, "PodSandboxState")],
    "PodSandboxFilter": [
        ("id", 1, "string"),
        ("state", 2, "PodSandboxStateValue"),
        ("label_selector", 3, _MAP),
    ],
    "ListPodSandboxRequest": [("filter", 1, "PodSandboxFilter")],
    "PodSandbox": [
        ("id", 1, "string"),
        ("metadata", 2, "PodSandboxMetadata"),
        ("state", 3, "PodSandboxState"),
        ("created_at", 4, "int64"),  # nanoseconds
        ("labels", 5, _MAP),
        ("annotations", 6, _MAP),
        ("runtime_handler", 7, "string"),
    ],
    "ListPodSandboxResponse": [("items", 1, "repeated PodSandbox")],
    "StatusRequest": [("verbose", 1, "bool")],
    "RuntimeCondition": [
        ("type", 1, "string"),
        ("status", 2, "bool"),
        ("reason", 3, "string"),
        ("message", 4, "string"),
    ],
    "RuntimeStatus": [("conditions", 1, "repeated RuntimeCondition")],
    "StatusResponse": [
        ("status", 1, "RuntimeStatus"),
        ("info", 2, _MAP),  # verbose only; containerd: "cniconfig", "lastCNILoadStatus"...
    ],
}

# method -> (request, response), all unary
_METHODS: dict[str, tuple[str, str]] = {
    "Version": ("VersionRequest", "VersionResponse"),
    "RunPodSandbox": ("RunPodSandboxRequest", "RunPodSandboxResponse"),
    "StopPodSandbox": ("StopPodSandboxRequest", "StopPodSandboxResponse"),
    "RemovePodSandbox": ("RemovePodSandboxRequest", "RemovePodSandboxResponse"),
    "PodSandboxStatus": ("PodSandboxStatusRequest", "PodSandboxStatusResponse"),
    "ListPodSandbox": ("ListPodSandboxRequest", "ListPodSandboxResponse"),
    "Status": ("StatusRequest", "StatusResponse"),
}

SANDBOX_READY = dict(_ENUMS["PodSandboxState"])["SANDBOX_READY"]
SANDBOX_NOTREADY = dict(_ENUMS["PodSandboxState"])["SANDBOX_NOTREADY"]

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bool": _F.TYPE_BOOL,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
}


def _add_field(msg: descriptor_pb2.DescriptorProto, name: str, number: int, type_: str) -> None:
    f = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
    if type_ == _MAP:
        # A map is a repeated nested "<Name>Entry" message {key = 1, value = 2} marked map_entry.
        entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
        entry = msg.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        _add_field(entry, "key", 1, "string")
        _add_field(entry, "value", 2, "string")
        f.label = _F.LABEL_REPEATED
        f.type = _F.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{msg.name}.{entry_name}"
        return
    if type_.startswith("repeated "):
        f.label = _F.LABEL_REPEATED
        type_ = type_.removeprefix("repeated ")
    if type_ in _SCALARS:
        f.type = _SCALARS[type_]
    elif type_ in _ENUMS:
        f.type = _F.TYPE_ENUM
        f.type_name = f".{PACKAGE}.{type_}"
    elif type_ in _MESSAGES:
        f.type = _F.TYPE_MESSAGE
        f.type_name = f".{PACKAGE}.{type_}"
    else:
        raise TypeError(f"CRI schema: {msg.name}.{name}: unknown type {type_!r}")


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(
        name="ipward/cri_runtime_v1.proto", package=PACKAGE, syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = fd.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for msg_name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=msg_name)
        for name, number, type_ in fields:
            _add_field(msg, name, number, type_)
    return fd


def _message_classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    fd = _file_descriptor()
    pool.Add(fd)
    # GetMessageClass exists from protobuf 4.22 on (MessageFactory.GetPrototype, its
    # predecessor, is gone from 5.x).
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name in _MESSAGES
    }


_CLASSES = _message_classes()


def message_class(type_name: str) -> Any:
    """The class of a CRI message declared in `_MESSAGES` (for servers and tests)."""
    return _CLASSES[type_name]


def message(type_name: str, /, **fields: Any) -> Any:
    """A new CRI message by type name, e.g. `message("PodSandboxMetadata", name="p")`."""
    return _CLASSES[type_name](**fields)


# -- answers ------------------------------------------------------------------------------


class CriError(LivenessUnavailable):
    """A CRI call failed (runtime unreachable, deadline, refused). `code` is the gRPC
    status code, or None when the call never reached gRPC."""

    def __init__(self, msg: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(msg)
        self.code = code


@dataclass(frozen=True)
class CriVersion:
    version: str
    runtime_name: str
    runtime_version: str
    runtime_api_version: str


@dataclass(frozen=True)
class CriCondition:
    """One condition of `Status`, e.g. RuntimeReady, NetworkReady."""

    type: str
    status: bool
    reason: str = ""
    message: str = ""


@dataclass(frozen=True)
class CriRuntimeStatus:
    conditions: dict[str, CriCondition]
    info: Mapping[str, str] = field(default_factory=dict)

    def ready(self, condition: str) -> bool:
        c = self.conditions.get(condition)
        return bool(c and c.status)


@dataclass(frozen=True)
class CriSandbox:
    """A pod sandbox as `ListPodSandbox` describes it."""

    id: str
    namespace: str
    name: str
    uid: str
    attempt: int
    state: int  # SANDBOX_READY or SANDBOX_NOTREADY
    created_at: float  # seconds since the epoch
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    runtime_handler: str = ""

    @property
    def ready(self) -> bool:
        return self.state == SANDBOX_READY

    def to_sandbox(self) -> Sandbox:
        return Sandbox(
            id=self.id,
            ready=self.ready,
            namespace=self.namespace,
            name=self.name,
            uid=self.uid,
            created_at=self.created_at,
        )


@dataclass(frozen=True)
class CriSandboxStatus(CriSandbox):
    """`PodSandboxStatus`: the sandbox, its addresses, and with `verbose` the runtime's
    extra `info` (containerd: key "info", a JSON object with the sandbox's pid and
    runtime spec)."""

    ip: str = ""
    additional_ips: tuple[str, ...] = ()
    info: Mapping[str, str] = field(default_factory=dict)

    @property
    def ips(self) -> tuple[str, ...]:
        return ((self.ip,) if self.ip else ()) + self.additional_ips


def _sandbox_fields(m: Any) -> dict[str, Any]:
    return {
        "id": m.id,
        "namespace": m.metadata.namespace,
        "name": m.metadata.name,
        "uid": m.metadata.uid,
        "attempt": m.metadata.attempt,
        "state": int(m.state),
        "created_at": m.created_at / 1e9,
        "labels": dict(m.labels),
        "annotations": dict(m.annotations),
        "runtime_handler": m.runtime_handler,
    }


def _target(socket_path: str) -> str:
    return f"unix://{socket_path}" if socket_path.startswith("/") else f"unix:{socket_path}"


# -- the client ---------------------------------------------------------------------------


class CriClient:
    """`runtime.v1.RuntimeService` on a Unix socket; every call has `timeout` seconds."""

    CHANNEL_OPTIONS = [
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.use_local_subchannel_pool", 1),
        # After a failed connect grpc fails calls at once until its reconnect backoff
        # ends (up to 120 s by default): a restarted runtime is seen again within 1 s.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]

    def __init__(self, socket_path: str, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel = grpc.insecure_channel(_target(socket_path), options=self.CHANNEL_OPTIONS)
        self._calls: dict[str, Any] = {}
        for method, (req, resp) in _METHODS.items():
            self._calls[method] = self._channel.unary_unary(
                f"/{SERVICE}/{method}",
                request_serializer=_CLASSES[req].SerializeToString,
                response_deserializer=_CLASSES[resp].FromString,
            )

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        deadline = self.timeout if timeout is None else timeout
        try:
            return self._calls[method](request, timeout=deadline)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                why = f"no answer within {deadline:g}s"
            elif code == grpc.StatusCode.UNAVAILABLE:
                why = f"unreachable ({details})"
            else:
                why = f"{code.name if code else 'error'}: {details}"
            raise CriError(f"CRI {method} on {self.socket_path}: {why}", code) from e
        except ValueError as e:  # e.g. the channel was closed
            raise CriError(f"CRI {method} on {self.socket_path}: {e}") from e

    def version(self) -> CriVersion:
        m = self._call("Version", message("VersionRequest", version=API_VERSION))
        return CriVersion(m.version, m.runtime_name, m.runtime_version, m.runtime_api_version)

    def status(self, verbose: bool = False) -> CriRuntimeStatus:
        """The runtime's conditions (RuntimeReady, NetworkReady), and with `verbose` its
        extra `info` (containerd: its config, the CNI config it loaded and how that went)."""
        m = self._call("Status", message("StatusRequest", verbose=verbose))
        conditions = {
            c.type: CriCondition(c.type, c.status, c.reason, c.message) for c in m.status.conditions
        }
        return CriRuntimeStatus(conditions, dict(m.info))

    def list_pod_sandboxes(
        self,
        id: str = "",
        state: int | None = None,
        label_selector: Mapping[str, str] | None = None,
    ) -> list[CriSandbox]:
        """All sandboxes, ready and not ready, unless filtered (fields combine with AND)."""
        request = message("ListPodSandboxRequest")
        if id or state is not None or label_selector:
            flt = request.filter
            flt.SetInParent()
            if id:
                flt.id = id
            if state is not None:
                flt.state.state = state
            flt.label_selector.update(label_selector or {})
        answer = self._call("ListPodSandbox", request)
        return [CriSandbox(**_sandbox_fields(item)) for item in answer.items]

    def pod_sandbox_status(self, sandbox_id: str, verbose: bool = False) -> CriSandboxStatus:
        answer = self._call(
            "PodSandboxStatus",
            message("PodSandboxStatusRequest", pod_sandbox_id=sandbox_id, verbose=verbose),
        )
        s = answer.status
        return CriSandboxStatus(
            **_sandbox_fields(s),
            ip=s.network.ip,
            additional_ips=tuple(p.ip for p in s.network.additional_ips),
            info=dict(answer.info),
        )

    def run_pod_sandbox(
        self,
        name: str,
        namespace: str,
        uid: str,
        attempt: int = 0,
        hostname: str = "",
        log_directory: str = "",
        cgroup_parent: str = "",
        dns_servers: tuple[str, ...] | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        runtime_handler: str = "",
        timeout: float | None = None,
    ) -> str:
        """Start a sandbox (the runtime sets up its network through CNI); its ID."""
        config = message(
            "PodSandboxConfig",
            metadata=message(
                "PodSandboxMetadata", name=name, namespace=namespace, uid=uid, attempt=attempt
            ),
            hostname=hostname or name,
            log_directory=log_directory,
            labels=dict(labels or {}),
            annotations=dict(annotations or {}),
        )
        if dns_servers is not None:
            config.dns_config.servers.extend(dns_servers)
            config.dns_config.SetInParent()
        if cgroup_parent:
            config.linux.cgroup_parent = cgroup_parent
        request = message("RunPodSandboxRequest", config=config, runtime_handler=runtime_handler)
        return str(self._call("RunPodSandbox", request, timeout).pod_sandbox_id)

    def stop_pod_sandbox(self, sandbox_id: str, timeout: float | None = None) -> None:
        request = message("StopPodSandboxRequest", pod_sandbox_id=sandbox_id)
        self._call("StopPodSandbox", request, timeout)

    def remove_pod_sandbox(self, sandbox_id: str, timeout: float | None = None) -> None:
        request = message("RemovePodSandboxRequest", pod_sandbox_id=sandbox_id)
        self._call("RemovePodSandbox", request, timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the liveness source ------------------------------------------------------------------


class CriSource(LivenessSource):
    """The sandboxes one node's runtime holds, from CRI `ListPodSandbox`.

    `node` is the only node this socket answers for: any other raises `NotCovered` (a
    runtime's empty list is no evidence about another node's sandboxes). A runtime sees
    no cluster, so `cluster_view` raises `NotCovered`.
    """

    covers_cluster = False

    def __init__(self, socket_path: str, node: str, timeout: float = 2.0) -> None:
        if not node:
            raise ValueError("a CRI source answers for one node: name it")
        self.socket_path = socket_path
        self.node = node
        self.timeout = timeout
        self.client = CriClient(socket_path, timeout)

    def node_view(self, node: str) -> NodeView:
        if node != self.node:
            raise NotCovered(f"CRI socket {self.socket_path} is node {self.node}'s, not {node}'s")
        as_of = time.time()  # before the call: every sandbox created before it is listed
        sandboxes = self.client.list_pod_sandboxes()
        return NodeView(node, as_of, {s.id: s.to_sandbox() for s in sandboxes})

    def cluster_view(self) -> ClusterView:
        raise NotCovered(f"CRI socket {self.socket_path} sees one node's runtime, no cluster")

    def finish_teardown(self, node: str, sandbox: str) -> None:
        """StopPodSandbox again: on a stopped sandbox the runtime only tears down what is
        left (its network namespace, with the CNI DEL); a no-op when nothing is."""
        if node != self.node:
            raise NotCovered(f"CRI socket {self.socket_path} is node {self.node}'s, not {node}'s")
        self.client.stop_pod_sandbox(sandbox)

    def close(self) -> None:
        self.client.close()
