"""`ipward demo`: the main job, shown for real on one machine.

A throwaway SQLite store, the plugin installed the way `ipward install-cni` installs it,
a pool made with the CLI, and N pods (network namespaces) attached concurrently by
Debian's `bridge` CNI plugin with `ipward` as its IPAM. Every address is read back from
inside its pod; every pod pings every other pod and the gateway (only the next pod and
the gateway when a full mesh would crowd the kernel's neighbour table, which all
namespaces share); the ledger is shown and checked; then every pod is torn down (one of
them twice: DEL is idempotent) and the pool must be empty again. Everything runs inside
namespaces made by :class:`NetLab`; the machine's own network namespace is compared
before and after.

Needs root (`ip netns add`), iproute2, ping and `containernetworking-plugins`.
Exit status: 0 success, 1 a step failed, 2 cannot run here, 130 interrupted.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from ipward_lab.netlab import (
    CNI_BIN_DIR,
    NETNS_DIR,
    CniOutcome,
    NetLab,
    NetLabError,
    Pod,
    bridge_network_config,
    root_namespace_state,
    skip_reason,
)

POOL = "demo"
NETWORK = "ipward-demo"
K8S_NAMESPACE = "demo"
IFNAME = "eth0"
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_PODS = 4
MAX_PODS = 32
LINKED_PLUGINS = ("bridge", "loopback")  # from Debian's CNI bin dir into ours
CLI_TIMEOUT = 120.0
PING_WORKERS = 8
LOG_TAIL = 15

EXIT_FAILED = 1
EXIT_CANNOT_RUN = 2
EXIT_INTERRUPTED = 130
NEIGH_GC_THRESH3 = "/proc/sys/net/ipv4/neigh/default/gc_thresh3"


def neighbour_limit() -> int:
    """The kernel's hard limit on its IPv4 neighbour (ARP) table. It is one table for all
    network namespaces together; past the limit, resolution fails everywhere, the machine's
    own traffic included ("neighbour: arp_cache: neighbor table overflow!")."""
    try:
        return int(Path(NEIGH_GC_THRESH3).read_text())
    except (OSError, ValueError):
        return 1024


class DemoFailed(Exception):
    """A step did not do what it must; the message names the step and what was seen."""


class Demo:
    """One run: state dir, store, plugin dir, pool, lab. Each step prints what it does."""

    def __init__(self, console: Console, state_dir: Path, subnet: str, pods: int) -> None:
        self.console = console
        self.state_dir = state_dir
        self.network = ipaddress.IPv4Network(subnet)
        self.gateway = str(self.network.network_address + 1)
        self.pod_count = pods
        self.store_url = f"sqlite://{state_dir / 'ipward.db'}"
        self.bin_dir = state_dir / "cni-bin"
        self.log_file = state_dir / "ipward.log"
        self.log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.lab: NetLab | None = None
        self.pods: list[Pod] = []
        self.addresses: dict[str, str] = {}  # pod.name -> "10.77.0.2/24"
        self.namespaces: list[str] = []  # every namespace the lab made
        self.step_no = 0
        self.pings = 0  # pings answered

    # -- output ----------------------------------------------------------------------

    def step(self, title: str) -> None:
        self.step_no += 1
        self.console.print()
        self.console.rule(f"[bold]Step {self.step_no}/6  {escape(title)}", align="left")

    def say(self, text: str) -> None:
        self.console.print(f"  {text}", markup=False)

    def good(self, text: str) -> None:
        self.console.print(f"  [green]ok[/]  {escape(text)}")

    def command(self, text: str) -> None:
        self.console.print(f"  [bold]$[/] {escape(text)}")

    def table(self, table: Table) -> None:
        self.console.print(Padding(table, (0, 0, 0, 4), expand=False))

    def block(self, text: str, indent: str = "    ") -> None:
        """Verbatim output of a command, indented; never wrapped or styled."""
        for line in text.rstrip("\n").splitlines():
            self.console.out(f"{indent}{line}", highlight=False)

    # -- the ipward CLI, as a person would run it ------------------------------------

    def ipward(
        self, *args: str, show: bool = True, expect: int | None = 0
    ) -> subprocess.CompletedProcess[str]:
        """Run `ipward --store URL ARGS` in a subprocess; fail unless it exits `expect`."""
        shown = f"ipward --store {self.store_url} {' '.join(args)}"
        if show:
            self.command(shown)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "ipward", "--store", self.store_url, *args],
                capture_output=True,
                text=True,
                timeout=CLI_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DemoFailed(f"`{shown}` did not finish in {CLI_TIMEOUT:g}s") from exc
        if show:
            self.block(proc.stdout)
        if expect is not None and proc.returncode != expect:
            raise DemoFailed(
                f"`{shown}` exited {proc.returncode} (expected {expect})\n"
                f"  stdout: {proc.stdout.strip()}\n  stderr: {proc.stderr.strip()}"
            )
        return proc

    def alloc_rows(self) -> list[dict[str, Any]]:
        proc = self.ipward("--json", "alloc", "list", "--pool", POOL, show=False)
        try:
            rows = json.loads(proc.stdout)
        except ValueError as exc:
            raise DemoFailed(
                f"`ipward --json alloc list` printed no JSON: {proc.stdout!r}"
            ) from exc
        if not isinstance(rows, list):
            raise DemoFailed(f"`ipward --json alloc list` printed {rows!r}, not a list")
        return rows

    # -- steps -----------------------------------------------------------------------

    def prepare(self, temporary: bool) -> None:
        self.step("State dir, SQLite store, CNI plugins")
        note = "temporary; removed at the end unless --keep" if temporary else "kept"
        self.say(f"state dir  {self.state_dir}  ({note})")
        self.say(f"store      {self.store_url}")
        self.say(f"plugin log {self.log_file}")
        db = self.state_dir / "ipward.db"
        if db.exists():
            raise DemoFailed(
                f"{db} exists already (an earlier run's store); give an empty --state-dir"
            )
        self.command(f"ipward install-cni --bin-dir {self.bin_dir}")
        cmd = [sys.executable, "-m", "ipward", "install-cni", "--bin-dir", str(self.bin_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False)
        self.block(proc.stdout)
        plugin = self.bin_dir / "ipward"
        if proc.returncode != 0 or not os.access(plugin, os.X_OK):
            raise DemoFailed(
                f"ipward install-cni exited {proc.returncode}, {plugin} not executable:"
                f" {proc.stderr.strip()}"
            )
        for name in LINKED_PLUGINS:
            source = Path(CNI_BIN_DIR) / name
            link = self.bin_dir / name
            if not os.access(source, os.X_OK):
                if name == "bridge":
                    raise DemoFailed(f"{source} is missing (containernetworking-plugins)")
                continue
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(source)
            self.say(f"linked     {link} -> {source}")
        self.say(f"CNI_PATH   {self.bin_dir}  ({', '.join(sorted(os.listdir(self.bin_dir)))})")

    def make_pool(self) -> None:
        self.step("A pool, made with the CLI")
        spec = f"{self.network},gateway={self.gateway}"
        self.ipward("pool", "create", POOL, "--range", spec)
        self.ipward("pool", "list")

    def network_config(self, lab: NetLab) -> dict[str, Any]:
        ipam = {
            "type": "ipward",
            "store": self.store_url,
            "pool": POOL,
            "logFile": str(self.log_file),
        }
        return bridge_network_config(NETWORK, lab.bridge, ipam)

    def cni(self, command: str, pod: Pod) -> CniOutcome:
        assert self.lab is not None
        conf = self.network_config(self.lab)
        return self.lab.cni(command, pod, IFNAME, conf, cni_path=[str(self.bin_dir)])

    def add_pods(self, lab: NetLab) -> None:
        self.step(f"{self.pod_count} pods, attached concurrently: bridge -> ipward")
        self.say(
            f"host netns {lab.host}  bridge {lab.bridge}  gateway {self.gateway}"
            "  (the machine's own namespace is never touched)"
        )
        self.say("network config given to bridge on stdin:")
        self.block(json.dumps(self.network_config(lab), indent=2), indent="      ")
        for i in range(self.pod_count):
            pod = lab.add_pod(f"pod-{i}", k8s_namespace=K8S_NAMESPACE)
            self.pods.append(pod)
            self.namespaces.append(pod.name)
            self.say(
                f"pod {K8S_NAMESPACE}/{pod.k8s_name}  netns {pod.name}"
                f"  container {pod.container_id[:12]}"
            )

        self.say(f"ADD x{self.pod_count}, all started at once (one thread each):")
        barrier = threading.Barrier(self.pod_count)

        def add(pod: Pod) -> tuple[CniOutcome, float]:
            barrier.wait(timeout=60)
            start = time.monotonic()
            outcome = self.cni("ADD", pod)
            return outcome, (time.monotonic() - start) * 1000

        started = time.monotonic()
        outcomes: dict[str, CniOutcome] = {}
        with ThreadPoolExecutor(max_workers=self.pod_count) as pool:
            futures = {pool.submit(add, pod): pod for pod in self.pods}
            for future in as_completed(futures):
                pod = futures[future]
                outcome, ms = future.result()
                outcomes[pod.name] = outcome
                shown = ", ".join(outcome.ips) if outcome.ok else "FAILED"
                self.say(f"  {pod.k8s_name:<8} {shown:<20} {ms:6.0f} ms")
        self.say(f"all {self.pod_count} ADDs done in {(time.monotonic() - started) * 1000:.0f} ms")
        failed = [o for o in outcomes.values() if not o.ok]
        if failed:
            raise DemoFailed(
                f"{len(failed)} of {self.pod_count} ADDs failed:\n"
                + "\n".join(o.describe() for o in failed)
            )

        first = outcomes[self.pods[0].name].result
        self.say(
            f"bridge's result for {self.pods[0].k8s_name} (ips: ipward's, interfaces: bridge's):"
        )
        self.block(json.dumps(first, separators=(", ", ": ")), indent="      ")
        self.say(f"{IFNAME} read back from inside each pod (ip addr) vs the CNI result:")
        table = Table("pod", "CNI result", f"{IFNAME} in the pod", "gateway", "match")
        problems = []
        for pod in self.pods:
            outcome = outcomes[pod.name]
            result = outcome.result or {}
            gateways = [str(ip.get("gateway", "-")) for ip in result.get("ips", [])]
            inside = lab.addresses(pod, IFNAME)
            match = inside == outcome.ips and len(inside) == 1
            table.add_row(
                pod.k8s_name,
                ", ".join(outcome.ips),
                ", ".join(inside) or "(none)",
                ", ".join(gateways),
                "[green]yes[/]" if match else "[red]NO[/]",
            )
            if not match:
                problems.append(f"{pod.k8s_name}: CNI said {outcome.ips}, {IFNAME} has {inside}")
                continue
            iface = ipaddress.IPv4Interface(inside[0])
            if iface.network != self.network or str(iface.ip) == self.gateway:
                problems.append(f"{pod.k8s_name}: {iface} is not a pod address of {self.network}")
            if gateways != [self.gateway]:
                problems.append(f"{pod.k8s_name}: gateway {gateways}, expected {self.gateway}")
            self.addresses[pod.name] = inside[0]
        self.table(table)
        if len(set(self.addresses.values())) != len(self.addresses):
            problems.append(f"duplicate addresses handed out: {sorted(self.addresses.values())}")
        if problems:
            raise DemoFailed("addresses are wrong:\n  " + "\n  ".join(problems))
        self.good(f"{self.pod_count} distinct addresses in {self.network}, each on its pod's eth0")

    def ping_all(self, lab: NetLab) -> None:
        n = len(self.pods)
        limit = neighbour_limit()
        mesh = n * (n + 1) <= limit // 4  # ARP entries in the pods; leave most of the table
        if mesh:
            self.step("Every pod pings every other pod and the gateway")
        else:
            self.step("Each pod pings the next pod and the gateway")
            self.say(
                f"(not a full mesh: {n} pods would take ~{n * (n + 1)} ARP entries of the"
                f" kernel's neighbour table, which all namespaces share (gc_thresh3 = {limit}))"
            )
        jobs: list[tuple[Pod, str, str]] = []  # (from, target name, target address)
        for i, src in enumerate(self.pods):
            peers = [p for p in self.pods if p is not src] if mesh else [self.pods[(i + 1) % n]]
            jobs += [(src, p.k8s_name, self.addresses[p.name]) for p in peers]
            jobs.append((src, "gateway", self.gateway))
        results: dict[tuple[str, str], bool] = {}
        with ThreadPoolExecutor(max_workers=PING_WORKERS) as pool:
            futures = {pool.submit(_ping, lab, src, addr): (src, name) for src, name, addr in jobs}
            for future in as_completed(futures):
                src, name = futures[future]
                results[(src.k8s_name, name)] = future.result()

        def cell(src: Pod, name: str) -> str:
            return "[green]ok[/]" if results[(src.k8s_name, name)] else "[red]FAIL[/]"

        if mesh:
            names = [p.k8s_name for p in self.pods] + ["gateway"]
            table = Table("from \\ to", *names)
            for src in self.pods:
                table.add_row(
                    src.k8s_name,
                    *("[dim]-[/]" if to == src.k8s_name else cell(src, to) for to in names),
                )
        else:
            table = Table("from", "to next pod", "", "to gateway")
            for i, src in enumerate(self.pods):
                peer = self.pods[(i + 1) % n]
                to = f"{peer.k8s_name} {self.addresses[peer.name].split('/')[0]}"
                table.add_row(src.k8s_name, to, cell(src, peer.k8s_name), cell(src, "gateway"))
        self.table(table)
        failed = sorted(f"{a} -> {b}" for (a, b), ok in results.items() if not ok)
        if failed:
            raise DemoFailed(f"{len(failed)} of {len(results)} pings failed: {', '.join(failed)}")
        self.pings = len(results)
        self.good(f"{len(results)} of {len(results)} pings answered")

    def show_ledger(self) -> None:
        self.step("The ledger: allocations, pool use, invariants")
        self.ipward("alloc", "list")
        rows = self.alloc_rows()
        by_ip = {row["ip"]: row for row in rows}
        problems = []
        for pod in self.pods:
            ip = self.addresses[pod.name].split("/")[0]
            row = by_ip.get(ip)
            if row is None:
                problems.append(f"{ip} of {pod.k8s_name} has no allocation record")
                continue
            want = (NETWORK, pod.container_id, IFNAME, K8S_NAMESPACE, pod.k8s_name, pod.k8s_uid)
            got = (
                row.get("network"),
                row.get("container"),
                row.get("ifname"),
                row.get("pod", {}).get("namespace"),
                row.get("pod", {}).get("name"),
                row.get("pod", {}).get("uid"),
            )
            if got != want:
                problems.append(f"{ip}: record says {got}, expected {want}")
        if len(rows) != len(self.pods):
            problems.append(f"{len(rows)} allocations recorded for {len(self.pods)} pods")
        if problems:
            raise DemoFailed("the ledger does not match the pods:\n  " + "\n  ".join(problems))
        self.good(
            f"one record per pod, keyed by (network, container ID, ifname), with the"
            f" pod's K8S_POD_* identity ({len(rows)} records)"
        )
        self.ipward("pool", "show", POOL)
        self.ipward("check")

    def teardown(self, lab: NetLab) -> None:
        self.step("Teardown: DEL every pod through bridge, then the pool must be empty")
        for i, pod in enumerate(self.pods):
            rounds = 2 if i == 0 else 1
            for attempt in range(rounds):
                outcome = self.cni("DEL", pod)
                again = " again (DEL is idempotent)" if attempt else ""
                if not outcome.ok:
                    raise DemoFailed(f"DEL{again} of {pod.k8s_name} failed:\n{outcome.describe()}")
                self.say(f"DEL {pod.k8s_name:<8}{again:<27} exit 0")
            left = lab.addresses(pod, IFNAME)
            if left:
                raise DemoFailed(f"{pod.k8s_name} still has {left} on {IFNAME} after DEL")
        self.good(f"{IFNAME} is gone from every pod")
        self.ipward("pool", "list")
        self.command(f"ipward --store {self.store_url} --json alloc list")
        rows = self.alloc_rows()
        self.block(json.dumps(rows))
        if rows:
            raise DemoFailed(f"allocations left after DEL of every pod: {rows}")
        self.good("no allocation left")
        self.ipward("check")

    def close_lab(self, lab: NetLab) -> None:
        lab.close()
        left = [n for n in self.namespaces if os.path.exists(os.path.join(NETNS_DIR, n))]
        if left:
            raise DemoFailed(f"namespaces still present after close: {left}")
        self.good(
            f"namespaces removed: {lab.host} and {len(self.pods)} pod namespaces"
            f" (prefix {lab.prefix}-{lab.suffix})"
        )

    def run(self, temporary: bool) -> None:
        root_before = root_namespace_state()
        self.prepare(temporary)
        self.make_pool()
        with NetLab(bridge_plugin=str(self.bin_dir / "bridge")) as lab:
            self.lab = lab
            self.namespaces.append(lab.host)
            self.add_pods(lab)
            self.ping_all(lab)
            self.show_ledger()
            self.teardown(lab)
            self.close_lab(lab)
        if root_namespace_state() != root_before:
            raise DemoFailed("the machine's own network namespace changed during the demo")
        self.good("the machine's own network namespace is as it was (links, addresses, forwarding)")

    def leftover_namespaces(self) -> list[str]:
        return [n for n in self.namespaces if os.path.exists(os.path.join(NETNS_DIR, n))]

    def log_problems(self) -> list[str]:
        """The plugin log's warning and error lines written by this run (the last few)."""
        try:
            with self.log_file.open("rb") as f:
                f.seek(self.log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if '"level":"info"' not in line][-LOG_TAIL:]


