"""The design documents stay true to the tree: every `file:function` stop of
`docs/add-walk.md` (and of `docs/design.md`) names a function, class or constant that
exists, every module path they name exists, and every citation of the design in the
code, tests, labs and docs ("docs/design.md 5.3", "docs/design.md invariant 5") names a
section or invariant `docs/design.md` has. No process, no store: source text only."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from support import REPO

ROOT = REPO
DESIGN_DOC = ROOT / "docs" / "design.md"
WALK = ROOT / "docs" / "add-walk.md"
TOP_DIRS = ("src/", "lab/", "tests/", "docs/")

# `cni/plugin.py:main`, `ipam/ledger.py:Ledger.allocate`
STOP = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")
# `ipam/allocating.py`, `agent/`, `lab/src/ipward_lab/soak/`
PATH = re.compile(r"`((?:[\w.-]+/)+(?:[\w.-]+\.(?:py|md))?)`")
# Wrapped lines keep a citation whole: whitespace and comment marks may come between.
GAP = r"[\s#]+"
SECTIONS = re.compile(
    rf"docs/design\.md{GAP}(?:section{GAP})?(\d+(?:\.\d+)?(?:(?:,|{GAP}and){GAP}\d+(?:\.\d+)?)*)"
)
INVARIANTS = re.compile(rf"docs/design\.md{GAP}invariants?{GAP}(\d+(?:(?:,|{GAP}and){GAP}\d+)*)")
ANY_INVARIANT = re.compile(rf"(?i)\binvariants?{GAP}\d")
CITED_BEFORE = re.compile(rf"docs/design\.md{GAP}$")
# A document outside the repo (the brief, notes of the machine); not a search path for
# binaries (the cluster lab looks for Kubernetes binaries beside the checkout).
OUTSIDE = re.compile(r"\bDESIGN\b|shared/[\w.-]+\.md")


def resolve(path: str) -> Path:
    """A path as the documents write it: from the repository's root when it starts with
    a top directory, else under `src/ipward/`."""
    return ROOT / path if path.startswith(TOP_DIRS) else ROOT / "src" / "ipward" / path


@cache
def names_in(path: Path) -> frozenset[str]:
    """Top-level functions, classes and assignments of a module, and `Class.method`."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(f"{node.name}.{item.name}")
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def stop_problems(text: str) -> list[str]:
    problems = []
    for path, name in STOP.findall(text):
        module = resolve(path)
        if not module.is_file():
            problems.append(f"{path}:{name}: no file {module.relative_to(ROOT)}")
        elif name not in names_in(module):
            problems.append(f"{path}:{name}: {module.relative_to(ROOT)} defines no {name}")
    return problems


def path_problems(text: str) -> list[str]:
    """Modules and documents, and directories named from a top directory (a bare
    `free/` is a key prefix, not a directory)."""
    return [
        f"{path}: no such file or directory"
        for path in PATH.findall(text)
        if (path.endswith((".py", ".md")) or path.startswith(TOP_DIRS))
        and not resolve(path).exists()
    ]


def numbered() -> tuple[set[str], set[str]]:
    """The section numbers and the invariant numbers `docs/design.md` has."""
    sections, invariants, in_four = set(), set(), False
    for line in DESIGN_DOC.read_text().splitlines():
        heading = re.match(r"#{2,3} (\d+(?:\.\d+)?)\.? ", line)
        if heading:
            sections.add(heading.group(1))
            in_four = heading.group(1) == "4"
        elif in_four and (item := re.match(r"(\d+)\. \*\*", line)):
            invariants.add(item.group(1))
    return sections, invariants


def cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in ("src", "lab/src", "tests"):
        files += sorted((ROOT / top).rglob("*.py"))
    return [f for f in files if f != Path(__file__).resolve()]  # this one spells the rules


def numbers(group: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", group)


def test_every_stop_of_the_walk_names_a_real_function() -> None:
    text = WALK.read_text()
    assert len(STOP.findall(text)) >= 40, "the walk lost its stops"
    assert stop_problems(text) == []


def test_every_stop_and_module_the_design_names_exists() -> None:
    for doc in (DESIGN_DOC, WALK):
        text = doc.read_text()
        assert stop_problems(text) == [], doc.name
        assert path_problems(text) == [], doc.name


def test_a_stop_that_is_not_there_is_found() -> None:
    """The checker can fail: a made-up stop and a made-up module are reported."""
    assert stop_problems("`cni/plugin.py:no_such_function`")
    assert stop_problems("`ipam/ledger.py:Ledger.no_such_method`")
    assert stop_problems("`cni/no_such_module.py:main`")
    assert path_problems("`ipam/no_such_module.py`")
    assert not stop_problems("`ipam/ledger.py:Ledger.allocate` `core/policy.py:ADD_GRACE`")


def test_every_design_citation_names_a_section_or_invariant_it_has() -> None:
    sections, invariants = numbered()
    assert {"1", "2", "3", "4", "5", "6", "7", "5.1", "5.3", "5.5"} <= sections
    assert {str(n) for n in range(1, 10)} <= invariants
    problems = []
    for path in cited_files():
        text = path.read_text()
        where = path.relative_to(ROOT)
        for group in SECTIONS.findall(text):
            problems += [f"{where}: no section {n}" for n in numbers(group) if n not in sections]
        for group in INVARIANTS.findall(text):
            problems += [
                f"{where}: no invariant {n}" for n in numbers(group) if n not in invariants
            ]
        if path == DESIGN_DOC:
            continue
        for match in ANY_INVARIANT.finditer(text):
            if not CITED_BEFORE.search(text[: match.start()]):
                line = text.count("\n", 0, match.start()) + 1
                problems.append(f"{where}:{line}: cite it as 'docs/design.md invariant N'")
        for match in OUTSIDE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            problems.append(f"{where}:{line}: {match.group()} is outside the repository")
    assert problems == []
