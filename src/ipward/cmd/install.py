"""The plugin launcher: the executable `ipward install-cni` puts into a runtime's CNI bin
dir (the benchmark installs it the same way). It runs the system interpreter with -I -S
(isolated, no site: a fast start; one shebang word, as Linux passes everything after
the interpreter as one argument) and finds the package at the path it was installed
from."""

from __future__ import annotations

import os
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
    """Write the launcher at `target` (its directory made if missing), atomically: a
    runtime never execs a half-written plugin."""
    package_root = str(Path(ipward.__file__).resolve().parent.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(LAUNCHER.format(path=package_root))
    tmp.chmod(0o755)
    tmp.replace(target)
