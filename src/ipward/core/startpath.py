"""The plugin's start path: what a pod start runs before the plugin proper, what keeps
its imports cheap, and the executables `ipward install-cni` writes to run it.

A runtime execs the plugin on every pod start, so every module and every import on the
way is paid each time (docs/measurements.md "Plugin start path" has the figures).
In the order an exec meets them:
- The launcher's code pack (`install_pack`, `CodePack`): the package's bytecode in one
  file, so a module is one `pread` and one `marshal.loads`, not the import system's
  search, stats, open and read of its `.pyc`.
- JSON through CPython's C codec `_json` (`json_loads`, `json_dumps`), without the
  `json` package (`re`, `enum`: ~6 ms).
- `_sqlite3` without `functools` (`load_sqlite3`), and without the `sqlite3` package.
What `install-cni` runs (never a plugin exec), below them:
- The launcher (`LAUNCHER`, `write_launcher`): a script on the system interpreter, with
  the package's bytecode and code pack written by that interpreter (`write_bytecode`).
- The native plugin (`native_plugin`): the forwarding path as one static executable,
  built from `cni/native/`, for a host without ipward.
- `write_executable`: either one written atomically.

One module in `core` for all of it: the JSON codec and the SQLite import are used by
`core` (records, log) and `store`, which import nothing above `core`, and nothing here
imports a layer above it (the launcher names `ipward.cni.plugin` in its text only; the
builds read the package's files by path).

What runs at import is on every exec's path: the top imports only modules a bare
interpreter has loaded already, and `_json`; what `install-cni` needs is imported in the
functions that use it.
"""

from __future__ import annotations

import marshal
import posix
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from pathlib import Path
    from types import CodeType, ModuleType
    from typing import Any

# The interpreter the launcher names in its shebang: the system's, not the one
# running `install-cni` (a virtualenv's may not be there for the runtime, or be slower
# to start).
PLUGIN_PYTHON = "/usr/bin/python3"

# -- the code pack ---------------------------------------------------------------------

PACK_NAME = "plugin-modules.pack"  # in the package's __pycache__
PACKED = ("", "cni", "core", "ipam", "store")  # the package and the subpackages packed
_EXTERNAL = sys.modules["_frozen_importlib_external"]  # the import system, loaded at start
_BOOTSTRAP = sys.modules["_frozen_importlib"]

# The file: the index's length (4 bytes, big-endian), the index (marshalled: the
# interpreter's magic number, then per module name (source path, is a package, source
# mtime_ns, source size, offset of its code after the index, its length)), then each
# module's code (marshalled), read only when the module is imported.
Entry = tuple[str, bool, int, int, int, int]


class CodePack:
    """A finder and loader on `sys.meta_path` for the modules of one pack. Each entry
    keeps its source file's mtime and size and is used only while they still match, the
    check Python makes of a `.pyc`: a package changed since (an upgrade that did not run
    `install-cni`) is imported the usual way, module by module."""

    def __init__(self, fd: int, codes_at: int, entries: dict[str, Entry]) -> None:
        self.fd = fd  # open for the plugin's life: a few ms
        self.codes_at = codes_at
        self.entries = entries

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        entry = self.entries.get(name)
        if entry is None:
            return None
        origin, is_package, mtime_ns, size, _, _ = entry
        try:
            st = posix.stat(origin)
        except OSError:
            return None
        if st.st_mtime_ns != mtime_ns or st.st_size != size:
            return None  # changed since the pack was written: the usual import
        spec: ModuleSpec = _BOOTSTRAP.ModuleSpec(name, self, origin=origin, is_package=is_package)
        spec.has_location = True  # __file__ is the source's, as with a .pyc
        if is_package:
            spec.submodule_search_locations = [origin.rpartition("/")[0]]
        return spec

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        *_, offset, length = self.entries[module.__name__]
        code = marshal.loads(posix.pread(self.fd, length, self.codes_at + offset))
        exec(code, module.__dict__)


