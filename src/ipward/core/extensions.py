"""What other installed distributions add to the product, found through entry point
groups (the labs, `ipward-lab`, fill both; the product never imports them):

  * `ipward.commands`: `ipward` subcommands, `name = "module:click_command"`;
  * `ipward.liveness_sources`: liveness source URL schemes, `scheme = "module:opener"`,
    called as `opener(url, node=..., timeout=...)` and returning a `LivenessSource`.

Scanning the installed distributions costs milliseconds, so it happens only when a name
is not the product's own (or for `ipward --help`), once per process.
"""

from __future__ import annotations

import functools

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

COMMANDS = "ipward.commands"
LIVENESS_SOURCES = "ipward.liveness_sources"


@functools.cache
def added(group: str) -> dict[str, EntryPoint]:
    """The entry points of `group` by name; of two with one name, the first found wins."""
    from importlib.metadata import entry_points

    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=group):
        found.setdefault(entry.name, entry)
    return found
