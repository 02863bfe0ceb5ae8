"""A stateful model test of pools and networks (hypothesis `RuleBasedStateMachine`).

The machine drives the product only through its outer interfaces: the installed plugin
exec'd as a runtime does it, and the `ipward` CLI as a subprocess. It runs on SQLite (a
fresh file per example, the plugin running the ledger in-process) and on a real etcd
through a real agent (one etcd and one agent per run; each example has pool names,
network names and address ranges of its own). Next to the product runs a plain model:
pools (ranges, exclusions, gateways, earlier layouts, cooldown), the network configs a
runtime would hold, and which attachment holds which address.

Rules: create a pool (small ranges: /28 to /30, IPv6 /125 and /126, some dual stack,
some with `exclude`, start, end or no gateway), create one over an existing pool,
refuse a bad `pool create`, delete a pool, define a network (a named pool, a pool list,
an inline host-local or whereabouts config), change an inline network's ranges, ADD
(with or without a requested address, in `CNI_ARGS` or `runtimeConfig`), DEL (also
repeated and of unknown attachments), CHECK with the prevResult it got (or another's),
CNI GC with a valid-attachment list (`gcGrace` 0), STATUS, bad input, `check
--remove-orphans`, and concurrent pairs (two calls at once: ADD/ADD, ADD/DEL, DEL/DEL,
ADD/pool delete, ADD/GC, two overlapping creations, an inline ADD racing a creation).

What a call must answer comes from the model: code 0 with legal addresses (in the
pool's current ranges, not excluded, not the gateway, held by no one; the requested one
when requested; with a cooldown, no cooling address while another is free, and oldest
freed first), or one of the codes that apply (100 exhausted, 101 taken, 102 outside,
103 unknown pool, 7 overlap or two pools of one family, 3 CHECK, 50 STATUS, 4/6/7/1/107
bad input; the CLI's exit status 2). Where the address is the product's choice, the
model records what was given. A concurrent pair must match one serial order.

Invariants after every step: the allocations (`alloc list --json`) are exactly the
model's, no address is held twice, `ipward check --json` is clean; and a call the model
says writes nothing leaves the store's revision and every key as they were.

Findings the machine made are reproduced by the named regression tests at the end.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from ipward.store import Store, open_store
from ipward_lab import fleet
from ipward_lab.fleet import run_cli
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.waiting import wait_for
from support import PluginResult, exec_plugin

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Net4or6 = ipaddress.IPv4Network | ipaddress.IPv6Network
Att = tuple[str, str, str]  # network, container ID, ifname


def budget(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# Each step execs the plugin (~15-30 ms) and, after a write, the CLI twice (~0.3 s on
# SQLite, ~0.6 s on etcd): the default run stays within about a minute per backend.
SHORT, LONG = budget(4, 25), budget(40, 60)
# The long run (and its shrinking, after a failure) takes many minutes: past the
# suite's per-test timeout of 300 s, which stopped it half-way.
LONG_TIMEOUT = 3600

CONTAINERS = ("c0", "c1", "c2", "c3", "c4", "c5")
IFNAMES = ("eth0", "net1")
COOLDOWNS = (0, 3600)  # none, or longer than any run: cooling addresses are predictable
VERSIONS = ("0.4.0", "1.0.0", "1.1.0")
POOLS_PER_EXAMPLE, NETS_PER_EXAMPLE = 5, 4


# -- addresses and layouts -------------------------------------------------------------------


def first_host(net: Net4or6) -> IP:
    return net.network_address + 1


def last_host(net: Net4or6) -> IP:
    return net.broadcast_address - 1 if net.version == 4 else net.broadcast_address


@dataclass(frozen=True)
class Span:
    """One range of a pool: the addresses from start to end of a subnet, its gateway."""

    subnet: Net4or6
    start: IP
    end: IP
    gateway: IP | None

    @property
    def family(self) -> int:
        return self.subnet.version

    def addresses(self) -> Iterator[IP]:
        a = self.start
        while a <= self.end:
            yield a
            a += 1


@dataclass(frozen=True)
class Layout:
    """A pool's ranges (one span per family) and exclusions, as the README defines them:
    handed out is start..end less the gateway and the exclusions; covered (what no other
    pool may cover) is start..end less the exclusions, plus the gateway."""

    spans: tuple[Span, ...]
    exclude: tuple[str, ...] = ()

    @property
    def families(self) -> tuple[int, ...]:
        return tuple(s.family for s in self.spans)

    def excluded(self, a: IP) -> bool:
        return any(
            a in n for n in map(ipaddress.ip_network, self.exclude) if n.version == a.version
        )

    @cached_property
    def _usable(self) -> dict[int, frozenset[IP]]:
        return {
            s.family: frozenset(a for a in s.addresses() if a != s.gateway and not self.excluded(a))
            for s in self.spans
        }

    def usable(self, family: int) -> frozenset[IP]:
        return self._usable.get(family, frozenset())

    def holds(self, a: IP) -> bool:
        return a in self.usable(a.version)

    @cached_property
    def covers(self) -> frozenset[IP]:
        covered = {a for s in self.spans for a in s.addresses() if not self.excluded(a)}
        return frozenset(covered | {s.gateway for s in self.spans if s.gateway is not None})

    def span_of(self, a: IP) -> Span | None:
        return next((s for s in self.spans if s.family == a.version and a in s.subnet), None)

    def cli_args(self) -> list[str]:
        args = []
        for s in self.spans:
            parts = [str(s.subnet)]
            if s.start != first_host(s.subnet):
                parts.append(f"start={s.start}")
            if s.end != last_host(s.subnet):
                parts.append(f"end={s.end}")
            if s.gateway != first_host(s.subnet):
                parts.append(f"gateway={s.gateway or 'none'}")
            args += ["--range", ",".join(parts)]
        for x in self.exclude:
            args += ["--exclude", x]
        return args

    def inline(self, dialect: str) -> dict[str, Any]:
        """The `ipam` fields of a host-local (`ranges`) or whereabouts config."""
        ipam: dict[str, Any]
        if dialect == "ranges":
            sets = []
            for s in self.spans:
                r: dict[str, str] = {"subnet": str(s.subnet)}
                if s.start != first_host(s.subnet):
                    r["rangeStart"] = str(s.start)
                if s.end != last_host(s.subnet):
                    r["rangeEnd"] = str(s.end)
                if s.gateway != first_host(s.subnet):
                    assert s.gateway is not None  # host-local always has one
                    r["gateway"] = str(s.gateway)
                sets.append([r])
            ipam = {"ranges": sets}
        else:
            entries = []
            for s in self.spans:
                e = {"range": str(s.subnet)}
                if s.start != first_host(s.subnet):
                    e["range_start"] = str(s.start)
                if s.end != last_host(s.subnet):
                    e["range_end"] = str(s.end)
                if s.gateway is not None:
                    e["gateway"] = str(s.gateway)
                entries.append(e)
            ipam = dict(entries[0]) if len(entries) == 1 else {"ipRanges": entries}
        if self.exclude:
            ipam["exclude"] = list(self.exclude)
        return ipam


class Space:
    """An example's own addresses: the first 64 of an IPv4 /24 and the first 32 of an
    IPv6 /64, distinct for every example of a run."""

    def __init__(self, k: int) -> None:
        self.v4 = ipaddress.IPv4Network(f"10.{64 + k // 256 % 64}.{k % 256}.0/24")
        self.v6 = ipaddress.IPv6Network(f"fd00:0:{k % 65536:x}::/64")
        self.addresses: list[IP] = [
            *itertools.islice(self.v4, 64),
            *itertools.islice(self.v6, 32),
        ]


GATEWAYS = {  # the gateways a dialect can say: the subnet's first host, none, or another
    "cli": ("first", "none", "last"),
    "ranges": ("first", "last"),  # host-local always has one
    "whereabouts": ("none", "last"),  # whereabouts has no default
}


@st.composite
def layouts(draw: st.DrawFn, space: Space, dialect: str, part: int = 0, parts: int = 1) -> Layout:
    """Ranges in the example's space (in its `part` of `parts` equal parts)."""
    families = draw(st.sampled_from([(4,), (4,), (6,), (4, 6)]))
    spans = []
    for family in families:
        base, prefixes, room = (
            (space.v4, (28, 29, 29, 30), 64) if family == 4 else (space.v6, (125, 126), 32)
        )
        prefix = draw(st.sampled_from(prefixes))
        size = 2 ** (base.max_prefixlen - prefix)
        room //= parts
        offset = room * part + draw(st.integers(0, max(room // size, 1) - 1)) * size
        subnet = ipaddress.ip_network((base.network_address + offset, prefix))
        start, end = first_host(subnet), last_host(subnet)
        if size >= 8:  # room to narrow the range and keep addresses
            start += draw(st.sampled_from([0, 0, 1]))
            end -= draw(st.sampled_from([0, 0, 1]))
        gateway = {"first": first_host(subnet), "none": None, "last": last_host(subnet)}[
            draw(st.sampled_from(GATEWAYS[dialect]))
        ]
        spans.append(Span(subnet, start, end, gateway))
    exclude: tuple[str, ...] = ()
    kind = draw(st.sampled_from(["none", "none", "address", "pair"]))
    if kind != "none":
        span = draw(st.sampled_from(spans))
        a = draw(st.sampled_from(list(span.addresses())))
        bits = a.max_prefixlen - 1
        exclude = (str(a) if kind == "address" else str(ipaddress.ip_network((a, bits), False)),)
    return Layout(tuple(spans), exclude)


# -- the model ---------------------------------------------------------------------------------


@dataclass
class Pool:
    name: str
    source: str  # "cli", or "cni-config" for a network's inline ranges
    layout: Layout
    cooldown: int
    retired: list[Layout] = field(default_factory=list)  # earlier layouts (inline only)
    changed: bool = False  # its layout changed: its free-queue order is not predicted

    def holds(self, a: IP) -> bool:
        """May it hand the address out now (README: its current ranges only)."""
        return self.layout.holds(a)

    @property
    def covers(self) -> frozenset[IP]:
        return frozenset().union(*(lay.covers for lay in [self.layout, *self.retired]))


@dataclass(frozen=True)
class Net:
    """A network config as the runtime holds it (the store learns of it at ADD)."""

    name: str
    version: str
    pools: tuple[str, ...] = ()  # a named pool, or a pool list
    listed: bool = False  # a pool list as a JSON list rather than "a,b"
    dialect: str = ""  # inline: "ranges" (host-local) or "whereabouts"
    layout: Layout | None = None
    cooldown: int = 0

    def config(self, ipam: dict[str, Any], version: str | None = None) -> dict[str, Any]:
        section: dict[str, Any] = {"type": "ipward", **ipam}
        if self.layout is None:
            names = self.pools
            section["pool"] = list(names) if self.listed else ",".join(names)
        else:
            section.update(self.layout.inline(self.dialect), cooldown=self.cooldown)
        return {"cniVersion": version or self.version, "name": self.name, "ipam": section}


@dataclass
class Held:
    refs: tuple[tuple[str, IP], ...]  # (pool, address)
    answer: dict[str, Any]  # the ADD's result


class Mismatch(AssertionError):
    """The product answered what the model does not allow."""


@dataclass(frozen=True)
class Outcome:
    code: int  # 0, a CNI error code, or a CLI exit status
    answer: Any  # the JSON printed, if any
    text: str  # for messages

    def __str__(self) -> str:
        return f"code {self.code}: {self.text.strip()[-600:]}"


# What a call did to the store, as the model sees it.
WRITES = "writes"  # something changed
NOTHING = "nothing"  # no write at all: the same revision and keys
SAME_KEYS = "same-keys"  # every key as it was, though the revision may move


# -- calls: one product invocation each ----------------------------------------------------------


class Env:
    """One example's backend: where the plugin and the CLI go, its names and addresses."""

    def __init__(self, plugin: Path, url: str, ipam: dict[str, Any], store: Store, k: int):
        self.plugin = plugin
        self.url = url
        self.ipam = ipam
        self.store = store
        self.tag = f"x{k}"
        self.space = Space(k)
        self.pool_names = [f"{self.tag}p{i}" for i in range(POOLS_PER_EXAMPLE)]
        self.net_names = [f"{self.tag}n{i}" for i in range(NETS_PER_EXAMPLE)]
        self.names = {*self.pool_names, *self.net_names}  # an inline pool is its network's

    def revision(self) -> int:
        return self.store.revision()

    def snapshot(self) -> tuple[int, dict[str, bytes]]:
        """The revision and every key (less the agent's lease-held registration)."""
        kvs, revision = self.store.range("")
        return revision, {kv.key: kv.value for kv in kvs if not kv.key.startswith("nodes/")}


def plugin_outcome(result: PluginResult) -> Outcome:
    """A plugin answer: one JSON object on stdout (or nothing), never a traceback."""
    text = f"{result.stdout.decode(errors='replace')} {result.stderr.decode(errors='replace')}"
    assert b"Traceback" not in result.stdout, text
    if result.returncode == 0:
        return Outcome(0, result.json, text)
    assert result.returncode == 1, text
    error = result.json
    assert isinstance(error, dict) and isinstance(error.get("code"), int), text
    assert isinstance(error.get("msg"), str) and error["msg"], text
    return Outcome(error["code"], error, text)


def cli_outcome(*args: str, store: str) -> Outcome:
    proc = run_cli(*args, store=store)
    try:
        answer = json.loads(proc.stdout) if proc.stdout.strip() else None
    except ValueError:
        answer = None
    return Outcome(proc.returncode, answer, proc.stdout + proc.stderr)


def pod_args(container: str) -> str:
    return f"IgnoreUnknown=1;K8S_POD_NAMESPACE=model;K8S_POD_NAME=pod-{container}"


def exec_for(
    env: Env, command: str, stdin: Any, att: Att, args: str | None = None, **environ: str | None
) -> Outcome:
    """Exec the plugin for one attachment, with its pod's CNI_ARGS unless `args` is given."""
    args = pod_args(att[1]) if args is None else args
    return plugin_outcome(exec_plugin(env.plugin, command, stdin, *att[1:], args, env=environ))


@dataclass
class Add:
    net: Net
    att: Att
    requested: tuple[IP, ...] = ()
    via: str = "args"  # CNI_ARGS IP=, or runtimeConfig.ips

    def run(self, env: Env) -> Outcome:
        config = self.net.config(env.ipam)
        addresses = list(map(str, self.requested))
        if addresses and self.via == "args":
            args = f"{pod_args(self.att[1])};IP={','.join(addresses)}"
            return exec_for(env, "ADD", config, self.att, args)
        if addresses:
            config["runtimeConfig"] = {"ips": addresses}
        return exec_for(env, "ADD", config, self.att)


@dataclass
class Del:
    net: Net
    att: Att

    def run(self, env: Env) -> Outcome:
        return exec_for(env, "DEL", self.net.config(env.ipam), self.att)


@dataclass
class Check:
    net: Net
    att: Att
    prev: dict[str, Any]

    def run(self, env: Env) -> Outcome:
        config = {**self.net.config(env.ipam), "prevResult": self.prev}
        return exec_for(env, "CHECK", config, self.att)


@dataclass
class Gc:
    net: Net
    keep: tuple[tuple[str, str], ...]  # (container, ifname) the runtime lists as valid

    def run(self, env: Env) -> Outcome:
        config = self.net.config({**env.ipam, "gcGrace": 0}, version="1.1.0")
        config["cni.dev/valid-attachments"] = [
            {"containerID": c, "ifname": i} for c, i in self.keep
        ]
        return plugin_outcome(exec_plugin(env.plugin, "GC", config))


@dataclass
class Status:
    net: Net

    def run(self, env: Env) -> Outcome:
        config = self.net.config(env.ipam, version="1.1.0")
        return plugin_outcome(exec_plugin(env.plugin, "STATUS", config))


@dataclass
class Bad:
    """A call with one thing wrong: it must get `code` and change nothing (a DEL of a
    bad config: `Model.bad_delete`)."""

    label: str
    command: str
    net: Net
    att: Att
    code: int
    stdin: Callable[[dict[str, Any]], Any] | None = None  # the config, made bad
    environ: dict[str, str | None] = field(default_factory=dict)
    args: str | None = None

    def run(self, env: Env) -> Outcome:
        config = self.net.config(env.ipam)
        if self.command == "GC":
            config = self.net.config({**env.ipam, "gcGrace": 0}, version="1.1.0")
            config["cni.dev/valid-attachments"] = []
        stdin = self.stdin(config) if self.stdin else config
        return exec_for(env, self.command, stdin, self.att, self.args, **self.environ)


@dataclass
class CreatePool:
    name: str
    layout: Layout
    cooldown: int

    def run(self, env: Env) -> Outcome:
        args = ["pool", "create", self.name, *self.layout.cli_args()]
        return cli_outcome(*args, "--cooldown", str(self.cooldown), store=env.url)


@dataclass
class BadCreatePool:
    name: str
    args: tuple[str, ...]

    def run(self, env: Env) -> Outcome:
        return cli_outcome("pool", "create", self.name, *self.args, store=env.url)


@dataclass
class DeletePool:
    name: str

    def run(self, env: Env) -> Outcome:
        return cli_outcome("pool", "delete", self.name, store=env.url)


@dataclass
class RemoveOrphans:
    def run(self, env: Env) -> Outcome:
        return cli_outcome("check", "--remove-orphans", "--json", store=env.url)


Call = (
    Add | Del | Check | Gc | Status | Bad | CreatePool | BadCreatePool | DeletePool | RemoveOrphans
)


def with_field(path: tuple[str, ...], value: object) -> Callable[[dict[str, Any]], Any]:
    def bad(config: dict[str, Any]) -> dict[str, Any]:
        config = copy.deepcopy(config)
        node = config
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value
        return config

    return bad


def without(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda config: {k: v for k, v in config.items() if k != name}


def inline(subnet: str) -> Callable[[dict[str, Any]], Any]:
    def bad(config: dict[str, Any]) -> dict[str, Any]:
        ipam = {k: v for k, v in config["ipam"].items() if k in ("type", "store", "agentSocket")}
        return {**config, "ipam": {**ipam, "ranges": [[{"subnet": subnet}]]}}

    return bad


# (label, commands, code, stdin, environ, args): README "Error codes" and "Limits".
ALL = ("ADD", "DEL", "CHECK")
BAD_INPUTS: list[tuple[str, tuple[str, ...], int, Any, dict[str, str | None], str | None]] = [
    ("stdin not JSON", ALL, 6, lambda c: b"{", {}, None),
    ("empty stdin", ALL, 6, lambda c: b"", {}, None),
    ("a JSON list", ALL, 7, lambda c: b"[]", {}, None),
    ("no ipam", ALL, 7, without("ipam"), {}, None),
    ("no name", ALL, 7, without("name"), {}, None),
    ("cniVersion 9.9.9", ALL, 1, with_field(("cniVersion",), "9.9.9"), {}, None),
    ("pool a number", ALL, 7, with_field(("ipam", "pool"), 5), {}, None),
    ("subnet /33", ALL, 7, inline("10.1.0.0/33"), {}, None),
    ("subnet wider than /8", ALL, 7, inline("10.0.0.0/7"), {}, None),
    ("route gw of the other family", ALL, 7,
     with_field(("ipam", "routes"), [{"dst": "0.0.0.0/0", "gw": "fd00::1"}]), {}, None),
    ("config over 1 MiB", ALL, 107,
     with_field(("args",), {"pad": "x" * (1 << 20)}), {}, None),
    ("no CNI_CONTAINERID", ALL, 4, None, {"CNI_CONTAINERID": None}, None),
    ("container ID ..", ALL, 4, None, {"CNI_CONTAINERID": ".."}, None),
    ("ifname a/b", ALL, 4, None, {"CNI_IFNAME": "a/b"}, None),
    ("ifname of 16 bytes", ALL, 4, None, {"CNI_IFNAME": "e" * 16}, None),
    ("CNI_COMMAND FOO", ("ADD",), 4, None, {"CNI_COMMAND": "FOO"}, None),
    ("unknown CNI_ARGS key", ALL, 4, None, {}, "FOO=1"),
    ("namespace not a DNS label", ALL, 4, None, {},
     "IgnoreUnknown=1;K8S_POD_NAMESPACE=Bad_NS"),
    ("no CNI_NETNS", ("ADD", "CHECK"), 4, None, {"CNI_NETNS": None}, None),
    ("IP=banana", ("ADD",), 4, None, {}, "IgnoreUnknown=1;IP=banana"),
    ("two IPv4 in IP=", ("ADD",), 4, None, {}, "IgnoreUnknown=1;IP=10.1.0.2,10.1.0.3"),
    ("runtimeConfig.ips not an address", ("ADD",), 7,
     with_field(("runtimeConfig",), {"ips": ["banana"]}), {}, None),
    ("GC entry without ifname", ("GC",), 7,
     with_field(("cni.dev/valid-attachments",), [{"containerID": "c0"}]), {}, None),
    ("GC before cniVersion 1.1.0", ("GC",), 1, with_field(("cniVersion",), "1.0.0"), {}, None),
]  # fmt: skip

AT_ONCE = [
    "add-add", "add-add", "add-burst", "add-del", "del-del", "add-pool-delete", "add-gc",
    "create-create", "add-create",
]  # fmt: skip

# Bad configs that still name their network: a DEL of one frees the attachment.
NAMES_ITS_NETWORK = {
    "no ipam", "cniVersion 9.9.9", "pool a number", "subnet /33", "subnet wider than /8",
    "route gw of the other family",
}  # fmt: skip

# Requested addresses are read once the pools are chosen: an unknown pool answers first.
READ_AFTER_SELECTION = {"IP=banana", "two IPv4 in IP=", "runtimeConfig.ips not an address"}

BAD_POOL_CREATES: list[tuple[str, ...]] = [
    ("--range", "10.0.0.0/33"),
    ("--range", "banana"),
    ("--range", "{net},gateway=10.255.255.1"),  # outside the subnet
    ("--range", "{net}", "--exclude", "banana"),
    ("--range", "{net}", "--cooldown", "-1"),
    ("--range", "{net},start={last},end={first}"),  # no address between start and end
]


class Model:
    """Who holds which address, as the README says it must be."""

    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {}
        self.nets: dict[str, Net] = {}
        self.attachments: dict[Att, Held] = {}
        self.freed: dict[str, dict[IP, int]] = {}  # pool -> address -> step it was freed
        self.step = 0

    def holder(self, a: IP) -> Att | None:
        return next((att for att, h in self.attachments.items() if a in self.of(h)), None)

    @staticmethod
    def of(held: Held) -> set[IP]:
        return {a for _, a in held.refs}

    def held(self) -> set[IP]:
        return {a for h in self.attachments.values() for _, a in h.refs}

    def records(self) -> dict[tuple[str, str], Att]:
        """What `alloc list` must show: (pool, address) -> attachment."""
        return {(p, str(a)): att for att, h in self.attachments.items() for p, a in h.refs}

    def in_pool(self, name: str) -> bool:
        return any(p == name for h in self.attachments.values() for p, _ in h.refs)

    # -- ADD -------------------------------------------------------------------------------

    def inline_pool(self, net: Net) -> Pool:
        """The pool an inline config stands for: the stored one's next version when its
        ranges changed (the earlier layout retired), else the same."""
        assert net.layout is not None
        pool = Pool(net.name, "cni-config", net.layout, net.cooldown)
        stored = self.pools.get(net.name)
        if stored is not None and stored.source == "cni-config":
            pool.retired = list(stored.retired)
            pool.changed = stored.changed
            if stored.layout != net.layout:
                pool.retired.append(stored.layout)
                pool.changed = True
        return pool

    def select(self, call: Add) -> list[Pool] | int:
        """The pools an ADD allocates from, or the code that refuses it (README, "Pool
        selection": a requested address goes to the chosen pools if they hold it, else
        to the pool that does; a list holds one pool per family)."""
        net = call.net
        if net.layout is not None:
            chosen = [self.inline_pool(net)]
        else:
            if any(n not in self.pools for n in net.pools):
                return 103
            chosen = [self.pools[n] for n in net.pools]
        wanted = call.requested
        if wanted and not all(any(p.holds(a) for p in chosen) for a in wanted):
            # A chosen pool's stored spec may be its earlier version: not another pool.
            names = {p.name for p in chosen}
            others = [self.pools[n] for n in sorted(self.pools) if n not in names]
            found: list[Pool] = []
            for a in wanted:
                pool = next((p for p in [*chosen, *others] if p.holds(a)), None)
                if pool is None:
                    return 102
                if all(p.name != pool.name for p in found):
                    found.append(pool)
            chosen = found
        families = [f for p in chosen for f in p.layout.families]
        if len(families) != len(set(families)):
            return 7
        return chosen

    def add(self, call: Add, outcome: Outcome) -> str:
        held = self.attachments.get(call.att)
        if held is not None:  # docs/design.md invariant 4: the same addresses, nothing written
            if outcome.code != 0 or outcome.answer.get("ips") != held.answer.get("ips"):
                raise Mismatch(f"a repeated ADD must answer {held.answer}, not {outcome}")
            return NOTHING
        chosen = self.select(call)
        if isinstance(chosen, int):
            return self.refused(outcome, {chosen})
        refusals = set()
        for pool in chosen:
            if pool.name == call.net.name and call.net.layout is not None:
                stored = self.pools.get(pool.name)
                if stored is not None and stored.source == "cli":
                    refusals.add(7)  # a network named like a pool made with the CLI
                elif any(
                    pool.covers & p.covers for p in self.pools.values() if p.name != pool.name
                ):
                    refusals.add(7)  # its ranges would overlap another pool's
        taken = self.held()
        for pool in chosen:
            for family in pool.layout.families:
                wanted = [a for a in call.requested if a.version == family and pool.holds(a)]
                if wanted and wanted[0] in taken:
                    refusals.add(101)
                if not wanted and not pool.layout.usable(family) - taken:
                    refusals.add(100)
        if refusals:
            return self.refused(outcome, refusals)
        if outcome.code != 0:
            raise Mismatch(f"ADD must succeed from {[p.name for p in chosen]}, got {outcome}")
        refs = self.given(call, chosen, outcome)
        self.attachments[call.att] = Held(refs, outcome.answer)
        for pool in chosen:
            if pool.source == "cni-config" and pool.name == call.net.name:
                self.pools[pool.name] = pool  # stored (or changed) by this ADD
        for name, a in refs:
            self.freed.get(name, {}).pop(a, None)
        return WRITES

    def given(self, call: Add, chosen: list[Pool], outcome: Outcome) -> tuple[tuple[str, IP], ...]:
        """Check each address of a successful ADD: one per pool and family, in that
        pool's current ranges, held by no one, the requested one if any, with its
        subnet's prefix and its range's gateway, and chosen as the cooldown allows."""
        if outcome.answer.get("cniVersion") != call.net.version:
            raise Mismatch(f"answer in the wrong cniVersion: {outcome}")
        wanted = [(p, f) for p in chosen for f in p.layout.families]
        entries = outcome.answer.get("ips", [])
        if len(entries) != len(wanted):
            raise Mismatch(f"ADD must give {len(wanted)} addresses, gave {outcome}")
        refs = []
        taken = self.held()
        for entry in entries:
            iface = ipaddress.ip_interface(entry["address"])
            a = iface.ip
            matches = [(p, f) for p, f in wanted if f == a.version and p.holds(a)]
            if len(matches) != 1:
                raise Mismatch(f"{a} is in none of the pools it may come from: {outcome}")
            wanted.remove(matches[0])
            pool = matches[0][0]
            span = pool.layout.span_of(a)
            assert span is not None
            gateway = str(span.gateway) if span.gateway else None
            if iface.network.prefixlen != span.subnet.prefixlen or entry.get("gateway") != gateway:
                raise Mismatch(f"{entry} must have /{span.subnet.prefixlen}, gateway {gateway}")
            if a in taken:
                raise Mismatch(f"{a} handed out while {self.holder(a)} holds it")
            requested = [r for r in call.requested if r.version == a.version and pool.holds(r)]
            if requested and a != requested[0]:
                raise Mismatch(f"requested {requested[0]}, got {a}")
            if not requested:
                self.chosen_as_cooldown_allows(pool, a)
            refs.append((pool.name, a))
        return tuple(refs)

    def chosen_as_cooldown_allows(self, pool: Pool, a: IP) -> None:
        """docs/design.md invariant 9: with a cooldown, a freed address only when no
        other is free. Freed addresses go oldest first, with or without a cooldown (not
        predicted once the pool's ranges changed; one freed by a call running at the
        same time may not be seen yet)."""
        free = pool.layout.usable(a.version) - self.held()
        freed = {x: t for x, t in self.freed.get(pool.name, {}).items() if x in free}
        if pool.cooldown and free - set(freed) and a in freed:
            raise Mismatch(f"{a} still cooling in {pool.name}, while {free - set(freed)} are free")
        earlier = {x: t for x, t in freed.items() if t < self.step}
        if not earlier or pool.changed or (pool.cooldown and free - set(freed)):
            return
        if earlier.get(a) != min(earlier.values()):
            raise Mismatch(f"{a}, not the oldest freed of {pool.name}: {freed}")

    def refused(self, outcome: Outcome, codes: set[int]) -> str:
        if outcome.code not in codes:
            raise Mismatch(f"must be refused with one of {sorted(codes)}, got {outcome}")
        return NOTHING

    # -- DEL, CHECK, GC, STATUS --------------------------------------------------------------

    def release(self, att: Att) -> None:
        held = self.attachments.pop(att)
        for name, a in held.refs:
            self.freed.setdefault(name, {})[a] = self.step

    def delete(self, call: Del, outcome: Outcome) -> str:
        if outcome.code != 0:
            raise Mismatch(f"DEL must succeed, got {outcome}")
        if call.att not in self.attachments:
            return NOTHING  # docs/design.md invariant 4: an unknown or repeated DEL changes nothing
        self.release(call.att)
        return WRITES

    def bad_delete(self, call: Bad, outcome: Outcome) -> str:
        """A DEL of a config that fails its checks succeeds (docs/design.md 5.14): what
        the attachment holds is freed by its identity when the config still names its
        network; nothing when it names none."""
        if outcome.code != 0:
            raise Mismatch(f"a DEL of a bad config must succeed, got {outcome}")
        if call.label not in NAMES_ITS_NETWORK or call.att not in self.attachments:
            return NOTHING
        self.release(call.att)
        return WRITES

    def check(self, call: Check, outcome: Outcome) -> str:
        held = self.attachments.get(call.att)
        prev = {ipaddress.ip_interface(e["address"]).ip for e in call.prev.get("ips", [])}
        mine = {a for _, a in held.refs} if held else set()
        if held and prev <= mine:
            if outcome.code != 0:
                raise Mismatch(f"CHECK must pass, got {outcome}")
            return NOTHING
        return self.refused(outcome, {3})

    def gc(self, call: Gc, outcome: Outcome) -> str:
        if outcome.code != 0:
            raise Mismatch(f"GC must succeed, got {outcome}")
        gone = [
            att for att in self.attachments if att[0] == call.net.name and att[1:] not in call.keep
        ]
        for att in gone:
            self.release(att)
        return WRITES if gone else NOTHING

    def status(self, call: Status, outcome: Outcome) -> str:
        if all(n in self.pools for n in call.net.pools):
            if outcome.code != 0:
                raise Mismatch(f"STATUS must pass, got {outcome}")
            return NOTHING
        return self.refused(outcome, {50})

    # -- the CLI ---------------------------------------------------------------------------

    def create_pool(self, call: CreatePool, outcome: Outcome) -> str:
        if call.name in self.pools or any(
            call.layout.covers & p.covers for p in self.pools.values()
        ):
            return self.refused(outcome, {2})
        if outcome.code != 0:
            raise Mismatch(f"pool create must succeed, got {outcome}")
        self.pools[call.name] = Pool(call.name, "cli", call.layout, call.cooldown)
        self.freed.pop(call.name, None)
        return WRITES

    def delete_pool(self, call: DeletePool, outcome: Outcome) -> str:
        if call.name not in self.pools:
            return self.refused(outcome, {2})
        if self.in_pool(call.name):
            self.refused(outcome, {2})
            return SAME_KEYS  # marked deleting, then put back
        if outcome.code != 0:
            raise Mismatch(f"pool delete of an empty pool must succeed, got {outcome}")
        del self.pools[call.name]
        self.freed.pop(call.name, None)
        return WRITES

    def remove_orphans(self, call: RemoveOrphans, outcome: Outcome) -> str:
        """Prunes each earlier layout that no record needs: one holding an address its
        pool's current ranges do not."""
        if outcome.code != 0:
            raise Mismatch(f"check --remove-orphans must find nothing left, got {outcome}")
        for pool in self.pools.values():
            addresses = [a for name, a in self.records_of(pool.name) if not pool.holds(a)]
            pool.retired = [lay for lay in pool.retired if any(lay.holds(a) for a in addresses)]
        return WRITES

    def records_of(self, name: str) -> list[tuple[str, IP]]:
        return [(p, a) for h in self.attachments.values() for p, a in h.refs if p == name]

    def apply(self, call: Call, outcome: Outcome) -> str:
        """Judge the call's outcome and take its effect; what it did to the store."""
        if isinstance(call, Add):
            return self.add(call, outcome)
        if isinstance(call, Del):
            return self.delete(call, outcome)
        if isinstance(call, Check):
            return self.check(call, outcome)
        if isinstance(call, Gc):
            return self.gc(call, outcome)
        if isinstance(call, Status):
            return self.status(call, outcome)
        if isinstance(call, Bad):
            if call.command == "DEL" and call.code != 4:
                return self.bad_delete(call, outcome)
            missing = any(n not in self.pools for n in call.net.pools)
            late = call.label in READ_AFTER_SELECTION and missing
            return self.refused(outcome, {call.code, 103} if late else {call.code})
        if isinstance(call, BadCreatePool):
            return self.refused(outcome, {2})
        if isinstance(call, CreatePool):
            return self.create_pool(call, outcome)
        if isinstance(call, DeletePool):
            return self.delete_pool(call, outcome)
        return self.remove_orphans(call, outcome)

    def serial_orders(
        self, calls: list[Call], outcomes: list[Outcome]
    ) -> list[tuple[Model, set[str]]]:
        """The models after calls that ran at once, with what the calls did to the
        store, one per serial order that explains every outcome (at least one must)."""
        found, why = [], []
        for order in itertools.permutations(range(len(calls))):
            model = copy.deepcopy(self)
            try:
                effects = {model.apply(calls[i], outcomes[i]) for i in order}
            except Mismatch as e:
                why.append(f"order {order}: {e}")
                continue
            found.append((model, effects))
        if not found and self.refused_delete_failed_add(calls, outcomes):
            found.append((self, {SAME_KEYS}))
        if not found:
            raise Mismatch(
                f"no serial order explains {list(zip(calls, outcomes, strict=True))}: {why}"
            )
        return found

    def refused_delete_failed_add(self, calls: list[Call], outcomes: list[Outcome]) -> bool:
        """README, `pool delete`: the pool is marked deleting first ("ADDs in flight fail,
        new ones get 103"), then checked for allocations and put back. So an ADD at that
        moment gets 103 from a pool whose delete is refused: no serial order, nothing
        changed."""
        if len(calls) != 2:
            return False
        add, delete = calls if isinstance(calls[0], Add) else calls[::-1]
        add_out, del_out = outcomes if isinstance(calls[0], Add) else outcomes[::-1]
        if not (isinstance(add, Add) and isinstance(delete, DeletePool)):
            return False
        pools = [add.net.name] if add.net.layout is not None else list(add.net.pools)
        return (
            add_out.code == 103
            and del_out.code == 2
            and delete.name in pools
            and self.in_pool(delete.name)
            and add.att not in self.attachments
        )


# -- the machine ----------------------------------------------------------------------------------


class Backend:
    """Makes an `Env` for each example."""

    def example(self) -> Env:
        raise NotImplementedError

    def done(self, env: Env) -> None:
        pass


EXAMPLES = itertools.count(1)


class SqliteBackend(Backend):
    def __init__(self, plugin: Path, root: Path) -> None:
        self.plugin, self.root = plugin, root

    def example(self) -> Env:
        k = next(EXAMPLES)
        url = f"sqlite://{self.root}/example-{k}.db"
        return Env(self.plugin, url, {"store": url}, open_store(url), k)

    def done(self, env: Env) -> None:
        env.store.close()


class AgentBackend(Backend):
    """One etcd and one agent for the run; the plugin forwards to the agent."""

    def __init__(self, plugin: Path, url: str, socket: Path, store: Store) -> None:
        self.plugin, self.url, self.socket, self.store = plugin, url, socket, store

    def example(self) -> Env:
        ipam = {"agentSocket": str(self.socket)}
        return Env(self.plugin, self.url, ipam, self.store, next(EXAMPLES))


class ModelMachine(RuleBasedStateMachine):
    backend: Backend  # set by `machine_on`

    def __init__(self) -> None:
        super().__init__()
        self.env = self.backend.example()
        self.model = Model()
        self.answers: dict[Att, dict[str, Any]] = {}  # every ADD result, kept after DEL
        self.verified: int | None = None  # the revision the invariants last held at

    def teardown(self) -> None:
        self.backend.done(self.env)

    # -- running calls ----------------------------------------------------------------------

    def do(self, call: Call) -> None:
        self.model.step += 1
        before = self.env.snapshot()
        outcome = call.run(self.env)
        event(f"{type(call).__name__} -> {outcome.code}")
        effect = self.model.apply(call, outcome)
        if isinstance(call, Add) and outcome.code == 0:
            self.answers[call.att] = outcome.answer
        self.unchanged(before, {effect}, f"{call} -> {outcome}")

    def unchanged(self, before: tuple[int, dict[str, bytes]], effects: set[str], what: str) -> None:
        """Calls the model says write nothing left every key (and the revision) alone."""
        if WRITES in effects:
            return
        revision, keys = self.env.snapshot()
        assert keys == before[1], f"{what} changed the store"
        assert SAME_KEYS in effects or revision == before[0], f"{what} wrote to the store"

    def do_at_once(self, calls: list[Call]) -> None:
        self.model.step += 1
        before = self.env.snapshot()
        barrier = threading.Barrier(len(calls))

        def run(call: Call) -> Outcome:
            barrier.wait()
            return call.run(self.env)

        with ThreadPoolExecutor(len(calls)) as threads:
            outcomes = list(threads.map(run, calls))
        event(
            "at once -> "
            + " ".join(f"{type(c).__name__} {o.code}" for c, o in zip(calls, outcomes, strict=True))
        )
        candidates = self.model.serial_orders(calls, outcomes)
        if len({frozenset(m.records().items()) for m, _ in candidates}) > 1:
            # Answers alike in more than one order (an ADD and a DEL of one attachment
            # both succeed): the store says which.
            stored = self.stored_records()
            candidates = [(m, e) for m, e in candidates if m.records() == stored]
            assert candidates, f"no serial order of {calls} leaves {stored}"
        self.model, effects = candidates[0]
        self.unchanged(before, effects, f"{calls} -> {outcomes}")
        for call, outcome in zip(calls, outcomes, strict=True):
            if isinstance(call, Add) and outcome.code == 0:
                self.answers[call.att] = outcome.answer

    # -- drawing calls from the model's state --------------------------------------------------
    # The model's state depends on the product's answers, and calls at once may answer
    # differently when hypothesis replays an example: so every rule draws the same
    # choices whatever the state (`pick` maps a drawn index onto what there is).

    def draw_net(self, data: st.DataObject) -> Net:
        return self.model.nets[pick(data, sorted(self.model.nets), "network")]

    def draw_att(self, data: st.DataObject, net: Net, fresh: bool = False) -> Att:
        """One of the network's attachments, or (`fresh`, or by chance) any."""
        held = data.draw(st.booleans(), "an attachment it has")
        mine = sorted(a for a in self.model.attachments if a[0] == net.name)
        one = pick(data, mine, "attachment")
        container = data.draw(st.sampled_from(CONTAINERS), "container")
        ifname = data.draw(st.sampled_from(IFNAMES), "ifname")
        return one if one and held and not fresh else (net.name, container, ifname)

    def draw_requested(self, data: st.DataObject) -> tuple[tuple[IP, ...], str]:
        """One or two addresses (one per family): in or near a pool or a network's
        ranges (free, taken, the gateway, excluded), or anywhere in the example's space."""
        near = sorted({a for p in self.model.pools.values() for a in p.covers}, key=str)
        near += [a for n in self.model.nets.values() if n.layout for a in n.layout.covers]
        anywhere = self.env.space.addresses
        is_near = data.draw(st.booleans(), "near a pool?")
        near_one, any_one = pick(data, near, "near a pool"), pick(data, anywhere, "anywhere")
        first = near_one if near_one and is_near else any_one
        other = [a for a in [*near, *anywhere] if a.version != first.version]
        second = pick(data, other, "of the other family")
        requested = (first, second) if data.draw(st.booleans(), "both families") else (first,)
        return requested, data.draw(st.sampled_from(["args", "runtimeConfig"]), "via")

    def draw_add(self, data: st.DataObject, net: Net | None = None, requested: bool = False) -> Add:
        net = net or self.draw_net(data)
        att = self.draw_att(data, net)
        addresses, via = self.draw_requested(data)
        if requested or data.draw(st.integers(0, 3), "requested?") == 0:
            return Add(net, att, addresses, via)
        return Add(net, att)

    def draw_del(self, data: st.DataObject) -> Del:
        """A held attachment mostly; else one DEL'd before (a repeated DEL) or any."""
        which = data.draw(st.integers(0, 4), "held, DEL'd before or any")
        held = pick(data, sorted(self.model.attachments), "held")
        before = pick(data, sorted(self.answers), "DEL'd before")
        att = self.draw_att(data, self.draw_net(data), fresh=True)
        att = (held if which > 1 else before if which == 1 else None) or att
        return Del(self.model.nets[att[0]], att)

    def draw_pool_name(self, data: st.DataObject, other_than: str = "") -> str:
        """Mostly a pool that exists."""
        existing = data.draw(st.integers(0, 3), "an existing pool?") > 0
        one = pick(data, [n for n in sorted(self.model.pools) if n != other_than], "pool")
        any_name = pick(data, [n for n in self.env.pool_names if n != other_than], "name")
        return one if one and existing else any_name

    def draw_create(self, data: st.DataObject, part: int | None = None) -> CreatePool:
        """A pool creation; with `part`, in that half of the space, under a new name."""
        free = [n for n in self.env.pool_names if n not in self.model.pools]
        name = pick(data, free if part is not None and free else self.env.pool_names, "pool")
        where = {} if part is None else {"part": part, "parts": 2}
        layout = data.draw(layouts(self.env.space, "cli", **where), "layout")
        return CreatePool(name, layout, data.draw(st.sampled_from(COOLDOWNS), "cooldown"))

    def draw_overlapping(self, data: st.DataObject, layout: Layout) -> CreatePool:
        """A creation over `layout`'s ranges, under a name not taken if there is one."""
        free = [n for n in self.env.pool_names if n not in self.model.pools]
        return CreatePool(pick(data, free or self.env.pool_names, "pool"), Layout(layout.spans), 0)

    # -- rules --------------------------------------------------------------------------------
    # Few rules, each drawing what it does: hypothesis enables a random subset of the rules
    # per example (swarm testing), and pools, networks and ADDs must come up in most.

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """Two pools and two networks to begin with."""
        for part in range(2):
            self.do(self.draw_create(data, part))
        for _ in range(2):
            self.define_network(data)

    @rule(data=st.data())
    def pools(self, data: st.DataObject) -> None:
        """Create a pool; create one over an existing pool (refused, exit 2, the store
        unchanged); a bad `pool create`; delete a pool (refused while it holds
        allocations, done when it is empty)."""
        what = data.draw(st.sampled_from(["create", "create", "over", "bad", "delete"]), "do")
        create = self.draw_create(data)
        other = self.model.pools.get(pick(data, sorted(self.model.pools), "over pool") or "")
        over = self.draw_overlapping(data, (other or create).layout)
        span = data.draw(layouts(self.env.space, "cli")).spans[0]
        form = data.draw(st.sampled_from(BAD_POOL_CREATES), "bad arguments")
        net = span.subnet
        bad = [a.format(net=net, first=first_host(net), last=last_host(net)) for a in form]
        delete = DeletePool(self.draw_pool_name(data))
        calls = {"create": create, "over": over, "bad": BadCreatePool(create.name, tuple(bad))}
        self.do(calls.get(what, delete))

    @rule(data=st.data())
    def networks(self, data: st.DataObject) -> None:
        """Define a network, or change an inline network's ranges: its attachments keep
        their addresses until DEL, new ADDs use the new ranges (README, "Changing an
        inline network's ranges")."""
        change = data.draw(st.booleans(), "change")
        inline = pick(data, sorted(n for n, net in self.model.nets.items() if net.layout), "net")
        if inline and (change or len(self.model.nets) == NETS_PER_EXAMPLE):
            net = self.model.nets[inline]
            layout = data.draw(layouts(self.env.space, net.dialect), "new layout")
            self.model.nets[net.name] = replace(net, layout=layout)
        elif len(self.model.nets) < NETS_PER_EXAMPLE:
            self.define_network(data)

    def define_network(self, data: st.DataObject) -> None:
        """A network config the runtime holds (the store learns of it at ADD): a named
        pool, a pool list, inline host-local or whereabouts ranges."""
        name = self.env.net_names[len(self.model.nets)]
        version = data.draw(st.sampled_from(VERSIONS), "cniVersion")
        kind = data.draw(st.sampled_from(["pool", "pools", "ranges", "whereabouts"]), "kind")
        inline = kind in ("ranges", "whereabouts")
        layout = data.draw(layouts(self.env.space, kind if inline else "ranges"), "layout")
        cooldown = data.draw(st.sampled_from(COOLDOWNS), "cooldown")
        first = self.draw_pool_name(data)
        pools = (first, self.draw_pool_name(data, other_than=first))
        listed = data.draw(st.booleans(), "as a list")
        if inline:
            net = Net(name, version, dialect=kind, layout=layout, cooldown=cooldown)
        else:
            net = Net(name, version, pools=pools[: 1 if kind == "pool" else 2], listed=listed)
        self.model.nets[name] = net

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        """ADD, for a new or a held attachment."""
        net = self.draw_net(data)
        self.do(Add(net, self.draw_att(data, net)))

    @rule(data=st.data())
    def add_requested(self, data: st.DataObject) -> None:
        """ADD with a requested address (in CNI_ARGS IP= or runtimeConfig.ips): free,
        taken, outside every pool, in another pool, the gateway, excluded."""
        self.do(self.draw_add(data, requested=True))

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        """DEL of a held attachment, a repeated DEL, a DEL of one never added."""
        self.do(self.draw_del(data))

    @rule(data=st.data())
    def check(self, data: st.DataObject) -> None:
        """CHECK with the prevResult the attachment got (or another's, or one from
        before its DEL); or STATUS."""
        status = data.draw(st.integers(0, 3), "STATUS?") == 0
        net = self.draw_net(data)
        att = pick(data, sorted(self.answers), "attachment")
        other = pick(data, sorted(self.answers), "prevResult of")
        own = data.draw(st.booleans(), "its own prevResult")
        if status or att is None or other is None:
            self.do(Status(net))
        else:
            prev = self.answers[att if own else other]
            self.do(Check(self.model.nets[att[0]], att, prev))

    @rule(data=st.data())
    def gc(self, data: st.DataObject) -> None:
        """CNI GC with a valid-attachment list (gcGrace 0: everything else goes)."""
        net = self.draw_net(data)
        listed = data.draw(st.integers(0, 2 ** len(CONTAINERS * 2) - 1), "listed ones")
        unknown = data.draw(st.booleans(), "an unknown one listed too")
        mine = sorted(a[1:] for a in self.model.attachments if a[0] == net.name)
        keep = [one for i, one in enumerate(mine) if listed >> i & 1]
        self.do(Gc(net, (*keep, ("c9", "eth0")) if unknown else tuple(keep)))

    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        """A malformed config or a bad environment: its code, and the store unchanged.
        Or an inline network named like a pool made with the CLI (7)."""
        label, commands, code, stdin, environ, args = data.draw(st.sampled_from(BAD_INPUTS))
        net = self.draw_net(data)
        command = data.draw(st.sampled_from(commands), "command")
        att = self.draw_att(data, net)
        inline = pick(data, [n for n in self.model.nets.values() if n.layout], "inline")
        cli_pool = pick(data, [p for p in self.model.pools.values() if p.source == "cli"], "as")
        if data.draw(st.integers(0, 5), "named like a pool?") == 0 and inline and cli_pool:
            named = replace(inline, name=cli_pool.name)
            self.do(Add(named, (named.name, *att[1:])))
        else:
            self.do(Bad(label, command, net, att, code, stdin, environ, args))

    @rule()
    def remove_orphans(self) -> None:
        """`ipward check --remove-orphans`: earlier layouts no record needs are pruned.
        (No precondition: which rules are enabled must not depend on the answers.)"""
        if any(p.retired for p in self.model.pools.values()):
            self.do(RemoveOrphans())

    @rule(data=st.data())
    def at_once(self, data: st.DataObject) -> None:
        """Two calls at once (three ADDs in a burst); some serial order must explain every
        answer, and the store must be what that order leaves."""
        kind = data.draw(st.sampled_from(AT_ONCE), "at once")
        net = self.draw_net(data)
        add = self.draw_add(data, net)
        same_att, same_request = data.draw(st.booleans()), data.draw(st.booleans())
        fresh = [Add(net, self.draw_att(data, net, fresh=True)) for _ in range(3)]
        delete = self.draw_del(data)
        own_del = data.draw(st.booleans(), "DEL of the ADD's attachment")
        pool = pick(data, [net.name] if net.layout else list(net.pools), "pool to delete")
        create = self.draw_create(data)
        over = self.draw_overlapping(data, net.layout or create.layout)
        if same_att:
            fresh[0].att = add.att
        if same_request:
            fresh[0].requested, fresh[0].via = add.requested, add.via
        mine = tuple(sorted(a[1:] for a in self.model.attachments if a[0] == net.name))
        calls: list[Call] = {
            "add-add": [add, fresh[0]],  # the last address, one attachment, one request
            "add-burst": fresh,  # new attachments at once: combined on an agent
            "add-del": [add, Del(net, add.att) if own_del else delete],
            "del-del": [delete, replace(delete)],
            "add-pool-delete": [add, DeletePool(pool or "")],
            "add-gc": [add, Gc(net, mine)],
            "create-create": [create, replace(over, cooldown=create.cooldown)],
            "add-create": [add, over],  # an inline ADD storing its pool, a creation over it
        }[kind]
        self.do_at_once(calls)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        """After every write: the allocations are exactly the model's, no address is held
        twice, and `ipward check` finds nothing wrong."""
        revision = self.env.revision()
        if revision == self.verified:
            return
        with ThreadPoolExecutor(2) as threads:
            listing = threads.submit(self.stored_records)
            checked = threads.submit(cli_outcome, "check", "--json", store=self.env.url)
        records, report = listing.result(), checked.result()
        assert records == self.model.records(), (records, self.model.records())
        assert report.code == 0 and report.answer["ok"] is True, report
        self.verified = revision

    def stored_records(self) -> dict[tuple[str, str], Att]:
        """This example's allocations as `alloc list --json` shows them; no address may
        be held twice in the whole store."""
        listed = cli_outcome("alloc", "list", "--json", store=self.env.url)
        assert listed.code == 0 and isinstance(listed.answer, list), listed
        addresses = [r["ip"] for r in listed.answer]
        assert len(addresses) == len(set(addresses)), f"an address held twice: {listed}"
        return {
            (r["pool"], r["ip"]): (r["network"], r["container"], r["ifname"])
            for r in listed.answer
            if r["pool"] in self.env.names
        }


def pick(data: st.DataObject, items: list[Any], label: str) -> Any:
    """One of `items` (None if there are none), drawn alike whatever they are."""
    i = data.draw(st.integers(0, 255), label)
    return items[i % len(items)] if items else None


def machine_on(backend: Backend) -> type[ModelMachine]:
    return type("Machine", (ModelMachine,), {"backend": backend})


# -- the runs ----------------------------------------------------------------------------------


@pytest.fixture
def on_sqlite(cni_bin: Path, tmp_path: Path) -> SqliteBackend:
    return SqliteBackend(cni_bin / "ipward", tmp_path)


@pytest.fixture(scope="module")
def on_etcd(cni_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentBackend]:
    root = tmp_path_factory.mktemp("model-etcd")
    with etcd_server(root / "etcd") as server, open_store(server.url) as store:
        agent = fleet.Agent("model-node", server.url, root / "run" / "agent.sock", root)
        try:
            agent.wait_ready()
            wait_for(lambda: store.get("nodes/model-node"), "the node's registration")
            yield AgentBackend(cni_bin / "ipward", server.url, agent.socket, store)
        finally:
            agent.kill()


def test_model_on_sqlite(on_sqlite: SqliteBackend) -> None:
    run_state_machine_as_test(machine_on(on_sqlite), settings=SHORT)


def test_model_on_etcd_through_an_agent(on_etcd: AgentBackend) -> None:
    run_state_machine_as_test(machine_on(on_etcd), settings=SHORT)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT)
def test_model_on_sqlite_long(on_sqlite: SqliteBackend) -> None:
    run_state_machine_as_test(machine_on(on_sqlite), settings=LONG)


@pytest.mark.slow
@pytest.mark.timeout(LONG_TIMEOUT)
def test_model_on_etcd_through_an_agent_long(on_etcd: AgentBackend) -> None:
    run_state_machine_as_test(machine_on(on_etcd), settings=LONG)


# -- findings ------------------------------------------------------------------------------------


def host_local(url: str, subnet: str) -> dict[str, Any]:
    ipam = {"type": "ipward", "store": url, "ranges": [[{"subnet": subnet}]], "cooldown": 0}
    return {"cniVersion": "1.1.0", "name": "edited", "ipam": ipam}


def whole_store(url: str) -> tuple[int, dict[str, bytes]]:
    with open_store(url) as store:
        kvs, revision = store.range("")
    return revision, {kv.key: kv.value for kv in kvs}


def test_a_requested_address_of_the_old_ranges_is_refused(plugin: Path, sqlite_url: str) -> None:
    """Finding of the model test: after a network's ranges changed, a new pod's ADD
    requesting an address of the old ranges got it (code 0) from the stored, earlier
    version of the network's pool. New pods get addresses of the new ranges only: 102,
    nothing written."""
    old, new = host_local(sqlite_url, "10.3.0.0/29"), host_local(sqlite_url, "10.3.0.8/29")
    assert exec_plugin(plugin, "ADD", old, "a").returncode == 0
    before = whole_store(sqlite_url)
    result = plugin_outcome(exec_plugin(plugin, "ADD", new, "b", args="IP=10.3.0.4"))
    assert result.code == 102, result
    assert whole_store(sqlite_url) == before


def test_a_retried_add_answers_its_addresses_after_a_range_change(
    plugin: Path, sqlite_url: str
) -> None:
    """Finding of the model test: an ADD retried for an attachment that holds addresses
    was judged against the current config before the attachment was looked up: after
    the network's ranges changed, the retry with its requested address was refused
    with 102 (103 when its config named a pool that is gone). A retried ADD answers the
    addresses it holds (docs/design.md invariant 4) and writes nothing; its own bad input is still
    refused."""
    old, new = host_local(sqlite_url, "10.3.0.0/29"), host_local(sqlite_url, "10.3.0.8/29")
    gone = {**new, "ipam": {"type": "ipward", "store": sqlite_url, "pool": "gone"}}
    first = exec_plugin(plugin, "ADD", old, "a", args="IP=10.3.0.5")
    assert first.returncode == 0, first
    assert exec_plugin(plugin, "ADD", new, "b").returncode == 0  # the new ranges stored
    before = whole_store(sqlite_url)
    for config, args in ((new, "IP=10.3.0.5"), (gone, "")):
        retried = plugin_outcome(exec_plugin(plugin, "ADD", config, "a", args=args))
        assert retried.code == 0, retried
        assert retried.answer["ips"] == first.json["ips"]
    assert plugin_outcome(exec_plugin(plugin, "ADD", new, "a", args="IP=banana")).code == 4
    assert whole_store(sqlite_url) == before


def test_the_agent_refuses_only_on_the_pools_as_stored(on_etcd: AgentBackend) -> None:
    """Finding of the model test (on etcd through an agent): the agent's ledger refused
    from pool specs it remembered: after `pool delete` and `pool create` of a name with
    other ranges, an ADD requesting an address of the new ranges got 102, and a pool
    list naming a deleted pool got 7 (two pools of one family, from the old spec)
    instead of 103. A refusal is only given on the pools as stored."""
    plugin, url = on_etcd.plugin, on_etcd.url
    ipam = {"type": "ipward", "agentSocket": str(on_etcd.socket)}
    config = {"cniVersion": "1.1.0", "name": "net", "ipam": {**ipam, "pool": "fp"}}
    listed = {"cniVersion": "1.1.0", "name": "listed", "ipam": {**ipam, "pool": "fp,fq"}}
    for pool, cidr in (("fp", "10.9.0.0/29"), ("fq", "10.9.1.0/29")):
        run_cli("pool", "create", pool, "--range", cidr, store=url, check=True)
    assert exec_plugin(plugin, "ADD", config, "a").returncode == 0  # the agent reads fp
    assert exec_plugin(plugin, "DEL", config, "a").returncode == 0
    assert plugin_outcome(exec_plugin(plugin, "ADD", listed, "a")).code == 7  # reads fq
    run_cli("pool", "delete", "fp", store=url, check=True)
    run_cli("pool", "delete", "fq", store=url, check=True)
    run_cli("pool", "create", "fp", "--range", "10.9.0.8/29", store=url, check=True)
    assert plugin_outcome(exec_plugin(plugin, "ADD", listed, "b")).code == 103
    requested = plugin_outcome(exec_plugin(plugin, "ADD", config, "b", args="IP=10.9.0.10"))
    assert requested.code == 0, requested
    assert requested.answer["ips"][0]["address"] == "10.9.0.10/29"


def test_a_remembered_pool_that_is_gone_is_refused_with_a_requested_address_elsewhere(
    on_etcd: AgentBackend,
) -> None:
    """Finding of the model test (on etcd through an agent): a network naming a pool the
    agent remembered but `pool delete` had removed, and an ADD requesting an address of
    another pool, got that address (code 0): the gone pool, holding no requested
    address, was passed over unread. In a fresh process the same call is refused with
    103 (the named pool read first); so it is through an agent now, writing nothing."""
    plugin, url = on_etcd.plugin, on_etcd.url
    ipam = {"type": "ipward", "agentSocket": str(on_etcd.socket)}
    config = {"cniVersion": "1.1.0", "name": "gone", "ipam": {**ipam, "pool": "gp"}}
    for pool, cidr in (("gp", "10.9.2.0/29"), ("gq", "10.9.3.0/29")):
        run_cli("pool", "create", pool, "--range", cidr, store=url, check=True)
    assert exec_plugin(plugin, "ADD", config, "a").returncode == 0  # the agent reads gp
    assert exec_plugin(plugin, "DEL", config, "a").returncode == 0
    run_cli("pool", "delete", "gp", store=url, check=True)
    before = whole_store(url)
    outcome = plugin_outcome(exec_plugin(plugin, "ADD", config, "b", args="IP=10.9.3.4"))
    assert outcome.code == 103, outcome
    assert whole_store(url) == before
