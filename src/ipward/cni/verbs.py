"""`ipward-cni`: the CNI IPAM plugin (a runtime finds it as `ipward` in its CNI bin dir).

ADD, DEL, CHECK, GC, STATUS and VERSION for cniVersion 0.3.0 to 1.1.0, each answered in
its own result format. In single-node mode the ledger runs here, in-process, on the
SQLite store. Every failure is a CNI error object on stdout with a non-zero exit; details
go to the log file named in the config (`ipam.logFile`), or stderr. Nothing else is ever
printed on stdout.

This module is the plugin's start path: what it imports at the top is paid on every pod
start, so it is standard library only and nothing heavier than `sqlite3` (JSON goes
through `core.startpath`, see there).
"""

from __future__ import annotations

import posix
import sys

from ipward.cni.cniio import (
    SUPPORTED_VERSIONS,
    check_size,
    decode,
    dump,
    error_output,
    version_output,
)
from ipward.cni.config import (
    DEFAULT_STORE,
    MAX_NAME,
    MAX_PATH,
    Call,
    IpamConfig,
    container_id_problem,
    identifier_problem,
    ifname_problem,
    text_problem,
)
from ipward.cni.wire import environment
from ipward.core import log
from ipward.core.addr import format_ip, parse_cidr, parse_ip
from ipward.core.errors import (
    DecodeFailure,
    IncompatibleStore,
    IncompatibleVersion,
    InputTooLarge,
    InvalidConfig,
    InvalidEnvironment,
    IpwardError,
    NotAvailable,
    UnknownContainer,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.cluster.pods import PodDirectory
    from ipward.core.pool import PoolSpec
    from ipward.ipam.ledger import Allocation, Ledger

COMMANDS = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")
INTERNAL_ERROR = 999


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def run(
    env: dict[str, str],
    stdin: bytes,
    ledger: Ledger | None = None,
    directory: PodDirectory | None = None,
    sandboxes: Callable[[str], bool] | None = None,
) -> str:
    """Do one plugin call; returns what goes on stdout. Raises IpwardError. The agent
    passes its own `ledger` (its store, its node), with a cluster source the `directory`
    of pods ADD reads annotations and owners from, and with a runtime `sandboxes`
    (whether it lists a sandbox: a sticky take-over waits for the old one's teardown);
    the plugin opens a ledger on SQLite."""
    command = env.get("CNI_COMMAND", "")
    if command == "DEL":
        return _delete(env, stdin, ledger)
    check_size(stdin)
    if command not in COMMANDS:
        raise InvalidEnvironment(f"CNI_COMMAND {command!r} is not one of {', '.join(COMMANDS)}")
    raw = _decoded(stdin, ledger)
    if command == "VERSION":
        return version_output(raw)
    config = _config(raw)
    if command == "CHECK" and _version_key(config.cni_version) < (0, 4, 0):
        raise IncompatibleVersion(
            f"CHECK needs cniVersion 0.4.0 or later, not {config.cni_version}"
        )
    if command == "GC" and _version_key(config.cni_version) < (1, 1, 0):
        raise IncompatibleVersion(f"GC needs cniVersion 1.1.0 or later, not {config.cni_version}")
    # The plugin does not close its store: the process ends with os._exit right after,
    # every commit is already durable, and closing the last connection would checkpoint
    # the WAL on every pod start.
    if command == "STATUS":
        _status(config, ledger)
        return ""
    if command == "GC":
        _gc(config, config.raw, ledger)
        return ""
    call = Call(env, config.network)
    ledger = ledger or _ledger(config)
    if command == "ADD":
        return dump(_add(ledger, config, call, directory, sandboxes))
    _check(ledger, call, config.raw)
    return ""


def _decoded(stdin: bytes, ledger: Ledger | None) -> object:
    raw = decode(stdin)
    if ledger is None:
        # In-process only: the agent keeps its own log; a config's logFile must not
        # redirect (or reopen, per request) the log of a process serving many calls.
        _configure_log(raw)
    return raw


def _config(raw: object) -> IpamConfig:
    if raw is None:
        raise DecodeFailure("no network configuration on stdin")
    config = IpamConfig(raw)  # type: ignore[arg-type]  # it refuses what is not a dict
    if config.cni_version not in SUPPORTED_VERSIONS:
        raise IncompatibleVersion(
            f"cniVersion {config.cni_version} is not supported",
            f"supported: {', '.join(SUPPORTED_VERSIONS)}",
        )
    return config


def _delete(env: dict[str, str], stdin: bytes, ledger: Ledger | None) -> str:
    """DEL: free what the attachment holds. It is refused only while an address may be
    held (docs/design.md 5.14): a config that fails its checks still names the
    attachment by its `name`, and what that identity holds is freed; a config that
    names no network, or an in-process store no ADD could have used, holds nothing."""
    raw: object = None
    try:
        check_size(stdin)
        raw = _decoded(stdin, ledger)
        config = _config(raw)
    except (InputTooLarge, DecodeFailure, InvalidConfig, IncompatibleVersion) as problem:
        return _delete_by_identity(env, raw, ledger, problem)
    call = Call(env, config.network)
    if ledger is None:
        try:
            ledger = _ledger(config)
        except InvalidConfig as problem:  # a store the plugin cannot run on: no ADD did
            log.warning(
                "DEL answered: no ADD of this config could have allocated",
                attachment=repr(call.attachment),
                reason=problem.msg,
            )
            return ""
    ledger.free(call.attachment)
    return ""


def _delete_by_identity(
    env: dict[str, str], raw: object, ledger: Ledger | None, problem: IpwardError
) -> str:
    network = raw.get("name") if isinstance(raw, dict) else None
    if identifier_problem(network, "name", MAX_NAME):
        log.warning(
            "DEL answered: a network config that names no network holds nothing",
            container=env.get("CNI_CONTAINERID"),
            reason=problem.msg,
        )
        return ""
    assert isinstance(network, str)
    call = Call(env, network)  # the runtime's own input is checked as for any DEL
    if ledger is None:
        ledger = _unchecked_ledger(raw, problem)
    reason = f"CNI DEL of an invalid network config ({problem.msg})"
    freed = ledger.free(call.attachment, reason) if ledger is not None else []
    log.warning(
        "DEL of an invalid network config: the attachment's addresses freed by its identity",
        attachment=repr(call.attachment),
        freed=freed,
        reason=problem.msg,
    )
    return ""


def _unchecked_ledger(raw: object, problem: IpwardError) -> Ledger | None:
    """In-process, the ledger an invalid config's ADD could have used, or None when
    none (then it holds nothing). A config naming an agent socket was the agent's:
    only the plugin's note says whether an ADD of it reached one (design 5.14)."""
    from ipward.cni import notes
    from ipward.cni.plugin import attachment_note
    from ipward.store import StoreError, StoreMissing, open_store

    ipam = raw.get("ipam") if isinstance(raw, dict) else None
    if not isinstance(ipam, dict):
        return None  # no ipam section: no ADD of it used any store
    if "agentSocket" in ipam or "agent_socket" in ipam:
        if notes.held(attachment_note(raw)):
            raise problem  # an ADD of it reached an agent: the config must be fixed
        return None
    url = ipam.get("store", DEFAULT_STORE)
    if (
        not isinstance(url, str)
        or not url.startswith("sqlite://")
        or text_problem(url, "ipam.store", MAX_PATH)
    ):
        return None
    from ipward.ipam.ledger import Ledger

    try:
        store = open_store(url, create=False, short_lived=True)
    except StoreMissing:
        return None
    except StoreError as e:
        raise IncompatibleStore(f"store not usable: {e}") from e
    return Ledger(store, posix.uname().nodename, short_lived=True)


def _configure_log(raw: object) -> None:
    """Send logs where the config says, before anything else can fail."""
    ipam = raw.get("ipam") if isinstance(raw, dict) else None
    if isinstance(ipam, dict):
        path = ipam.get("logFile") or ipam.get("log_file")
        level = ipam.get("logLevel")
        if isinstance(path, str) and path and "\0" not in path:  # else IpamConfig refuses it
            log.configure(path, level if isinstance(level, str) else "info", "ipward-cni")


def _ledger(config: IpamConfig) -> Ledger:
    if config.agent_socket:
        # The executable forwards every call of such a config to the agent; this is only
        # reached when `ipward.cni.verbs` is run some other way.
        raise InvalidConfig("ipam.agentSocket: this call must go through the ipward-cni plugin")
    from ipward.ipam.ledger import Ledger
    from ipward.store import StoreError, StoreIncompatible, StoreUnreachable, open_store

    if not config.store_url.startswith("sqlite://"):
        raise InvalidConfig(
            f"store {config.store_url!r}: the plugin runs the ledger in-process only on"
            " SQLite (sqlite:///PATH); other stores are reached through an agent"
        )
    try:
        store = open_store(config.store_url, short_lived=True)
        return Ledger(store, config.node, short_lived=True)
    except StoreUnreachable:
        raise  # a TryAgainLater (code 11) itself
    except StoreIncompatible as e:
        raise IncompatibleStore(f"store not usable: {e}") from e
    except StoreError as e:
        raise InvalidConfig(str(e)) from e


def _add(
    ledger: Ledger,
    config: IpamConfig,
    call: Call,
    directory: PodDirectory | None,
    sandboxes: Callable[[str], bool] | None,
) -> dict:
    """ADD: the result for the attachment. One that holds addresses gets them again
    (docs/design.md invariant 4) whatever the config selects now (its ranges changed, a
    pool it names was deleted since), so a refusal of the selection is only given once
    the attachment is known to hold none. The call's own input is refused first,
    whatever it holds."""
    from ipward.cni.selection import choose

    requested = config.requested_ips(call.args)
    try:
        pools, sticky = choose(ledger, config, call, requested, directory, sandboxes)
    except InvalidEnvironment:  # the call's input (a sticky pod without its identity)
        raise
    except IpwardError as refusal:
        held = ledger.lookup(call.attachment)
        if held is None:
            raise
        log.info(
            "retried ADD answered with the addresses it holds",
            attachment=repr(call.attachment),
            ips=[repr(a) for a in held],
            reason=f"the config selects no pool for it now ({refusal.code}: {refusal.msg})",
        )
        pools = [ledger.get_pool(name) for name in dict.fromkeys(a.pool for a in held)]
        return _result(config, pools, held)
    allocations = ledger.allocate(pools, call.attachment, call.pod, requested, sticky)
    return _result(config, pools, allocations)


def _result(config: IpamConfig, pools: list[PoolSpec], allocations: list[Allocation]) -> dict:
    legacy = _version_key(config.cni_version) < (1, 0, 0)
    ips = []
    for a in allocations:
        entry: dict = {"address": f"{a.ip}/{a.prefix}"}
        if a.gateway:
            entry["gateway"] = a.gateway
        if legacy:
            entry["version"] = str(a.family)
        ips.append(entry)
    result: dict = {"cniVersion": config.cni_version, "ips": ips}
    # Routes of the ipam section, else those stored with the pools (an inline pool's
    # are the ipam section's own).
    routes = config.routes or [r for p in pools for r in p.routes]
    if routes:
        result["routes"] = routes
    if config.dns:
        result["dns"] = config.dns
    return result


def _check(ledger: Ledger, call: Call, raw: dict) -> None:
    """CHECK: the attachment must hold addresses, and those the runtime was given."""
    expected = _prev_result_addresses(raw)
    allocations = ledger.lookup(call.attachment)
    if not allocations:
        raise UnknownContainer(f"{call.attachment} has no address allocated")
    held = {a.ip for a in allocations}
    for address in expected:
        if address not in held:
            raise UnknownContainer(
                f"{call.attachment}: prevResult address {address} is not allocated to it"
            )


def _prev_result_addresses(raw: dict) -> list[str]:
    """The addresses of `prevResult.ips` (as the ledger writes them), checked before
    anything is read: a result the runtime kept must be a well-formed one."""
    if "prevResult" not in raw:
        return []
    prev = raw["prevResult"]
    if not isinstance(prev, dict):
        raise InvalidConfig("prevResult must be an object (the result of the ADD)")
    ips = prev.get("ips", [])
    if not isinstance(ips, list):
        raise InvalidConfig("prevResult.ips must be a list")
    addresses = []
    for i, entry in enumerate(ips):
        address = entry.get("address") if isinstance(entry, dict) else None
        if not isinstance(address, str):
            raise InvalidConfig(f"prevResult.ips[{i}].address must be a string (address/prefix)")
        try:
            family, value = parse_ip(address.split("/")[0])
            parse_cidr(address)
        except InvalidConfig as e:
            raise InvalidConfig(f"prevResult.ips[{i}].address: {e.msg}") from None
        addresses.append(format_ip(family, value))
    return addresses


def _gc(config: IpamConfig, raw: dict, ledger: Ledger | None) -> None:
    """GC: free every attachment of this network the runtime does not list as valid."""
    valid = raw.get("cni.dev/valid-attachments")
    if not isinstance(valid, list):
        raise InvalidConfig("GC needs 'cni.dev/valid-attachments' (a list)")
    keep: set[tuple[str, str]] = set()
    for i, entry in enumerate(valid):
        where = f"cni.dev/valid-attachments[{i}]"
        if not isinstance(entry, dict):
            raise InvalidConfig(f"{where} must be an object with 'containerID' and 'ifname'")
        container, ifname = entry.get("containerID"), entry.get("ifname")
        problem = container_id_problem(container) or ifname_problem(ifname)
        if problem:
            raise InvalidConfig(f"{where}: {problem}")
        assert isinstance(container, str) and isinstance(ifname, str)
        keep.add((container, ifname))
    (ledger or _ledger(config)).collect_network(config.network, keep, config.gc_grace)


def _status(config: IpamConfig, ledger: Ledger | None) -> None:
    """STATUS: can an ADD be served now? The store opens and the pools exist."""
    try:
        ledger = ledger or _ledger(config)
        for name in config.pool_names:
            ledger.get_pool(name, fresh=True)
    except IpwardError as e:
        raise NotAvailable(f"cannot serve ADD: {e.msg}") from e


def answer(
    env: dict[str, str],
    stdin: bytes,
    ledger: Ledger | None = None,
    directory: PodDirectory | None = None,
    sandboxes: Callable[[str], bool] | None = None,
) -> tuple[int, str]:
    """One call as the runtime sees it: exit status and stdout. Every failure becomes the
    CNI error object; nothing raises."""
    try:
        return 0, run(env, stdin, ledger, directory, sandboxes)
    except IpwardError as e:
        log.warning(
            e.msg,
            code=e.code,
            command=env.get("CNI_COMMAND"),
            container=env.get("CNI_CONTAINERID"),
            ifname=env.get("CNI_IFNAME"),
        )
        return 1, error_output(e, stdin)
    except Exception as e:  # never a traceback on stdout
        import traceback

        log.error(
            "internal error", command=env.get("CNI_COMMAND"), traceback=traceback.format_exc()
        )
        internal = IpwardError(f"internal error: {type(e).__name__}: {e}")  # code 999
        return 1, error_output(internal, stdin)


def main(stdin: bytes | None = None) -> None:
    """The in-process plugin (single-node mode); `ipward.cni.plugin.main` calls it with the
    stdin it already read. The environment is read as the agent reads a forwarded one
    (`wire.environment`), so both paths judge the same call the same way."""
    from ipward.cni.plugin import read_stdin

    env = environment(posix.environ)
    data = read_stdin() if stdin is None else stdin
    status, out = answer(env, data)
    sys.stdout.write(out)
    sys.stdout.flush()
    posix._exit(status)  # skip interpreter teardown: nothing is left to flush; saves ~1 ms