def _ping(lab: NetLab, pod: Pod, address: str) -> bool:
    """One echo request; on a miss, up to three more (a loaded machine can be slow to
    answer the first): a real break fails all of them."""
    return lab.ping(pod, address, count=1, wait=2) or lab.ping(pod, address, count=3, wait=2)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so the lab's namespaces are deleted on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous: Callable[[int, FrameType | None], Any] | int | None = signal.signal(
        signal.SIGTERM, handler
    )
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_subnet(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        network = ipaddress.IPv4Network(value, strict=True)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: an IPv4 CIDR is needed ({exc})") from exc
    pods = ctx.params.get("pods", DEFAULT_PODS)
    usable = network.num_addresses - 3  # network, broadcast, gateway
    if usable < pods:
        raise click.BadParameter(f"{value} has room for {max(usable, 0)} pods, not {pods}")
    return str(network)


@click.command("demo")
@click.option(
    "--pods",
    type=click.IntRange(2, MAX_PODS),
    default=DEFAULT_PODS,
    show_default=True,
    is_eager=True,
    help="How many pods (network namespaces) to attach.",
)
@click.option(
    "--subnet",
    default=DEFAULT_SUBNET,
    show_default=True,
    callback=_check_subnet,
    help="IPv4 subnet of the demo pool; its first address is the gateway (on the bridge).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the store, plugin dir and plugin log go (default: a fresh temp dir).",
)
@click.option("--keep", is_flag=True, help="Leave the temporary state dir in place.")
def demo_command(pods: int, subnet: str, state_dir: Path | None, keep: bool) -> None:
    """Show ipward at work on this machine: a pool on SQLite, pods attached by the real
    CNI bridge plugin with ipward as IPAM, concurrently; pings; ledger; teardown.

    Needs root: it makes network namespaces (all removed at the end; the machine's own
    network namespace is left alone)."""
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100)
    err = Console(
        stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 100
    )
    if os.geteuid() != 0:
        reason = "it needs root to create network namespaces (ip netns add); run it as root"
    else:
        reason = skip_reason() or ""
    if reason:
        err.print(f"[bold red]ipward demo cannot run here[/]: {escape(reason)}")
        sys.exit(EXIT_CANNOT_RUN)

    temporary = state_dir is None
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="ipward-demo-"))
    else:
        state_dir.mkdir(parents=True, exist_ok=True)
    state_dir = state_dir.resolve()
    demo = Demo(console, state_dir, subnet, pods)
    console.print(
        f"[bold]ipward demo[/]: {pods} pods on one machine; Debian's bridge CNI plugin with"
        f" ipward as its IPAM, on an embedded SQLite store"
    )
    started = time.monotonic()
    code = 0
    try:
        with _sigterm_as_interrupt():
            demo.run(temporary)
    except DemoFailed as exc:
        code = EXIT_FAILED
        err.print(f"\n[bold red]demo FAILED[/] in step {demo.step_no}: {escape(str(exc))}")
    except NetLabError as exc:
        code = EXIT_FAILED
        err.print(
            f"\n[bold red]demo FAILED[/] in step {demo.step_no} (namespaces): {escape(str(exc))}"
        )
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
        err.print(f"\n[bold yellow]interrupted[/] in step {demo.step_no}")
    except Exception:
        code = EXIT_FAILED
        err.print(f"\n[bold red]demo FAILED[/] in step {demo.step_no}: unexpected error")
        err.print_exception()
    finally:
        if code:
            problems = demo.log_problems() if code == EXIT_FAILED else []
            if problems:
                err.print(f"warnings and errors in the plugin log {demo.log_file}:")
                for line in problems:
                    err.out(f"  {line}", highlight=False)
            left = demo.leftover_namespaces()
            if left:
                err.print(f"[bold red]namespaces left behind[/]: {' '.join(left)}")
            elif demo.namespaces:
                err.print("the namespaces of this run were removed")
        if temporary and not keep:
            shutil.rmtree(state_dir, ignore_errors=True)
            if code == 0:
                console.print(f"  [green]ok[/]  state dir {state_dir} removed")
        elif code == 0 or state_dir.exists():
            (console if code == 0 else err).print(f"state dir kept: {state_dir}")
    if code:
        sys.exit(code)
    console.print(
        f"\n[bold green]demo OK[/]: {pods} pods attached, {demo.pings} pings answered,"
        f" every address freed, in {time.monotonic() - started:.1f}s"
    )


def main() -> None:
    demo_command(prog_name="ipward demo")


if __name__ == "__main__":
    main()
