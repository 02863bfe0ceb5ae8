"""Fixtures of both layers: a SQLite store in a temporary directory. The system layer's
(processes, servers) are in `system/conftest.py`; what modules import is in
`support.py`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from ipward.store import Store, open_store

# CI is a gate: the same examples every run. Local runs explore new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


MACHINE_NOTES = Path("/var/lib/cni/ipward")  # cni/notes.py NOTES_DIR
_machine_notes_before = MACHINE_NOTES.exists()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A plugin exec'd by a test without the run's notes directory writes into the
    machine's: the run fails, naming it."""
    if MACHINE_NOTES.exists() and not _machine_notes_before:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nA test's plugin wrote notes into the machine's {MACHINE_NOTES}: pass it")
        print("IPWARD_CNI_NOTES (tests/conftest.py plugin_notes)")


@pytest.fixture(autouse=True, scope="session")
def plugin_notes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where plugins exec'd by the tests keep their notes (docs/design.md 5.14): a
    directory of this run's, never the machine's /var/lib/cni/ipward. Every process
    the tests start inherits it; labs that start a runtime with an environment of its
    own pass it on."""
    notes = tmp_path_factory.mktemp("cni-notes")
    os.environ["IPWARD_CNI_NOTES"] = str(notes)
    return notes


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/ipward.db"


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[Store]:
    store = open_store(sqlite_url)
    yield store
    store.close()
