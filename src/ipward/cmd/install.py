"""The plugin executables `ipward install-cni` puts into a runtime's CNI bin dir.

The launcher (the default; the benchmark installs it the same way) runs the system
interpreter with -I -S (isolated, no site: a fast start; one shebang word, as Linux
passes everything after the interpreter as one argument) and finds the package at the
path it was installed from. The standalone plugin (`--standalone`) is built by
`ipward.cmd.standalone_build`.

Both are written atomically (a file beside the target, then a rename), so a runtime
never execs a half-written plugin, also while an upgrade rewrites it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import ipward

LAUNCHER = """#!/usr/bin/python3 -IS
# ipward CNI IPAM plugin, installed by 'ipward install-cni'. -I -S (one shebang word):
# isolated, no site: fast start; the package is found at the path below.
import sys
sys.path.insert(0, {path!r})
from ipward.cni.plugin import main
main()
"""


def write_launcher(target: Path) -> None:
    """Write the launcher at `target` (its directory made if missing), atomically."""
    package_root = str(Path(ipward.__file__).resolve().parent.parent)
    write_executable(target, LAUNCHER.format(path=package_root).encode())


def write_executable(target: Path, data: bytes) -> None:
    """Put `data` at `target` as an executable (0755; its directory made if missing),
    atomically and durably: written to a new file beside it, synced, renamed over it.
    A process exec'ing `target` meanwhile runs the old file or the new one, whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o755)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)
