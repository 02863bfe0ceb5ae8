"""The plugin's notes on the node (docs/design.md 5.14): one empty file per attachment
whose ADD was sent to an agent, removed when its DEL has been served. A DEL that cannot
reach an agent (or names none it could use) answers success when there is no note:
no ADD of that attachment ever reached an agent, so no address can be held for it, and
a pod with a wrong `agentSocket` is deleted instead of staying Terminating for good.
With a note, an address may be held: the DEL fails, and the runtime retries it.

A note is `NOTES_DIR/<network>/<container>/<ifname>`. Every identity an agent accepts
names one (network names and container IDs are CNI identifiers of at most 255
characters, interface names at most 15 bytes without '/'): an identity that names no
note cannot hold an address. The directory is on the node's disk (not /run), so notes
survive a reboot, after which the runtime tears down the sandboxes it remembers. They
are not synced: a note lost to a power cut right after its ADD leaves that address to
the agent's reconciliation (`sandbox-gone`).

On the plugin's start path: `posix` only.
"""

from __future__ import annotations

import posix

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

NOTES_DIR = b"/var/lib/cni/ipward"
# Where notes are kept instead (tests; a node whose /var/lib/cni is elsewhere): the
# runtime's own environment, which no network config or pod annotation can set.
NOTES_DIR_VARIABLE = b"IPWARD_CNI_NOTES"
NAME_MAX = 255


class NoteFailure(OSError):
    """The note of an ADD could not be written: the ADD is not sent."""


def _component(value: object) -> bytes | None:
    if isinstance(value, str):
        try:
            value = value.encode()
        except UnicodeEncodeError:  # a lone surrogate: no network an agent accepts
            return None
    if not isinstance(value, bytes) or not 0 < len(value) <= NAME_MAX:
        return None
    if b"/" in value or b"\0" in value or value in (b".", b".."):
        return None
    return value


def note_path(network: object, environ: Mapping[bytes, bytes]) -> bytes | None:
    """The note of the attachment (`network`, CNI_CONTAINERID, CNI_IFNAME); None when
    they name none (then no agent accepts the attachment either)."""
    parts = (
        _component(network),
        _component(environ.get(b"CNI_CONTAINERID")),
        _component(environ.get(b"CNI_IFNAME")),
    )
    if None in parts:
        return None
    top = environ.get(NOTES_DIR_VARIABLE) or NOTES_DIR
    return b"/".join((top, *parts))  # type: ignore[arg-type]


def write(path: bytes, agent: str) -> None:
    """Note that an ADD of this attachment is about to be sent to `agent`."""
    cut = path.rfind(b"/")
    try:
        _make_dirs(path[:cut])
        fd = posix.open(
            path,
            posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_NOFOLLOW | posix.O_CLOEXEC,
            0o600,
        )
        try:
            posix.write(fd, agent.encode() + b"\n")
        finally:
            posix.close(fd)
    except OSError as e:
        shown = path.decode("utf-8", "replace")
        raise NoteFailure(e.errno, f"cannot write its note {shown}: {e.strerror}") from None


def held(path: bytes | None) -> bool:
    """Whether an ADD of this attachment may have reached an agent since its last
    served DEL. A note that cannot be looked at counts as there."""
    if path is None:
        return False
    try:
        posix.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def remove(path: bytes | None) -> None:
    """Forget the note once a DEL was served (its container's directory with it when
    empty). Best effort: a note left behind only makes a later DEL wait for the agent."""
    if path is None:
        return
    try:
        posix.unlink(path)
        posix.rmdir(path[: path.rfind(b"/")])
    except OSError:
        pass


def _make_dirs(path: bytes) -> None:
    if not path:
        return
    try:
        posix.mkdir(path, 0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        _make_dirs(path[: path.rfind(b"/")])
        try:
            posix.mkdir(path, 0o700)
        except FileExistsError:
            pass
