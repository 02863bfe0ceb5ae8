"""API objects reduced to what ipward uses, as they are parsed: a cache holds these, never
the API's objects (`managedFields`, specs, statuses and other annotations than ipward's
and a mirror pod's are dropped with the page or event they came in).

Each parser takes one object (dict) and returns (cache key, value); it raises
KeyError, TypeError or ValueError on an object it cannot read (the caller relists).
"""

from __future__ import annotations

import sys
from datetime import datetime

from ipward.cluster.liveness import MIRROR_ANNOTATION, TERMINAL_PHASES, Pod

ANNOTATION_PREFIX = "ipward.io/"  # kept: pool selection, sticky
DEFAULT_GRACE = 30.0  # the API's default terminationGracePeriodSeconds
# Shared by every pod without ipward annotations (most): a Pod is frozen and its
# annotations are read, never changed, by every user.
_NO_ANNOTATIONS: dict[str, str] = {}
_floats: dict[float, float] = {}  # grace values repeat: one float object per value


def api_time(text: str) -> float:
    """An RFC 3339 time of the API (`2026-11-24T05:19:22Z`) as seconds since the epoch."""
    return datetime.fromisoformat(text).timestamp()


def kept_annotations(annotations: object) -> dict[str, str]:
    """The annotations ipward reads: its own (`ipward.io/`) and MIRROR_ANNOTATION (a
    static pod is found by its mirror pod's, `Pod.mirror_of`); no other is kept."""
    if not isinstance(annotations, dict) or not annotations:
        return _NO_ANNOTATIONS
    kept = {
        sys.intern(k): str(v)
        for k, v in annotations.items()
        if k.startswith(ANNOTATION_PREFIX) or k == MIRROR_ANNOTATION
    }
    return kept or _NO_ANNOTATIONS


def _shared_float(value: float) -> float:
    return _floats.setdefault(value, value)


def parse_pod(obj: dict) -> tuple[str, Pod]:
    """A pod by UID. `deleted_at` is when the deletion was asked for (the API's
    `deletionTimestamp` is that time plus the grace); `grace` is the deletion's grace when
    one was asked for, else the pod's termination grace; `finished_at` (terminal pods
    only) is the latest `finishedAt` of its containers' terminated states, None when none
    says (the pod is then kept until it is deleted); the owner is the controlling
    ownerReference."""
    meta = obj["metadata"]
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    uid = str(meta["uid"])
    phase = sys.intern(str(status.get("phase") or "Pending"))
    deletion_grace = meta.get("deletionGracePeriodSeconds")
    grace = float(
        deletion_grace
        if deletion_grace is not None
        else spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE)
    )
    deleted_at = None
    if meta.get("deletionTimestamp"):
        deleted_at = api_time(meta["deletionTimestamp"]) - float(deletion_grace or 0)
    finished_at = None
    if phase in TERMINAL_PHASES:
        finished = [
            api_time(terminated["finishedAt"])
            for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
            for container in status.get(key) or []
            if (terminated := (container.get("state") or {}).get("terminated"))
            and terminated.get("finishedAt")
        ]
        finished_at = max(finished) if finished else None
    owner_kind = owner_name = ""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") is True:
            owner_kind, owner_name = sys.intern(str(ref["kind"])), sys.intern(str(ref["name"]))
            break
    return uid, Pod(
        uid=uid,
        namespace=sys.intern(str(meta["namespace"])),
        name=str(meta["name"]),
        phase=phase,
        node=sys.intern(str(spec.get("nodeName") or "")),
        deleted_at=deleted_at,
        grace=_shared_float(grace),
        finished_at=finished_at,
        owner_kind=owner_kind,
        owner_name=owner_name,
        annotations=kept_annotations(meta.get("annotations")),
    )


def parse_node(obj: dict) -> tuple[str, bool]:
    """A node by name (its existence is all that is used)."""
    return sys.intern(str(obj["metadata"]["name"])), True


def parse_namespace(obj: dict) -> tuple[str, dict[str, str]]:
    """A namespace by name: its ipward annotations."""
    meta = obj["metadata"]
    return sys.intern(str(meta["name"])), kept_annotations(meta.get("annotations"))


def parse_statefulset(obj: dict) -> tuple[str, int]:
    """A StatefulSet by "namespace/name": its desired replicas (the API's default is 1)."""
    meta = obj["metadata"]
    replicas = (obj.get("spec") or {}).get("replicas")
    return f"{meta['namespace']}/{meta['name']}", 1 if replicas is None else int(replicas)
