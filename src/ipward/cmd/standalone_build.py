"""The standalone plugin `ipward install-cni --standalone` writes (atomically, with
`install.write_executable`), and the check of the host's python that runs it.

It is for a host that has no ipward, such as a Kubernetes node whose agent runs in a
container: one file in zipapp form (a shebang line, then a zip archive with
`__main__.py`) holding the forwarding path only
(STANDALONE_MODULES, standard library only: `ipward.cni.standalone` says what it does). The
host's `/usr/bin/python3` runs it. Its shebang does not run the archive as a zipapp
(`python3 FILE` imports `runpy` and with it `importlib.util`, `os`, `contextlib`...: +8
to +19 ms per exec measured here) but puts the file on `sys.path` and calls the entry
point, with `-c` (the kernel passes all of the line after the interpreter as one
argument, and CPython reads `-ISc<code>` as -I, -S, -c <code>); the line stays under
128 bytes, the kernel's bound before Linux 5.1. `python3 FILE` works too.
Each module is in it as source and as bytecode of the installing interpreter
(hash-based, unchecked: the archive never changes): a host Python of the same version
imports the bytecode, any other one compiles the source, as zipimport falls back on a
bad magic number (compiling costs 6 to 10 ms per exec here).
"""

from __future__ import annotations

import importlib.util
import io
import marshal
import os
import re
import zipfile
from pathlib import Path

import ipward

HOST_PYTHON = "/usr/bin/python3"
STANDALONE_MAIN = "from ipward.cni.standalone import main;main()"
SHEBANG = f"#!{HOST_PYTHON} -IScimport sys;sys.path.insert(0,sys.argv[1]);{STANDALONE_MAIN}\n"
# The modules the standalone plugin runs (`-X importtime` of each verb shows no others).
# Paths in the package, each with the `__init__` of its package (kept empty: see each).
STANDALONE_MODULES = (
    "__init__",
    "cni/__init__",
    "cni/cniio",
    "cni/plugin",
    "cni/standalone",
    "cni/wire",
    "core/__init__",
    "core/errors",
    "core/jsonc",
)
# The oldest Python the standalone plugin's modules run on: 3.10 for `isinstance` with
# `X | Y` (jsonc). Only 3.11 is exec-tested; older syntax is checked with
# `ast.parse(feature_version=...)` (tests/test_install_standalone.py).
MIN_HOST_PYTHON = (3, 10)
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same modules make the same bytes
_VERSIONED_NAME = re.compile(r"python(\d+)\.(\d+)")


def standalone_plugin() -> bytes:
    """The standalone plugin's bytes: the shebang, then the zip archive."""
    package = Path(ipward.__file__).resolve().parent
    out = io.BytesIO()
    out.write(SHEBANG.encode())
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        files = [(f"ipward/{m}", (package / f"{m}.py").read_bytes()) for m in STANDALONE_MODULES]
        for name, source in [*files, ("__main__", f"{STANDALONE_MAIN}\n".encode())]:
            archive.writestr(zipfile.ZipInfo(f"{name}.py", _ZIP_TIME), source)
            archive.writestr(zipfile.ZipInfo(f"{name}.pyc", _ZIP_TIME), _bytecode(name, source))
    return out.getvalue()


def _bytecode(name: str, source: bytes) -> bytes:
    """A .pyc of `source` for this interpreter (PEP 552: hash-based, not checked)."""
    code = compile(source, f"{name}.py", "exec", dont_inherit=True)
    unchecked_hash = (0b01).to_bytes(4, "little")
    return (
        importlib.util.MAGIC_NUMBER
        + unchecked_hash
        + importlib.util.source_hash(source)
        + marshal.dumps(code)
    )


def host_python_problem(host_root: Path) -> str | None:
    """What keeps the host's /usr/bin/python3, seen under `host_root`, from running the
    standalone plugin; None when nothing does. It is read, not run (an init container's
    libraries are not the host's): its version comes from the name the symlink chain
    ends at (`python3.11`, as Debian, Ubuntu, Fedora, Alpine and Arch install it),
    else from its standard library's directory when there is only one, and that
    directory must hold the library."""
    shown = host_root / HOST_PYTHON.lstrip("/")
    resolved = _resolve_under(host_root, HOST_PYTHON)
    if resolved is None or not resolved.is_file():
        return (
            f"{shown} does not exist (or is not a file): the standalone plugin runs on the"
            f" host's {HOST_PYTHON}, Python {_dotted(MIN_HOST_PYTHON)} or later with its"
            " standard library; install python3 on the host"
        )
    libraries = {
        version: directory
        for directory in sorted(host_root.glob("usr/lib*/python3.*"))
        if (version := _version_of(directory.name)) and (directory / "os.py").is_file()
    }
    version = _version_of(resolved.name)
    if version is None and len(libraries) == 1:
        version = next(iter(libraries))
    if version is None:
        return (
            f"cannot tell which Python {shown} is: it is {resolved.name!r}, not a name like"
            f" python3.11, and the host has {len(libraries)} standard libraries"
            f" under {host_root / 'usr'}"
        )
    if version < MIN_HOST_PYTHON:
        return (
            f"{shown} is Python {_dotted(version)}; the standalone plugin needs"
            f" {_dotted(MIN_HOST_PYTHON)} or later"
        )
    if version not in libraries:
        return (
            f"{shown} is Python {_dotted(version)}, but its standard library"
            f" ({host_root}/usr/lib/python{_dotted(version)}/os.py) is missing"
        )
    return None


def _resolve_under(root: Path, path: str) -> Path | None:
    """`path` of the host with its symlinks followed inside `root` (an absolute target
    is the host's, so under `root` too); None if it does not lead to anything."""
    for _ in range(40):  # Linux's own bound on symlinks in one lookup
        candidate = root / path.lstrip("/")
        if not candidate.is_symlink():
            return candidate if candidate.exists() else None
        target = os.readlink(candidate)
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return None


def _version_of(name: str) -> tuple[int, int] | None:
    match = _VERSIONED_NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))
