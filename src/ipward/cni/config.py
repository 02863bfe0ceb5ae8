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

import posix

from ipward.cni.wire import agent_socket, socket_path_problem
from ipward.core.addr import family_of, format_cidr, format_ip, parse_cidr, parse_ip
from ipward.core.errors import InvalidConfig, InvalidEnvironment, IpwardError
from ipward.core.log import LEVELS
from ipward.core.names import check_node_name
from ipward.core.policy import ADD_GRACE, DEFAULT_COOLDOWN, STICKY_TTL
from ipward.core.pool import CNI_CONFIG, PoolSpec, check_name, check_routes, default_gateway
from ipward.core.records import Attachment, PodInfo

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

DEFAULT_STORE = "sqlite:///var/lib/ipward/ipward.db"
# The fields of an inline pool, in any dialect (a config has them or `pool`).
INLINE_FIELDS = ("ranges", "subnet", "range", "ipRanges")
# Bounds of every field (README: limits). Names and IDs in characters, the rest in bytes.
MAX_CONTAINER_ID = 255  # a file name: the plugin names a note after it (cni/notes.py)
MAX_NAME = 253  # network, pool and node names (a DNS subdomain's length)
MAX_IFNAME = 15  # bytes: IFNAMSIZ less its NUL
MAX_NETNS = 4096  # bytes: PATH_MAX
MAX_CNI_ARGS = 8192  # bytes
MAX_ARG_KEY = 64
MAX_NAMESPACE = 63  # a DNS label
MAX_POD_UID = 128
MAX_PATH = 4096  # bytes of ipam.store and ipam.logFile
MAX_SECONDS = 10 * 365 * 86400.0  # gcGrace, stickyTTL
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ID_CHARS = _ALNUM | frozenset("-_.")
_DNS_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_UID_CHARS = _ALNUM | frozenset("-")
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
        # Every field is checked, and all that is wrong said at once: a user fixing a
        # config should not meet its mistakes one ADD at a time.
        problems: list[str] = []

        def checked(check: Callable[[], Any], default: Any) -> Any:
            try:
                return check()
            except InvalidConfig as e:
                problems.append(e.msg)
                return default

        version = raw.get("cniVersion")
        if not isinstance(version, str) or not version:
            problems.append("cniVersion is missing (or not a string)")
        self.cni_version = version if isinstance(version, str) else ""
        problem = identifier_problem(raw.get("name"), "name (the network name)", MAX_NAME)
        if problem:
            problems.append(problem)
        self.network: str = "" if problem else raw["name"]
        for field in ("runtimeConfig", "args"):
            if field in raw and not isinstance(raw[field], dict):
                problems.append(f"{field} must be an object")
        args = raw.get("args", {})
        if isinstance(args, dict) and not isinstance(args.get("cni", {}), dict):
            problems.append("args.cni must be an object")
        ipam = raw.get("ipam")
        if not isinstance(ipam, dict):
            raise InvalidConfig(
                "; ".join([*problems, "the 'ipam' section is missing or not an object"])
            )
        self.store_url = checked(lambda: _path(ipam, "store", DEFAULT_STORE), "")
        for field in ("agentSocket", "agent_socket"):
            problem = socket_path_problem(ipam[field]) if ipam.get(field, "") != "" else None
            if problem:
                problems.append(f"ipam.{field} {problem}")
        self.agent_socket = agent_socket(raw) or ""
        self.node = checked(
            lambda: check_node_name(_str(ipam, "node", "") or posix.uname().nodename, "ipam.node"),
            "",
        )
        self.log_file = checked(
            lambda: _path(ipam, "logFile", "") or _path(ipam, "log_file", ""), ""
        )
        self.log_level = checked(lambda: _str(ipam, "logLevel", "info"), "info")
        if self.log_level not in LEVELS:
            problems.append(f"ipam.logLevel must be one of {', '.join(LEVELS)}")
        self.routes = checked(lambda: _routes(ipam.get("routes", [])), [])
        self.gc_grace = checked(lambda: _seconds(ipam, "gcGrace", ADD_GRACE), ADD_GRACE)
        self.sticky = ipam.get("sticky", False)
        if not isinstance(self.sticky, bool):
            problems.append("ipam.sticky must be true or false")
        self.sticky_ttl = checked(lambda: _seconds(ipam, "stickyTTL", STICKY_TTL), STICKY_TTL)
        self.dns = checked(lambda: _dns(ipam.get("dns", {})), {})
        pool = ipam.get("pool")
        self.inline_pool = checked(
            lambda: _inline_pool(self.network or "network", ipam, self.routes), None
        )
        inline = self.inline_pool is not None or any(k in ipam for k in INLINE_FIELDS)
        if pool is not None and inline:
            problems.append("ipam has both 'pool' and inline ranges; use one")
        if pool is None and not inline:
            problems.append(
                "ipam needs 'pool' (a pool made with 'ipward pool create') or inline"
                " 'ranges' / 'subnet' / 'range' / 'ipRanges'"
            )
        names = pool.split(",") if isinstance(pool, str) else pool
        if "pool" in ipam and not (isinstance(names, list) and names):
            problems.append("ipam.pool must be a pool name or a list of names")
            names = []
        self.pool_names: list[str] = []
        for n in names or []:
            try:
                self.pool_names.append(pool_name(n, "ipam.pool"))
            except InvalidConfig as e:
                problems.append(e.msg)
        if problems:
            count = f"{len(problems)} problems: " if len(problems) > 1 else ""
            raise InvalidConfig(count + "; ".join(problems))

    def requested_ips(self, cni_args: dict[str, str]) -> list[str]:
        """Addresses asked for by the runtime: `runtimeConfig.ips`, `args.cni.ips`, or
        CNI_ARGS `IP=` (comma-separated); prefixes are dropped. A bad address is the
        config's fault (7) in the config, the environment's (4) in CNI_ARGS."""
        found: list[str] = []
        runtime = self.raw.get("runtimeConfig", {})
        if runtime.get("ips") is not None:
            found += _ip_list(runtime["ips"], "runtimeConfig.ips", InvalidConfig)
        cni = self.raw.get("args", {}).get("cni", {})
        if cni.get("ips") is not None:
            found += _ip_list(cni["ips"], "args.cni.ips", InvalidConfig)
        if cni_args.get("IP"):
            found += _ip_list(cni_args["IP"].split(","), "CNI_ARGS IP", InvalidEnvironment)
        return list(dict.fromkeys(found))


