"""What the plugin's start path (`ipward.core.startpath`) relies on in the interpreter,
checked on every Python it may run on that this machine has: 3.11 and later for the
launcher (the code pack's bytecode and magic number, `_sqlite3` taking only
`functools.lru_cache`, `_json`'s scanner and encoder). A version the machine lacks is
skipped, saying how to get it; Debian's /usr/bin/python3 is one of them, pyenv's builds
the others."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ipward.core import startpath
from support import REPO
from test_codepack import add

SRC = REPO / "src"
LAUNCHER_VERSIONS = ((3, 11), (3, 12), (3, 13), (3, 14))  # the project's: 3.11 and later
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def find_python(version: tuple[int, int]) -> str | None:
    """An interpreter of `version` on this machine: the system's, else pyenv's newest."""
    name = "python{}.{}".format(*version)
    for directory in ("/usr/bin", "/usr/local/bin"):
        if os.access(f"{directory}/{name}", os.X_OK):
            return f"{directory}/{name}"
    builds = sorted(
        PYENV_VERSIONS.glob("{}.{}.*/bin/{}".format(*version, name)),
        key=lambda p: [int(n) if n.isdigit() else -1 for n in p.parts[-3].split(".")],
    )
    return str(builds[-1]) if builds and os.access(builds[-1], os.X_OK) else None


def pythons(versions: tuple[tuple[int, int], ...]) -> list:
    params = []
    for version in versions:
        dotted = "{}.{}".format(*version)
        found = find_python(version)
        why = (
            f"no Python {dotted} here (looked for /usr/bin/python{dotted}, /usr/local/bin/"
            f"python{dotted}, {PYENV_VERSIONS}/{dotted}.*): `pyenv install {dotted}`, or your"
            f" distribution's python{dotted} package"
        )
        marks = [] if found else [pytest.mark.skip(reason=why)]
        params.append(pytest.param(found, id=f"python{dotted}", marks=marks))
    return params


def run(python: str, program: str, *args: str) -> str:
    """`program` run by `python` as the plugin runs (-I -S; -B: the checkout gets no
    other version's bytecode); its stdout, after checking it exited 0."""
    argv = [python, "-I", "-S", "-B", "-c", program, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def version_of(python: str) -> tuple[int, int]:
    major, minor = run(python, "import sys;print(*sys.version_info[:2])").split()
    return int(major), int(minor)


# -- the launcher: its code pack, and _sqlite3 -----------------------------------------


@pytest.mark.parametrize("python", pythons(LAUNCHER_VERSIONS))
def test_the_code_pack_is_written_and_used_by_each_python(python: str, tmp_path: Path) -> None:
    """The pack is the bytecode of the interpreter that wrote it, under its magic number:
    that interpreter runs an in-process ADD with every module from it (and without
    `functools` where the store imports `_sqlite3` without it); one of another magic
    number does not use it, and answers all the same."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(SRC / "ipward", tmp_path / "pkg" / "ipward", ignore=skip)
    program = "import sys;sys.path.insert(0,sys.argv[1]);from ipward.core import startpath;" + (
        "print(startpath.write_pack(sys.argv[2]))"
    )
    package = tmp_path / "pkg" / "ipward"
    assert run(python, program, str(package.parent), str(package)).strip() == (
        startpath.pack_path(str(package))
    )

    added = add(package.parent, tmp_path / "s.db", python)
    assert added.answer["ips"][0]["address"] == "10.0.0.2/24", added  # .1 is the gateway
    assert {n for n, kind in added.loaders.items() if kind != "CodePack"} == {
        "ipward.core",
        "ipward.core.startpath",  # imported before the pack is installed
    }
    assert added.functools is (version_of(python) not in startpath.LRU_CACHE_ONLY)

    other = "/usr/bin/python3" if version_of(python) != version_of("/usr/bin/python3") else None
    if other is not None:  # another magic number: the pack is left alone
        again = add(package.parent, tmp_path / "s.db", other)
        assert "CodePack" not in again.loaders.values()
        assert again.answer["ips"][0]["address"] == "10.0.0.2/24"  # the same attachment


@pytest.mark.parametrize("python", pythons(LAUNCHER_VERSIONS))
def test_sqlite_takes_only_lru_cache_from_functools_on_each_python(
    python: str, tmp_path: Path
) -> None:
    """The store imports `_sqlite3` with a stand-in for `functools` (its lru_cache only)
    on the versions in `startpath.LRU_CACHE_ONLY`. Forced on this one: where it works,
    `functools` is not imported, a later `import functools` gets the real module, and
    the statement cache the stand-in built works past its size (evictions). It must work
    on exactly the versions listed (one that works and is not listed pays ~1.5 ms an
    exec for nothing)."""
    program = f"""
import sys
sys.path.insert(0, {str(SRC)!r})
from ipward.core import startpath
startpath.LRU_CACHE_ONLY = (sys.version_info[:2],)  # the stand-in, listed or not
try:
    startpath.load_sqlite3()
except Exception as e:
    print("fails:", type(e).__name__, e)
    raise SystemExit(0)
assert "functools" not in sys.modules, "functools imported"
from ipward.store.sqlite import SqliteStore
store = SqliteStore({str(tmp_path / "s.db")!r})
for n in range(300):  # distinct statements: more than the cache's 128
    assert store._conn.execute(f"SELECT {{n}}").fetchone() == (n,)
import functools
assert functools.reduce(lambda a, b: a + b, [1, 2, 3]) == 6
assert hasattr(functools, "partial") and functools.lru_cache(2)(abs)(-3) == 3
print("works")
"""
    outcome = run(python, program).strip()
    listed = version_of(python) in startpath.LRU_CACHE_ONLY
    assert (outcome == "works") is listed, f"{outcome}; listed in LRU_CACHE_ONLY: {listed}"


# -- JSON: _json's scanner and encoder -------------------------------------------------

# Parsed by `json_loads` and `json.loads` alike, and each value encoded by `json_dumps`
# as `json.dumps(separators=(",", ":"))` does.
DOCUMENTS = [
    '{"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "ipward", "ranges": [[{}]]}}',
    ' \n\t[1, -2, 3.5, 1e400, -0.0, true, false, null, "", "\\u00e9\\ud83d\\ude00"] \r\n',
    '{"b": 1, "a": {"z": [], "y": {}}, "é": "snowman ☃"}',
    '"plain"',
    "12345678901234567890123",
    "[NaN, Infinity, -Infinity]",
]
# Not one JSON document: ValueError (some worded by `json`, loaded for that).
MALFORMED = ["", "   ", "[1, 2", '{"a": 1} x', "[1,]", '{"a" 1}', "\x00"]


@pytest.mark.parametrize("python", pythons(LAUNCHER_VERSIONS))
def test_the_json_codec_answers_as_json_does_on_each_python(python: str) -> None:
    """`json_loads` and `json_dumps` drive `_json`'s scanner and encoder with the
    attributes and arguments `json` passes them: the same values and text as `json` for
    plain documents, and ValueError for malformed ones, without importing `json` on the
    way (it is imported to word an error only)."""
    program = f"""
import sys
sys.path.insert(0, {str(SRC)!r})
from ipward.core.startpath import json_dumps, json_loads
documents, malformed = {DOCUMENTS!a}, {MALFORMED!a}
values = [json_loads(d) for d in documents] + [json_loads(documents[0].encode())]
texts = [(json_dumps(v), json_dumps(v, sort_keys=True)) for v in values]
deep = "[" * 100000 + "]" * 100000
try:
    json_loads(deep)
    raise AssertionError("too deep, parsed")
except ValueError:
    pass
assert "json" not in sys.modules, "json imported on a valid document's path"
errors = []
for text in malformed:
    try:
        json_loads(text)
        errors.append(None)
    except ValueError:
        errors.append("ValueError")
import json, math
for d, v in zip(documents + [documents[0]], values):
    assert repr(v) == repr(json.loads(d)), (d, v)
for v, (compact, ordered) in zip(values, texts):
    assert compact == json.dumps(v, separators=(",", ":")), (v, compact)
    assert ordered == json.dumps(v, separators=(",", ":"), sort_keys=True), (v, ordered)
try:
    json_dumps({{"x": object()}})
    raise AssertionError("an object encoded")
except TypeError:
    pass
print(errors)
"""
    assert run(python, program) == f"{['ValueError'] * len(MALFORMED)}\n"