def install_pack(path: str) -> None:
    """Put the pack at `path` first on `sys.meta_path`; nothing when it cannot be used
    (missing, not whole, or of another interpreter: its magic number)."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return
    try:
        size = posix.fstat(fd).st_size
        length = int.from_bytes(posix.read(fd, 4), "big")
        if 4 + length > size:
            raise ValueError("the index runs past the end")
        magic, entries = marshal.loads(posix.read(fd, length))
        whole = max(offset + n for *_, offset, n in entries.values()) == size - 4 - length
    except (OSError, EOFError, ValueError, TypeError, AttributeError):
        whole = False
    if whole and magic == _EXTERNAL.MAGIC_NUMBER:
        sys.meta_path.insert(0, CodePack(fd, 4 + length, entries))
    else:
        posix.close(fd)


def pack_path(package: str) -> str:
    return f"{package}/__pycache__/{PACK_NAME}"


# -- JSON without the json package -----------------------------------------------------
# `import json` compiles regular expressions in `json.decoder` (pulling in `re` and
# `enum`); the C scanner and encoder underneath need none of that. These two functions
# drive them the way `json` does for the plain cases used here: no hooks, strict
# parsing, compact output. Where `_json` is missing (not CPython), `json` does it.

try:
    import _json
except ImportError:  # pragma: no cover - other interpreters
    _json = None  # type: ignore[assignment]

if _json is None:  # pragma: no cover
    import json as _fallback

    def json_loads(text: str | bytes) -> Any:
        return _fallback.loads(text)

    def json_dumps(obj: object, sort_keys: bool = False) -> str:
        return _fallback.dumps(obj, separators=(",", ":"), sort_keys=sort_keys)

else:
    _WHITESPACE = " \t\n\r"
    _CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}

    class _DecoderSettings:
        """The attributes `_json.make_scanner` reads from a `json.JSONDecoder`."""

        strict = True
        object_hook = None
        object_pairs_hook = None
        parse_float = float
        parse_int = int
        parse_constant = _CONSTANTS.__getitem__
        memo: dict = {}

    _scan = _json.make_scanner(_DecoderSettings())  # type: ignore[arg-type]

    def json_loads(text: str | bytes) -> Any:
        """Parse one JSON document; raises ValueError (as `json` does) when it is not."""
        if isinstance(text, bytes | bytearray):
            text = text.decode("utf-8")
        start = len(text) - len(text.lstrip(_WHITESPACE))
        try:
            value, end = _scan(text, start)
        except StopIteration as e:
            raise ValueError(f"Expecting value: char {e.value}") from None
        except SystemError:
            # The C scanner builds its error from `json.decoder` only if that module is
            # loaded; on malformed input, load it and let `json` report the error.
            import json

            return json.loads(text)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if text[end:].strip(_WHITESPACE):
            raise ValueError(f"Extra data: char {end}")
        return value

    def _default(obj: object) -> object:
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    _encoders = {
        sort_keys: _json.make_encoder(
            None,
            _default,
            _json.encode_basestring_ascii,
            None,
            ":",
            ",",
            sort_keys,
            False,
            True,
        )
        for sort_keys in (False, True)
    }

    def json_dumps(obj: object, sort_keys: bool = False) -> str:
        """Compact JSON text (`separators=(",", ":")`, ASCII)."""
        return "".join(_encoders[sort_keys](obj, 0))


# -- _sqlite3 without functools --------------------------------------------------------

# The Pythons whose `_sqlite3` takes nothing of `functools` but `lru_cache`, each checked
# by tests/system/test_start_path_pythons.py; on any other, `functools` itself is imported.
LRU_CACHE_ONLY = ((3, 11), (3, 12), (3, 13))


def load_sqlite3() -> None:
    """Import the C module `_sqlite3` (the store uses it, not the `sqlite3` package,
    which adds `datetime`, `collections.abc` and date adapters: ~1.5 ms per plugin exec).
    `_sqlite3` itself imports `functools` (and with it `collections`, `operator`,
    `types`, `_collections_abc`: ~1.5 ms more) only for `functools.lru_cache`, with which
    it builds each connection's statement cache. When nothing has imported `functools`
    yet (the plugin), `_sqlite3` is given that same cache, the C `_lru_cache_wrapper`
    that `lru_cache` returns, through a stand-in module taken out of `sys.modules` again
    at once: a later `import functools` gets the real one."""
    if "functools" in sys.modules or sys.version_info[:2] not in LRU_CACHE_ONLY:
        import _sqlite3  # with the real `functools`

        return
    import _functools

    def lru_cache(maxsize: int) -> object:
        def decorate(function: object) -> object:
            return _functools._lru_cache_wrapper(function, max(maxsize, 0), False, tuple)

        return decorate

    stand_in = type(sys)("functools")
    stand_in.lru_cache = lru_cache  # type: ignore[attr-defined]
    sys.modules["functools"] = stand_in
    try:
        import _sqlite3  # noqa: F401
    finally:
        if sys.modules.get("functools") is stand_in:
            del sys.modules["functools"]


# -- the launcher (install-cni) --------------------------------------------------------

# -I -S (one shebang word, as Linux passes everything after the interpreter as one
# argument): isolated, no site, a fast start.
LAUNCHER = f"""#!{PLUGIN_PYTHON} -IS
# ipward CNI IPAM plugin, installed by 'ipward install-cni'. -I -S (one shebang word):
# isolated, no site: fast start; the package is found at the path below, its modules
# in the code pack beside its bytecode (ipward.core.startpath).
import sys
sys.path.insert(0, {{path!r}})
from ipward.core.startpath import install_pack
install_pack({{pack!r}})
from ipward.cni.plugin import main
main()
"""
# Run by the launcher's interpreter: the package's bytecode, then its code pack.
_COMPILE = (
    "import compileall, sys; sys.path.insert(0, sys.argv[1]);"
    " from ipward.core.startpath import write_pack;"
    " ok = compileall.compile_dir(sys.argv[2], quiet=1); write_pack(sys.argv[2]);"
    " sys.exit(0 if ok else 1)"
)


def _package() -> Path:
    """The `ipward` directory this module was imported from."""
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


def write_launcher(target: Path) -> str | None:
    """Write the launcher at `target` (its directory made if missing), atomically, and
    the package's bytecode and code pack for the launcher's interpreter. Returns why
    they could not be written (then every exec compiles the modules it imports, ~10
    ms), else None."""
    package = _package()
    text = LAUNCHER.format(path=str(package.parent), pack=pack_path(str(package)))
    write_executable(target, text.encode())
    return write_bytecode(package)


def write_bytecode(package: Path) -> str | None:
    """Compile `package` with the launcher's interpreter (its own magic number and cache
    tag: the interpreter running this command may be another Python), so no plugin exec
    compiles: its `.pyc` files (those already fresh are left as they are) and its code
    pack. Why it failed, else None."""
    import subprocess

    argv = [PLUGIN_PYTHON, "-I", "-S", "-c", _COMPILE, str(package.parent), str(package)]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {PLUGIN_PYTHON} to write the plugin's bytecode: {e}"
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace").strip()
        return f"the plugin's bytecode was not written under {package}: {output[-500:]}"
    return None


def write_pack(package: str) -> str:
    """Compile the modules of PACKED under `package` (the `ipward` directory) with this
    interpreter into its code pack, atomically (a file beside it, then a rename);
    returns the pack's path."""
    import os

    entries: dict[str, Entry] = {}
    codes: list[bytes] = []
    offset = 0
    for sub in PACKED:
        directory = os.path.join(package, sub)
        prefix = f"ipward.{sub}" if sub else "ipward"
        for file in sorted(os.listdir(directory)):
            if not file.endswith(".py"):
                continue
            origin = os.path.join(directory, file)
            is_package = file == "__init__.py"
            name = prefix if is_package else f"{prefix}.{file[:-3]}"
            st = os.stat(origin)  # before the read: a change after it fails the check
            with open(origin, "rb") as f:
                code = marshal.dumps(_without_docstrings(f.read(), origin))
            entries[name] = (origin, is_package, st.st_mtime_ns, st.st_size, offset, len(code))
            codes.append(code)
            offset += len(code)
    index = marshal.dumps((_EXTERNAL.MAGIC_NUMBER, entries))
    target = pack_path(package)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}"
    with open(partial, "wb") as f:
        f.write(len(index).to_bytes(4, "big") + index + b"".join(codes))
    os.replace(partial, target)
    return target