def pool_name(value: object, where: str) -> str:
    """One pool name given in `where` (`ipam.pool`, an `ipward.io/pool` annotation),
    stripped; InvalidConfig (7) for a name no pool can have."""
    name = value.strip() if isinstance(value, str) else value
    if isinstance(name, str) and len(name) > MAX_NAME:
        raise InvalidConfig(f"{where}: a pool name is longer than {MAX_NAME} characters")
    return check_name(name, f"{where}: pool name")


def _str(section: dict, field: str, default: str) -> str:
    value = section.get(field, default)
    if not isinstance(value, str):
        raise InvalidConfig(f"ipam.{field} must be a string")
    return value


def _path(section: dict, field: str, default: str) -> str:
    """A store URL or file path: a string of at most MAX_PATH bytes, no control bytes."""
    value = _str(section, field, default)
    problem = text_problem(value, f"ipam.{field}", MAX_PATH)
    if problem:
        raise InvalidConfig(problem)
    return value


def _seconds(section: dict, field: str, default: float) -> float:
    value = section.get(field, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_SECONDS  # also refuses NaN
    ):
        raise InvalidConfig(f"ipam.{field} must be a number of seconds from 0 to {MAX_SECONDS:.0f}")
    return float(value)


def _dns(value: object) -> dict:
    """`ipam.dns` as the CNI spec types it; returned in the result as it is."""
    if not isinstance(value, dict):
        raise InvalidConfig("ipam.dns must be an object")
    for field in ("nameservers", "search", "options"):
        items = value.get(field, [])
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise InvalidConfig(f"ipam.dns.{field} must be a list of strings")
    if not isinstance(value.get("domain", ""), str):
        raise InvalidConfig("ipam.dns.domain must be a string")
    for server in value.get("nameservers", []):
        try:
            parse_ip(server)
        except InvalidConfig as e:
            raise InvalidConfig(f"ipam.dns.nameservers: {e.msg}") from None
    return value


def _ip_list(value: object, where: str, error: type[IpwardError]) -> list[str]:
    """Bare addresses of a list of addresses (each may carry a prefix), at most one per
    family; `error` says whose fault a bad one is."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise error(f"{where} must be a list of addresses")
    out: dict[int, str] = {}
    for text in (v.strip() for v in value):
        if not text:
            continue
        try:
            family, number = parse_ip(text.split("/")[0])
            if "/" in text:
                parse_cidr(text)
        except InvalidConfig as e:
            raise error(f"{where}: {e.msg}") from None
        ip = format_ip(family, number)
        if out.setdefault(family, ip) != ip:
            raise error(f"{where}: two IPv{family} addresses ({out[family]}, {ip}); one per family")
    return list(out.values())


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
    return PoolSpec(network, range_sets, exclude, routes, cooldown, source=CNI_CONFIG)


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
    host-local; a key given again must say the same (Multus passes the runtime's
    arguments with its own after them: each K8S_POD_* twice, `IgnoreUnknown` as `1` and
    as `true`), else the call is refused; the pod's identity as Kubernetes forms it."""
    problem = text_problem(text, "CNI_ARGS", MAX_CNI_ARGS)
    if problem:
        raise InvalidEnvironment(problem)
    args: dict[str, str] = {}
    for part in text.split(";"):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise InvalidEnvironment(f"CNI_ARGS: {_shown(part)} is not KEY=VALUE")
        if not key or len(key) > MAX_ARG_KEY or not set(key) <= _ID_CHARS:
            raise InvalidEnvironment(
                f"CNI_ARGS: key {_shown(key)} must be 1 to {MAX_ARG_KEY} letters, digits,"
                " '_', '.' or '-'"
            )
        if key in args and _meaning(key, args[key]) != _meaning(key, value):
            raise InvalidEnvironment(
                f"CNI_ARGS: {key} given twice, as {_shown(args[key])} and {_shown(value)}"
            )
        args[key] = value
    ignore = args.get("IgnoreUnknown", "").lower() in ("1", "true")
    unknown = sorted(set(args) - _KNOWN_ARGS)
    if unknown and not ignore:
        raise InvalidEnvironment(
            f"CNI_ARGS: unknown keys {', '.join(unknown)} (and no IgnoreUnknown)"
        )
    for key, check in _ARG_CHECKS:
        problem = check(args[key], f"CNI_ARGS {key}") if args.get(key) else None
        if problem:
            raise InvalidEnvironment(problem)
    return args


