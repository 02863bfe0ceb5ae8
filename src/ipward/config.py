"""The plugin's configuration: the network config on stdin and the CNI_* environment.

Three dialects of the `ipam` section are accepted, so users switch by changing only
`type`:
  - host-local's: `ranges` (list of range sets), or the older top-level `subnet`,
    `rangeStart`, `rangeEnd`, `gateway`; `routes`;
  - whereabouts': `range` ("CIDR" or "first-last/prefix"), `range_start`, `range_end`,
    `exclude`, `gateway`, `ipRanges` (one entry per family);
  - ipward's: `pool` (a named pool created with `ipward pool create`).
An inline pool (host-local or whereabouts dialect) is named after the network.
"""

from __future__ import annotations

import os

from ipward.addr import family_of, format_cidr, parse_cidr
from ipward.errors import InvalidConfig, InvalidEnvironment
from ipward.ledger import ADD_GRACE, STICKY_TTL
from ipward.pool import DEFAULT_COOLDOWN, PoolSpec, check_name, check_routes, default_gateway
from ipward.records import Attachment, PodInfo

DEFAULT_STORE = "sqlite:///var/lib/ipward/ipward.db"
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_KNOWN_ARGS = frozenset(
    (
        "IgnoreUnknown",
        "IP",
        "K8S_POD_NAMESPACE",
        "K8S_POD_NAME",
        "K8S_POD_UID",
        "K8S_POD_INFRA_CONTAINER_ID",
    )
)


class IpamConfig:
    """What one plugin call needs, parsed and checked."""

    __slots__ = (
        "agent_socket",
        "cni_version",
        "dns",
        "gc_grace",
        "inline_pool",
        "log_file",
        "log_level",
        "network",
        "node",
        "pool_names",
        "raw",
        "routes",
        "sticky",
        "sticky_ttl",
        "store_url",
    )

    def __init__(self, raw: dict) -> None:
        if not isinstance(raw, dict):
            raise InvalidConfig("network configuration must be a JSON object")
        self.raw = raw
        version = raw.get("cniVersion")
        if not isinstance(version, str) or not version:
            raise InvalidConfig("cniVersion is missing")
        self.cni_version = version
        self.network = check_name(raw.get("name"), "network name")
        ipam = raw.get("ipam")
        if not isinstance(ipam, dict):
            raise InvalidConfig("the 'ipam' section is missing or not an object")
        self.store_url = _str(ipam, "store", DEFAULT_STORE)
        self.agent_socket = _str(ipam, "agentSocket", "") or _str(ipam, "agent_socket", "")
        self.node = _str(ipam, "node", "") or os.uname().nodename
        self.log_file = _str(ipam, "logFile", "") or _str(ipam, "log_file", "")
        self.log_level = _str(ipam, "logLevel", "info")
        self.routes = _routes(ipam.get("routes", []))
        self.gc_grace = _seconds(ipam, "gcGrace", ADD_GRACE)
        self.sticky = ipam.get("sticky", False)
        if not isinstance(self.sticky, bool):
            raise InvalidConfig("ipam.sticky must be true or false")
        self.sticky_ttl = _seconds(ipam, "stickyTTL", STICKY_TTL)
        self.dns = ipam.get("dns", {})
        if not isinstance(self.dns, dict):
            raise InvalidConfig("ipam.dns must be an object")
        pool = ipam.get("pool")
        self.inline_pool = _inline_pool(self.network, ipam, self.routes)
        if pool is not None and self.inline_pool is not None:
            raise InvalidConfig("ipam has both 'pool' and inline ranges; use one")
        if pool is None and self.inline_pool is None:
            raise InvalidConfig(
                "ipam needs 'pool' (a pool made with 'ipward pool create') or inline"
                " 'ranges' / 'subnet' / 'range' / 'ipRanges'"
            )
        names = pool.split(",") if isinstance(pool, str) else pool
        if pool is not None and not (isinstance(names, list) and names):
            raise InvalidConfig("ipam.pool must be a pool name or a list of names")
        self.pool_names = [
            check_name(n.strip() if isinstance(n, str) else n) for n in (names or [])
        ]

    def requested_ips(self, cni_args: dict[str, str]) -> list[str]:
        """Addresses asked for by the runtime: `runtimeConfig.ips`, `args.cni.ips`, or
        CNI_ARGS `IP=` (comma-separated); prefixes are dropped."""
        found: list[str] = []
        runtime = self.raw.get("runtimeConfig", {})
        if isinstance(runtime, dict) and runtime.get("ips") is not None:
            found += _ip_list(runtime["ips"], "runtimeConfig.ips")
        args = self.raw.get("args", {})
        cni = args.get("cni", {}) if isinstance(args, dict) else {}
        if isinstance(cni, dict) and cni.get("ips") is not None:
            found += _ip_list(cni["ips"], "args.cni.ips")
        if cni_args.get("IP"):
            found += _ip_list(cni_args["IP"].split(","), "CNI_ARGS IP")
        return list(dict.fromkeys(found))


