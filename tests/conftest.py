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


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/ipward.db"


@pytest.fixture
def sqlite_store(sqlite_url: str) -> Iterator[Store]:
    store = open_store(sqlite_url)
    yield store
    store.close()
