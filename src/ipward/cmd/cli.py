"""`ipward`: the command line. Human tables by default, `--json` for scripts; the store
comes from `--store` or `IPWARD_STORE`. Errors are one line naming what is wrong, with
exit status 2 (1 is kept for `check` finding problems).

One module per group of commands, on one shared context (`cmd.context`): `cmd.pools`,
`cmd.allocations`, `cmd.maintenance`; the daemons in `cmd.agent` and `cmd.controller`;
`install-cni` here."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ipward.cmd import allocations, maintenance, pools
from ipward.cmd.agent import agent_command
from ipward.cmd.context import Context
from ipward.cmd.controller import controller_command
from ipward.cni.config import DEFAULT_STORE
from ipward.core import extensions
from ipward.core.errors import IpwardError
from ipward.store import StoreError


class IpwardGroup(click.Group):
    """Turns our errors into one clear line instead of a traceback. Also offers the commands
    other installed distributions declare (`extensions.COMMANDS`: the labs' demo, sim,
    bench); without them, they are simply not there."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *extensions.added(extensions.COMMANDS)})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None:
            entry = extensions.added(extensions.COMMANDS).get(name)
            command = entry.load() if entry is not None else None
        return command

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except IpwardError as e:
            click.echo(f"ipward: {e.msg}" + (f" ({e.details})" if e.details else ""), err=True)
            sys.exit(2)
        except StoreError as e:
            click.echo(f"ipward: store: {e}", err=True)
            sys.exit(2)


@click.group(cls=IpwardGroup)
@click.option(
    "--store",
    envvar="IPWARD_STORE",
    default=DEFAULT_STORE,
    show_default=True,
    help="Store URL: sqlite:///PATH or etcd://HOST:PORT[,HOST:PORT].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.version_option(package_name="ipward", prog_name="ipward", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, store: str, as_json: bool) -> None:
    """ipward: cluster-wide IP address management for container networks."""
    ctx.obj = Context(store, as_json)
    ctx.call_on_close(lambda: ctx.obj._store.close() if ctx.obj._store else None)


# -- install ----------------------------------------------------------------------------


@click.command("install-cni")
@click.option(
    "--bin-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="The runtime's CNI bin dir (e.g. /opt/cni/bin).",
)
@click.option("--name", default="ipward", show_default=True, help="Executable name.")
@click.option(
    "--standalone",
    is_flag=True,
    help="Write the native plugin, one static executable for a host without ipward (a"
    " Kubernetes node): it needs nothing of the host and forwards every call to the node"
    " agent.",
)
def install_cni(bin_dir: str, name: str, standalone: bool) -> None:
    """Install the plugin executable into a CNI bin dir."""
    from ipward.core import startpath

    target = Path(bin_dir) / name
    if not standalone:
        problem = startpath.write_launcher(target)
        if problem:
            click.echo(f"warning: {problem}", err=True)
    else:
        try:
            plugin = startpath.native_plugin()
        except startpath.PluginNotBuilt as e:
            click.echo(f"ipward: nothing installed: {e}", err=True)
            sys.exit(2)
        startpath.write_executable(target, plugin)
    click.echo(f"installed {target}")


for command in (
    pools.pool,
    allocations.alloc,
    allocations.release_command,
    maintenance.check_command,
    maintenance.gc_command,
    maintenance.status_command,
    maintenance.migrate_command,
    maintenance.export_command,
    maintenance.import_command,
    install_cni,
    agent_command,
    controller_command,
):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="ipward")
