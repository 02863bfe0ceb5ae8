"""Which pools an ADD allocates from, and whether its address is sticky. On the
plugin's path: stdlib only.

Pools, first match wins:
  1. an address requested by the runtime (`runtimeConfig.ips`, `args.cni.ips`, CNI_ARGS
     `IP=`): the pools chosen below when they hold it, else the pool that does;
  2. the pod's annotation `ipward.io/pool` (a name, or a comma list: one pool per family);
  3. its namespace's annotation `ipward.io/pool`;
  4. the pool of the CNI config (`pool`, or its inline ranges).
Every pool chosen must serve the pod's namespace and this node (`PoolSpec.namespaces`,
`PoolSpec.nodes`), else the ADD fails with code 105 and writes nothing; a list of pools
holds one pool per family (an attachment gets one address of each), else code 7.

Sticky: the CNI config says `"sticky": true`, or the pod's owner is a StatefulSet, or the
pod is annotated `ipward.io/sticky: "true"`. The identity is (network, pod namespace,
pod name). A StatefulSet's reservation lives as long as its ordinal is in range; any
other lives `stickyTTL` seconds past its last sandbox.

Annotations and owners come from a `PodDirectory` (`ipward.cluster.pods`: the agent's
`--cluster` source);
without one, only the config decides. A directory that cannot answer makes the ADD fail
with code 11: a pod is never put in a pool it did not ask for.
"""

from __future__ import annotations

from ipward.cni.config import pool_name
from ipward.core.addr import parse_ip
from ipward.core.errors import (
    AddressOutsidePool,
    InvalidConfig,
    InvalidEnvironment,
    IpwardError,
    TryAgainLater,
    UnknownPool,
)
from ipward.core.pool import check_one_per_family
from ipward.core.records import Sticky

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from ipward.cluster.pods import PodDirectory, PodMeta
    from ipward.cni.config import Call, IpamConfig
    from ipward.core.pool import PoolSpec
    from ipward.ipam.ledger import Ledger

POOL_ANNOTATION = "ipward.io/pool"
STICKY_ANNOTATION = "ipward.io/sticky"


def choose(
    ledger: Ledger,
    config: IpamConfig,
    call: Call,
    requested: list[str],
    directory: PodDirectory | None,
    sandboxes: Callable[[str], bool] | None = None,
) -> tuple[list[PoolSpec], Sticky | None]:
    """(pools, sticky identity or None) for an ADD of the `requested` addresses;
    `sandboxes`: whether this node's runtime lists a sandbox (`Sticky.sandbox_listed`)."""
    pod = call.pod
    meta = directory.meta(pod.namespace, pod.name, pod.uid) if directory and pod.name else None
    annotated, where = _annotated(meta, pod.namespace, pod.name)
    try:
        pools = _pools(ledger, config, annotated, requested, pod.namespace, fresh=False)
    except TryAgainLater:
        raise
    except IpwardError:
        # Maybe judged on pool specs a long-lived ledger remembers (an agent's): a
        # refusal is only given on the pools as stored now.
        try:
            pools = _pools(ledger, config, annotated, requested, pod.namespace, fresh=True)
        except TryAgainLater:
            raise
        except IpwardError as refusal:
            if not annotated:
                raise
            # The annotation chose: its refusal says which annotation of which pod.
            raise type(refusal)(f"{where}: {refusal.msg}", refusal.details) from None
    if annotated:
        _check_gateway_bridge(config, pools, where)
    return pools, _sticky(config, call, meta, directory, sandboxes)


def _pools(
    ledger: Ledger,
    config: IpamConfig,
    annotated: list[str],
    requested: list[str],
    namespace: str,
    fresh: bool,
) -> list[PoolSpec]:
    """The pools annotated, else the config's; then those holding the requested
    addresses; one per family, each allowed here."""
    if annotated:
        pools = [ledger.get_pool(n, fresh) for n in annotated]
    elif config.inline_pool is not None:
        pools = [config.inline_pool]  # stored by the allocating transaction itself
    else:
        pools = [ledger.get_pool(n, fresh) for n in config.pool_names]
    if requested:
        pools = _holding(ledger, pools, requested)
    check_one_per_family(pools)
    for pool in pools:
        pool.check_allowed(namespace, ledger.node)
    return pools