def _str(section: dict, field: str, default: str) -> str:
    value = section.get(field, default)
    if not isinstance(value, str):
        raise InvalidConfig(f"ipam.{field} must be a string")
    return value


def _seconds(section: dict, field: str, default: float) -> float:
    value = section.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidConfig(f"ipam.{field} must be a number of seconds, 0 or more")
    return float(value)


def _ip_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidConfig(f"{where} must be a list of addresses")
    return [v.strip().split("/")[0] for v in value if v.strip()]


def _routes(value: object) -> list[dict]:
    return check_routes(value, "ipam.routes")


def _inline_pool(network: str, ipam: dict, routes: list[dict]) -> PoolSpec | None:
    """The pool an inline config describes, named after the network; None if none."""
    exclude = ipam.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise InvalidConfig("ipam.exclude must be a list of CIDRs or addresses")
    range_sets: list[list[dict]]
    if "ranges" in ipam:  # host-local
        range_sets = ipam["ranges"]
        if not isinstance(range_sets, list) or not range_sets:
            raise InvalidConfig("ipam.ranges must be a non-empty list of range lists")
        range_sets = [_host_local_gateways(rs) for rs in range_sets]
    elif "subnet" in ipam:  # host-local, older form
        one = {k: ipam[k] for k in ("subnet", "rangeStart", "rangeEnd", "gateway") if k in ipam}
        range_sets = [_host_local_gateways([one])]
    elif "range" in ipam or "ipRanges" in ipam:  # whereabouts
        entries = [ipam] if "range" in ipam else ipam["ipRanges"]
        if not isinstance(entries, list) or not entries:
            raise InvalidConfig("ipam.ipRanges must be a non-empty list")
        range_sets, exclude = [], list(exclude)
        for entry in entries:
            if not isinstance(entry, dict):
                raise InvalidConfig(f"an ipRanges entry must be an object: {entry!r}")
            one, more_excluded = _whereabouts_range(entry, ipam.get("gateway"))
            range_sets.append([one])
            exclude += more_excluded
    else:
        return None
    cooldown = ipam.get("cooldown", DEFAULT_COOLDOWN)
    return PoolSpec(network, range_sets, exclude, routes, cooldown, source="cni-config")


def _unset_empty(entry: dict, fields: tuple[str, ...]) -> dict:
    """host-local and whereabouts read an empty address as not given (Go's net.IP of
    ""): so does their dialect here (a stored spec never has an empty address)."""
    return {k: v for k, v in entry.items() if not (k in fields and v == "")}


def _host_local_gateways(range_set: object) -> list[dict]:
    """host-local's rule: a range without `gateway` has its subnet's first address as
    the gateway, never handed out (a bridge with isGateway puts that address on itself,
    so handing it to a pod would duplicate it)."""
    if not isinstance(range_set, list):
        raise InvalidConfig("each entry of ipam.ranges must be a list of ranges")
    out = []
    for r in range_set:
        if isinstance(r, dict):
            r = _unset_empty(r, ("rangeStart", "rangeEnd", "gateway"))
            if "gateway" not in r and isinstance(r.get("subnet"), str):
                gateway = default_gateway(r["subnet"])
                if gateway is not None:
                    r["gateway"] = gateway
        out.append(r)
    return out


