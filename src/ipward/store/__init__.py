"""Store backends behind one contract (see `base`). `open_store` picks one by URL,
`sqlite:///path/to/file.db` or `etcd://host:port[,host:port...]?ca=&cert=&key=&user=&password=`,
and checks that it holds a ledger this code may use (`ipward.store.schema`).
"""

from __future__ import annotations

from ipward.store.base import (
    Store,
    StoreDamaged,
    StoreError,
    StoreIncompatible,
    StoreMissing,
    StoreUnreachable,
)

__all__ = [
    "Store",
    "StoreDamaged",
    "StoreError",
    "StoreIncompatible",
    "StoreMissing",
    "StoreUnreachable",
    "open_backend",
    "open_store",
    "open_store_waiting",
    "refuse_damaged",
    "store_location",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from threading import Event


def store_location(url: str) -> str:
    """The URL without its options (which may hold a password): for messages."""
    return url.partition("?")[0]


def open_store(url: str, *, create: bool = True, short_lived: bool = False) -> Store:
    """The store at `url`, checked: ipward's, at the schema version this code knows, no
    import in progress (else StoreIncompatible). `create`: a store that is not there is
    made (file, tables, schema key); without it, StoreMissing and nothing is created.
    `short_lived`: this process commits a few times and exits without closing it (a
    plugin exec; see `SqliteStore`)."""
    from ipward.store import schema

    store = open_backend(url, create=create, short_lived=short_lived)
    try:
        schema.ensure(store, store_location(url), create=create)
    except BaseException:
        store.close()
        raise
    return store


def refuse_damaged(where: str, said: list[str]) -> None:
    """Raise StoreDamaged when the store at `where` reported damage (`said`: its
    `integrity_problems()`), naming what it said, how to see what it holds and how to
    move the ledger to a sound store."""
    if not said:
        return
    shown = "; ".join(said[:3]) + (f"; and {len(said) - 3} more" if len(said) > 3 else "")
    raise StoreDamaged(
        f"{where} is damaged ({shown}). Nothing is served from it or repaired in it: see"
        " what it holds with `ipward check`, then move the ledger to a sound store"
        " (`ipward export -o FILE`, `ipward --store NEW_URL import FILE`, `ipward --store"
        " NEW_URL check --remove-orphans`) or restore a backup made with `ipward export`,"
        " and start on that store (README: Damaged stores)"
    )


def open_store_waiting(url: str, stop: Event) -> Store | None:
    """`open_store` for the agent and the controller, which check the store before they
    serve: retried while the store cannot be reached (after 1 s, doubling up to 30 s,
    each wait logged), until `stop` is set (then None). A store that is not usable
    (StoreIncompatible) raises at once."""
    from ipward.core import log

    delay = 1.0
    while True:
        try:
            return open_store(url)
        except StoreUnreachable as e:
            log.warning(
                "store unreachable at start; waiting for it",
                store=store_location(url),
                error=str(e),
                retry_in=delay,
            )
            if stop.wait(delay):
                return None
            delay = min(2 * delay, 30.0)


def open_backend(url: str, *, create: bool = True, short_lived: bool = False) -> Store:
    """The backend at `url`, without the schema check: for the store's own tests and for
    the commands that handle the schema themselves (`migrate`, `import`)."""
    if url.startswith("sqlite://"):
        from ipward.store.sqlite import SqliteStore

        return SqliteStore.from_url(url, create=create, short_lived=short_lived)
    if url.startswith(("etcd://", "etcds://")):
        from ipward.store.etcd import EtcdStore

        return EtcdStore.from_url(url)
    if url.startswith("k8s://"):
        from ipward.store.kube import KubeStore

        return KubeStore(url, create=create)
    raise StoreError(
        f"unknown store URL {url!r}: expected sqlite:///PATH, etcd://HOST:PORT or k8s://"
    )
