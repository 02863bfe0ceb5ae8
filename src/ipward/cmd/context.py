"""What every `ipward` command shares: the context (the store URL and `--json`, given
before or after the command's name), the console, how output is emitted."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from ipward.core.errors import TryAgainLater
from ipward.ipam.ledger import Ledger
from ipward.store import Store, open_backend, open_store, store_location

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ipward.cluster.liveness import LivenessSource

# Scripts and CI pipe the output: give tables room instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 200)


class Context:
    def __init__(self, store_url: str, as_json: bool) -> None:
        self.store_url = store_url
        self.as_json = as_json
        self.create = False  # set by the commands that may make a store (pass_ctx_may_create)
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store, checked (ipward's, at this code's schema); made only by a command
        that may create it: any other finds "no store at ..." and creates nothing."""
        if self._store is None:
            self._store = open_store(self.store_url, create=self.create)
        return self._store

    def backend(self) -> Store:
        """The store without the schema check, for the commands that handle the schema
        themselves (`migrate`, `import`)."""
        if self._store is None:
            self._store = open_backend(self.store_url, create=self.create)
        return self._store

    @property
    def where(self) -> str:
        return store_location(self.store_url)

    def ledger(self) -> Ledger:
        return Ledger(self.store, node=os.uname().nodename)

    def emit(self, data: object, human: object) -> None:
        if self.as_json:
            click.echo(json.dumps(data, indent=2, sort_keys=True))
        else:
            console.print(human)


def _set_global(ctx: click.Context, param: click.Parameter, value: object) -> None:
    """A global option given after the command's name: it wins over one given before."""
    if value is not None and value is not False:
        setattr(ctx.find_object(Context), str(param.name), value)


def _uses_store(create: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Pass the Context to a command and give it the global options, so `ipward check
    --store URL` works as `ipward --store URL check` does (as etcdctl and kubectl take
    flags anywhere). Options on the command, rather than a group that moves words around
    before parsing: click parses them, `--help` lists them, and a command's own option
    of the same name (`sim --store KIND`) is never taken for the global one."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            c = click.get_current_context().find_object(Context)
            assert c is not None
            c.create = create
            return f(c, *args, **kwargs)

        run = click.option(
            "--store",
            "store_url",
            expose_value=False,
            callback=_set_global,
            help="Store URL (also before the command, or IPWARD_STORE).",
        )(run)
        return click.option(
            "--json",
            "as_json",
            is_flag=True,
            expose_value=False,
            callback=_set_global,
            help="Machine-readable output (also before the command).",
        )(run)

    return decorate


pass_ctx = _uses_store(create=False)
pass_ctx_may_create = _uses_store(create=True)


# The one-shot commands that read a liveness source (`gc`, `release --liveness`).
listed_timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds to wait for the liveness source's first complete list (k8s://: pods,"
    " nodes, namespaces, StatefulSets) before giving up: exit status 2, nothing changed.",
)


def open_listed_source(url: str, node: str, timeout: float) -> LivenessSource:
    """The liveness source of a one-shot command, once it answers from complete lists
    (`LivenessSource.wait_listed`): a command that asks once must not judge on caches
    still being filled, where everything reads "not listed yet". TryAgainLater (exit
    status 2) naming what could not be listed within `timeout` seconds."""
    from ipward.cluster.liveness import LivenessUnavailable, open_source

    source = open_source(url, node=node)
    try:
        source.wait_listed(timeout)
    except LivenessUnavailable as e:
        source.close()
        raise TryAgainLater(f"liveness source {url}: {e}; nothing changed") from e
    return source


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