def _whereabouts_range(entry: dict, gateway: object) -> tuple[dict, list[str]]:
    text = entry.get("range")
    if not isinstance(text, str):
        raise InvalidConfig(f"a whereabouts range needs 'range' (CIDR): {entry!r}")
    entry = _unset_empty(entry, ("range_start", "range_end", "gateway"))
    one: dict = {}
    if "-" in text:  # "first-last/prefix"
        span, _, prefix = text.partition("/")
        first, _, last = span.partition("-")
        if not first or not last:
            raise InvalidConfig(
                f"ipam range {text!r}: 'first-last/prefix' needs both the first and the last"
                " address"
            )
        one["rangeStart"], one["rangeEnd"] = first, last
        text = f"{first}/{prefix}"
    family, network, length = parse_cidr(text)
    one["subnet"] = format_cidr(family, network, length)
    if text.split("/")[0] != one["subnet"].split("/")[0] and "rangeStart" not in one:
        one["rangeStart"] = text.split("/")[0]  # whereabouts: a host address starts the range
    for ours, theirs in (("rangeStart", "range_start"), ("rangeEnd", "range_end")):
        if isinstance(entry.get(theirs), str):
            one[ours] = entry[theirs]
    gw = entry.get("gateway", gateway or None)
    # A top-level gateway (whereabouts) applies to the range of its own family only.
    if isinstance(gw, str) and family_of(gw) == family:
        one["gateway"] = gw
    excluded = entry.get("exclude", [])
    if not isinstance(excluded, list):
        raise InvalidConfig("exclude must be a list")
    return one, list(excluded)


def parse_cni_args(text: str) -> dict[str, str]:
    """`K=V;K=V`. Unknown keys are an error unless `IgnoreUnknown` is true, as in
    host-local."""
    args: dict[str, str] = {}
    for part in text.split(";"):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise InvalidEnvironment(f"CNI_ARGS: {part!r} is not KEY=VALUE")
        args[key] = value
    ignore = args.get("IgnoreUnknown", "").lower() in ("1", "true")
    unknown = sorted(set(args) - _KNOWN_ARGS)
    if unknown and not ignore:
        raise InvalidEnvironment(
            f"CNI_ARGS: unknown keys {', '.join(unknown)} (and no IgnoreUnknown)"
        )
    return args


class Call:
    """One invocation: the command, the attachment and the pod it concerns."""

    __slots__ = ("args", "attachment", "command", "pod")

    def __init__(self, env: dict[str, str], network: str) -> None:
        self.command = env.get("CNI_COMMAND", "")
        self.args = parse_cni_args(env.get("CNI_ARGS", ""))
        self.pod = PodInfo(
            self.args.get("K8S_POD_NAMESPACE", ""),
            self.args.get("K8S_POD_NAME", ""),
            self.args.get("K8S_POD_UID", ""),
            self.args.get("K8S_POD_INFRA_CONTAINER_ID", ""),
        )
        container = env.get("CNI_CONTAINERID", "")
        ifname = env.get("CNI_IFNAME", "")
        if not container or not set(container) <= _ID_CHARS:
            raise InvalidEnvironment(
                f"CNI_CONTAINERID {container!r} is missing or not letters, digits, '-_.'"
            )
        if (
            not ifname
            or len(ifname) > 15
            or ifname in (".", "..")
            or any(c in ifname for c in "/: \t\n")
        ):
            raise InvalidEnvironment(f"CNI_IFNAME {ifname!r} is missing or not an interface name")
        if self.command in ("ADD", "CHECK") and not env.get("CNI_NETNS"):
            raise InvalidEnvironment(f"CNI_NETNS is required for {self.command}")
        self.attachment = Attachment(network, container, ifname)