def _annotated(meta: PodMeta | None, namespace: str, name: str) -> tuple[list[str], str]:
    """The pool names of the pod's annotation, else of its namespace's, and which
    annotation of which pod that is; a name no pool can have is the annotation's mistake
    (7), not an unknown pool (103), and so is an annotation that names no pool at all
    (`""`, `" , "`): it would otherwise fall back to the next choice without a word."""
    if meta is None:
        return [], ""
    pod = f"pod {namespace}/{name}"
    value, whose = meta.annotations.get(POOL_ANNOTATION), pod
    if value is None:
        value = meta.namespace_annotations.get(POOL_ANNOTATION)
        whose = f"namespace {namespace} (for {pod})"
    if value is None:
        return [], ""
    where = f"annotation {POOL_ANNOTATION} of {whose}"
    names = [pool_name(n, where) for n in value.split(",") if n.strip()]
    if not names:
        raise InvalidConfig(
            f"{where} is {value!r}: it names no pool; name one (or a comma list, one per"
            " family), or remove it to use the namespace's or the network's pool"
        )
    return names, where


def _check_gateway_bridge(config: IpamConfig, pools: list[PoolSpec], where: str) -> None:
    """A `bridge` network with `isGateway` (or `isDefaultGateway`) puts its pool's IPv4
    gateway on the bridge, which holds one IPv4 address: a pod of another IPv4 pool can
    never start there (the bridge refuses its gateway, and the runtime retries forever).
    So an annotation may choose only the network's own IPv4 pool there (7 otherwise;
    IPv6 pools may differ: the bridge holds one address per IPv6 subnet)."""
    raw = config.raw
    if raw.get("type") != "bridge" or not (raw.get("isGateway") or raw.get("isDefaultGateway")):
        return
    own = [config.inline_pool.name] if config.inline_pool is not None else config.pool_names
    foreign = [p.name for p in pools if p.name not in own and p.set_of(4) is not None]
    if foreign:
        raise InvalidConfig(
            f"{where} chooses IPv4 pool {foreign[0]} on network {config.network}, a bridge"
            f" with isGateway: the bridge holds one IPv4 gateway (pool {', '.join(own)}'s),"
            f" so no pod of another IPv4 pool can start on it; give pool {foreign[0]} a"
            " network of its own (another bridge, or a Multus attachment)"
        )


def _holding(ledger: Ledger, pools: list[PoolSpec], requested: list[str]) -> list[PoolSpec]:
    """The chosen pools when they hold every requested address; else, per address, the
    pool that holds it. A chosen pool is judged as chosen only: its stored spec may be
    an earlier version of it (an inline network whose ranges changed), whose addresses
    new pods no longer get."""

    def holds(pool: PoolSpec, text: str) -> bool:
        family, value = parse_ip(text)
        index = pool.set_of(family)
        return index is not None and pool.range_sets[index].usable(value)

    if all(any(holds(p, ip) for p in pools) for ip in requested):
        return pools
    found: list[PoolSpec] = []
    chosen = {p.name for p in pools}
    stored = ledger.stored_pools()
    # A chosen pool as remembered (an agent's) may be gone: named, it must still be
    # there, whichever pool the address is then taken from.
    names = {p.name for p in stored}
    gone = next((p.name for p in pools if p.revision is not None and p.name not in names), None)
    if gone is not None:
        raise UnknownPool(f"pool {gone!r} does not exist (create it with 'ipward pool create')")
    others = [p for p in stored if p.name not in chosen]
    for ip in requested:
        pool = next((p for p in [*pools, *others] if holds(p, ip)), None)
        if pool is None:
            raise AddressOutsidePool(f"requested address {ip} is in no pool")
        if all(p.name != pool.name for p in found):
            found.append(pool)
    return found


def _sticky(
    config: IpamConfig,
    call: Call,
    meta: PodMeta | None,
    directory: PodDirectory | None,
    sandboxes: Callable[[str], bool] | None,
) -> Sticky | None:
    stateful = meta is not None and meta.owner_kind == "StatefulSet"
    asked = meta is not None and meta.annotations.get(STICKY_ANNOTATION, "").lower() == "true"
    if not (config.sticky or stateful or asked):
        return None
    pod = call.pod
    if not pod.namespace or not pod.name:
        raise InvalidEnvironment(
            "a sticky address needs the pod's identity: K8S_POD_NAMESPACE and K8S_POD_NAME"
            " in CNI_ARGS"
        )
    return Sticky(
        config.network,
        pod.namespace,
        pod.name,
        owner_kind=meta.owner_kind if meta is not None else "",
        owner_name=meta.owner_name if meta is not None else "",
        ttl=None if stateful else config.sticky_ttl,
        may_take=None
        if directory is None
        else (lambda uid: not directory.listed(pod.namespace, pod.name, uid)),
        sandbox_listed=sandboxes,
    )
