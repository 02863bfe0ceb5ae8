"""The plugin's modules as one file of bytecode (a code pack), loaded by the launcher
`ipward install-cni` writes: an exec imports each module the plugin needs from one read,
not by the import system's search, stat, open and read of a `.pyc` a module (~30 a
pod start, about 2 ms of the exec measured here).

The pack holds every module of the packages the plugin's layer reaches (PACKED), compiled
by the launcher's interpreter (`write`, which `install-cni` runs with it). Each entry
keeps its source file's mtime and size and is used only while they still match, the
check Python makes of a `.pyc`: a package changed since (an upgrade that did not run
`install-cni`) is imported the usual way, module by module. A pack that is missing,
unreadable or of another interpreter is not used at all.

Standard library only, and only what a bare interpreter has loaded already: it runs
before anything else of the plugin.
"""

from __future__ import annotations

import marshal
import posix
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import CodeType, ModuleType

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
    """A finder and loader on `sys.meta_path` for the modules of one pack."""

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


def install(path: str) -> None:
    """Put the pack at `path` first on `sys.meta_path`; nothing when it cannot be used
    (missing, not whole, or of another interpreter)."""
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


def _compiled(source: bytes, origin: str) -> CodeType:
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


def write(package: str) -> str:
    """Compile the modules of PACKED under `package` (the `ipward` directory) with this
    interpreter into its pack, atomically (a file beside it, then a rename); returns the
    pack's path."""
    import os  # not on the plugin's path: `install-cni` runs this

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
                code = marshal.dumps(_compiled(f.read(), origin))
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
