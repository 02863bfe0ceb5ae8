"""The plugin executables `ipward install-cni` puts into a runtime's CNI bin dir.

The launcher (the default; the benchmark installs it the same way) runs the system
interpreter with -I -S (isolated, no site: a fast start; one shebang word, as Linux
passes everything after the interpreter as one argument), finds the package at the
path it was installed from and loads its modules from the code pack written with its
bytecode (`ipward.cni.codepack`). The standalone plugin (`--standalone`) is built by
`ipward.cmd.standalone_build`.

Both are written atomically (a file beside the target, then a rename), so a runtime
never execs a half-written plugin, also while an upgrade rewrites it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import ipward
from ipward.cni import codepack

PLUGIN_PYTHON = "/usr/bin/python3"  # the launcher's interpreter
LAUNCHER = f"""#!{PLUGIN_PYTHON} -IS
# ipward CNI IPAM plugin, installed by 'ipward install-cni'. -I -S (one shebang word):
# isolated, no site: fast start; the package is found at the path below, its modules
# in the code pack beside its bytecode (ipward.cni.codepack).
import sys
sys.path.insert(0, {{path!r}})
from ipward.cni.codepack import install
install({{pack!r}})
from ipward.cni.plugin import main
main()
"""
# Run by the launcher's interpreter: the package's bytecode, then its code pack.
_COMPILE = (
    "import compileall, sys; sys.path.insert(0, sys.argv[1]);"
    " from ipward.cni.codepack import write;"
    " ok = compileall.compile_dir(sys.argv[2], quiet=1); write(sys.argv[2]);"
    " sys.exit(0 if ok else 1)"
)


def write_launcher(target: Path) -> str | None:
    """Write the launcher at `target` (its directory made if missing), atomically, and
    the package's bytecode and code pack for the launcher's interpreter. Returns why
    they could not be written (then every exec compiles the modules it imports, ~10
    ms), else None."""
    package = Path(ipward.__file__).resolve().parent
    text = LAUNCHER.format(path=str(package.parent), pack=codepack.pack_path(str(package)))
    write_executable(target, text.encode())
    return write_bytecode(package)


def write_bytecode(package: Path) -> str | None:
    """Compile `package` with the launcher's interpreter (its own magic number and cache
    tag: the interpreter running this command may be another Python), so no plugin exec
    compiles: its `.pyc` files (those already fresh are left as they are) and its code
    pack. Why it failed, else None."""
    argv = [PLUGIN_PYTHON, "-I", "-S", "-c", _COMPILE, str(package.parent), str(package)]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {PLUGIN_PYTHON} to write the plugin's bytecode: {e}"
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace").strip()
        return f"the plugin's bytecode was not written under {package}: {output[-500:]}"
    return None


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
