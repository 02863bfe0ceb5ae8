"""Store backends behind one contract (see `base`). `open_store` picks one by URL:
`sqlite:///path/to/file.db` or `etcd://host:port[,host:port...]?ca=&cert=&key=&user=&password=`.
"""

from __future__ import annotations

from ipward.store.base import Store, StoreError, StoreUnavailable

__all__ = ["Store", "StoreError", "StoreUnavailable", "open_store"]


def open_store(url: str) -> Store:
    if url.startswith("sqlite://"):
        from ipward.store.sqlite import SqliteStore

        return SqliteStore.from_url(url)
    if url.startswith(("etcd://", "etcds://")):
        from ipward.store.etcd import EtcdStore

        return EtcdStore.from_url(url)
    raise StoreError(f"unknown store URL {url!r}: expected sqlite:///PATH or etcd://HOST:PORT")
