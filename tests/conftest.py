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


# What a plugin run without a test's own directories writes into the machine: its notes
# (cni/notes.py NOTES_DIR: pass IPWARD_CNI_NOTES, tests/conftest.py plugin_notes) and,
# in-process, the default store (cni/config.py DEFAULT_STORE: give the config a store).
MACHINE_PATHS = (Path("/var/lib/cni/ipward"), Path("/var/lib/ipward"))
_machine_paths_before = {path for path in MACHINE_PATHS if path.exists()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A test that wrote into the machine's own ipward directories fails the run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for path in MACHINE_PATHS:
        if path.exists() and path not in _machine_paths_before:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            if reporter is not None:
                reporter.write_line(f"FAILED: a test's plugin wrote into the machine's {path}")


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