def _without_docstrings(source: bytes, origin: str) -> CodeType:
    """The module's code without its docstrings: they are for readers of the source,
    the plugin reads none, and they are a sixth of its bytecode (~0.4 ms an exec to
    unmarshal here). Line numbers stay the source's, for tracebacks."""
    import ast

    tree = ast.parse(source, origin)
    documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    for node in ast.walk(tree):
        if isinstance(node, documented) and ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:] or [ast.copy_location(ast.Pass(), node.body[0])]
    return compile(tree, origin, "exec", dont_inherit=True)


def write_executable(target: Path, data: bytes) -> None:
    """Put `data` at `target` as an executable (0755; its directory made if missing),
    atomically and durably: written to a new file beside it, synced, renamed over it.
    A process exec'ing `target` meanwhile runs the old file or the new one, whole."""
    import os
    import tempfile
    from pathlib import Path

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


# -- the native plugin (install-cni --standalone) -------------------------------------
# For a host that has no ipward, such as a Kubernetes node whose agent runs in a
# container: the forwarding path as one statically linked executable, which needs
# nothing of the host (no interpreter, no shell, no C library). Its source and build are
# in the package (`cni/native/`: `ipward-cni.c`, `build.sh`); `scripts/setup.sh` builds it
# in a checkout and the Containerfile in a build stage of its own, into the package,
# where `install-cni --standalone` takes it.

NATIVE_PLUGIN = "cni/native/ipward-cni"  # in the package


class PluginNotBuilt(Exception):
    """The native plugin is not in the package: it was never built here."""


def native_plugin() -> bytes:
    """The native plugin's bytes; PluginNotBuilt when it is missing."""
    path = _package() / NATIVE_PLUGIN
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PluginNotBuilt(
            f"the native plugin {path} was not built (src/ipward/cni/native/build.sh;"
            " scripts/setup.sh runs it in a checkout, the Containerfile in the image)"
        ) from None
