"""Running code in a network namespace given by its file (a bind mount of an nsfs
inode, e.g. made by `unshare --net=FILE`), without `ip netns` and `/run/netns`.

A thread can join a network namespace on its own (`setns(2)` with CLONE_NEWNET moves
the calling thread only): `in_netns` runs a function in such a thread, so the labs talk
to servers listening in a namespace (readiness probes, API calls) with the standard
library. Sockets keep the namespace they were made in, whoever uses them later; a
process forked from that thread starts in the namespace too. A mount namespace cannot
be joined by a thread of a process with several (EINVAL): for those, `nsenter`.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def enter(fd: int, what: str = "") -> None:
    """The calling thread joins the network namespace of the open file `fd` (OSError
    with setns's errno: EINVAL when the file is not a network namespace)."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what or fd}): {os.strerror(err)}")


def _join(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter(fd, path)
    finally:
        os.close(fd)


def in_netns(path: str | os.PathLike[str], fn: Callable[[], T]) -> T:
    """`fn()` run in a thread that joined the network namespace at `path`; its result,
    or its exception raised here."""
    out: list[T] = []
    failed: list[BaseException] = []

    def body() -> None:
        try:
            _join(os.fspath(path))
            out.append(fn())
        except BaseException as e:  # handed to the caller
            failed.append(e)

    thread = threading.Thread(target=body, name=f"netns:{os.path.basename(path)}", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]