def _meaning(key: str, value: str) -> str | bool:
    return value.lower() in ("1", "true") if key == "IgnoreUnknown" else value


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
        container = env.get("CNI_CONTAINERID")
        ifname = env.get("CNI_IFNAME")
        netns = env.get("CNI_NETNS", "")
        problem = (
            container_id_problem(container, "CNI_CONTAINERID")
            or ifname_problem(ifname, "CNI_IFNAME")
            or (text_problem(netns, "CNI_NETNS", MAX_NETNS) if netns else None)
        )
        if problem:
            raise InvalidEnvironment(problem)
        if self.command in ("ADD", "CHECK") and not netns:
            raise InvalidEnvironment(f"CNI_NETNS is required for {self.command}")
        assert container is not None and ifname is not None
        self.attachment = Attachment(network, container, ifname)


# -- field rules: each returns what is wrong with a value (naming it), or None -----------


def _shown(value: object) -> str:
    """A value quoted in a message, cut short: messages must stay small."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_control(c: str) -> bool:
    return c < " " or "\x7f" <= c <= "\x9f"


def text_problem(value: str, what: str, max_bytes: int) -> str | None:
    """Text from outside: valid UTF-8, no control characters, at most `max_bytes`."""
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # bytes that were not UTF-8, kept as surrogates
        return f"{what} is not valid UTF-8"
    if size > max_bytes:
        return f"{what} is longer than {max_bytes} bytes"
    if any(_is_control(c) for c in value):
        return f"{what} {_shown(value)} contains control characters"
    return None


def identifier_problem(value: object, what: str, limit: int) -> str | None:
    """CNI's rule for container IDs and network names: a letter or a digit, then letters,
    digits, '_', '.' or '-'; at most `limit` characters."""
    if not isinstance(value, str) or not value:
        return f"{what} is missing (or not a string)"
    if len(value) > limit:
        return f"{what} is longer than {limit} characters"
    if value[0] not in _ALNUM or not set(value) <= _ID_CHARS:
        return (
            f"{what} {_shown(value)} must be a letter or a digit followed by letters,"
            " digits, '_', '.' or '-'"
        )
    return None


def container_id_problem(value: object, what: str = "containerID") -> str | None:
    return identifier_problem(value, what, MAX_CONTAINER_ID)


def ifname_problem(value: object, what: str = "ifname") -> str | None:
    """Linux's rule for interface names: 1 to 15 bytes, not '.' or '..', no '/', ':',
    whitespace or control characters."""
    if not isinstance(value, str) or not value:
        return f"{what} is missing (or not a string)"
    problem = text_problem(value, what, MAX_IFNAME)
    if problem:
        return problem
    if value in (".", "..") or any(c in "/:" or c.isspace() for c in value):
        return f"{what} {_shown(value)} is not an interface name (no '/', ':' or whitespace)"
    return None


def _dns_label(value: str) -> bool:
    return bool(value) and set(value) <= _DNS_CHARS and value[0] != "-" and value[-1] != "-"


def _namespace_problem(value: str, what: str) -> str | None:
    if len(value) > MAX_NAMESPACE or not _dns_label(value):
        return f"{what} {_shown(value)} is not a Kubernetes namespace (a DNS-1123 label)"
    return None


def _pod_name_problem(value: str, what: str) -> str | None:
    if len(value) > MAX_NAME or not all(_dns_label(p) for p in value.split(".")):
        return f"{what} {_shown(value)} is not a Kubernetes pod name (a DNS-1123 subdomain)"
    return None


def _uid_problem(value: str, what: str) -> str | None:
    if len(value) > MAX_POD_UID or not set(value) <= _UID_CHARS:
        return f"{what} {_shown(value)} must be at most {MAX_POD_UID} letters, digits or '-'"
    return None


_ARG_CHECKS = (
    ("K8S_POD_NAMESPACE", _namespace_problem),
    ("K8S_POD_NAME", _pod_name_problem),
    ("K8S_POD_UID", _uid_problem),
    ("K8S_POD_INFRA_CONTAINER_ID", container_id_problem),
)
