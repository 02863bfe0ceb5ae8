"""The soak's checker, on the simulated cluster and the store: all along (`check_once`,
every 0.1 s: no address on two ready pods, no ready pod's record lost, judged only on
sandboxes ready before and after the store was read) and at the end (convergence, an
empty pool after teardown, `ipward check`). Violations are recorded in the run's result
with the address's history."""

from __future__ import annotations

import threading
import time

from ipward.core import keys
from ipward.core import records as rec
from ipward.core.records import AddressRecord
from ipward.ipam.check import check
from ipward.store import Store, StoreError
from ipward_lab.simcluster import SimCluster
from ipward_lab.soak.result import NS, POOL, Result, Violation


class Checker:
    """The checks of one pool's addresses and one namespace's pods (the soak's, or a
    scenario world's: `ipward_lab.soak.world`)."""

    def __init__(
        self, sim: SimCluster, store: Store, result: Result, pool: str = POOL, namespace: str = NS
    ) -> None:
        self.sim = sim
        self.store = store
        self.result = result
        self.pool = pool
        self.namespace = namespace

    def check_once(self) -> list[Violation]:
        """One look: cluster, store, cluster again. A ready pod's address must be
        recorded for its sandbox when the pod was ready both before and after the store
        was read; no two ready pods may share an address."""
        before = self._ready()
        try:
            kvs, revision = self.store.range(keys.ips_prefix(self.pool))
        except StoreError:
            return []  # the store is down (a fault): nothing to compare against
        after = self._ready()
        records = {keys.ip_parts(kv.key)[1]: rec.decode(kv.value) for kv in kvs}
        found = []
        now = time.time()
        for ip, holders in after.items():
            if len(holders) > 1:
                found.append(Violation(now, "shared-address", ip, f"ready pods {sorted(holders)}"))
                continue
            ((sandbox, name),) = holders.items()
            if before.get(ip, {}).get(sandbox) != name:
                continue  # not ready all along: no claim on the store's state
            record = records.get(ip)
            if record is None or record.get("container") != sandbox:
                owner = "nothing" if record is None else f"sandbox {record.get('container')!r}"
                found.append(
                    Violation(
                        now,
                        "live-loss",
                        ip,
                        f"{name} ({sandbox[:12]}) ready, record of {owner} in the read at"
                        f" revision {revision}; {self._again(ip)}",
                    )
                )
        self.result.checks += 1
        return found

    def _again(self, ip: str) -> str:
        """What the store holds of the address now, read alone (a stale read of many
        keys and a lost record look alike until then)."""
        try:
            kv = self.store.get(keys.ip_key(self.pool, ip))
        except StoreError as e:
            return f"read again: {e}"
        if kv is None:
            return "read again: no record"
        holder = rec.decode(kv.value).get("container")
        return f"read again: the record of {holder!r} at revision {kv.mod_revision}"

    def _ready(self) -> dict[str, dict[str, str]]:
        """address -> {sandbox: pod name} of the pods ready now."""
        out: dict[str, dict[str, str]] = {}
        for ip, pods in self.sim.ready_addresses().items():
            for pod in pods:
                sandboxes = self.sim.sandboxes_of(pod)
                if sandboxes:
                    out.setdefault(ip, {})[sandboxes[-1]] = pod.name
        return out

    def history(self, ip: str, wait: float = 3.0) -> list[str]:
        """Every version of the address's record, with its revision."""
        key = keys.ip_key(self.pool, ip)
        end = self.store.revision()
        watch = self.store.watch(key, 1)
        timer = threading.Timer(wait, watch.cancel)
        timer.start()
        lines = []
        try:
            for event in watch:
                if event.kv.key == key:
                    value = event.kv.value.decode(errors="replace") or "(deleted)"
                    lines.append(f"rev {event.kv.mod_revision} {event.kind}: {value}")
                if event.kv.mod_revision >= end:
                    break
        except StoreError as e:
            lines.append(f"(history cut short: {e})")
        finally:
            timer.cancel()
            watch.cancel()
        return lines

    def record(self, found: list[Violation]) -> None:
        """Add what is new in `found` to the result, each with its address's history."""
        known = {(v.kind, v.address) for v in self.result.violations}
        for v in found:
            if (v.kind, v.address) not in known:
                v.history = self.history(v.address)
                self.result.violations.append(v)
                known.add((v.kind, v.address))

    def converged(self) -> bool:
        waiting, held, bound = self._state()
        return not waiting and held == bound

    def why_not(self) -> str:
        waiting, held, bound = self._state()
        return (
            f"pods not running: {waiting[:10]}; recorded, no pod: {sorted(bound - held)[:10]};"
            f" pods without record: {sorted(held - bound)[:10]}"
        )

    def _state(self) -> tuple[list[str], set[str], set[str]]:
        """(pods not running, addresses the pods hold, addresses recorded for a sandbox:
        detached sticky records aside)."""
        pods = self.sim.pods(self.namespace)
        waiting = [f"{p.name}:{p.phase}" for p in pods if p.phase != "Running" and not p.terminal]
        held = {a for p in pods if (a := self.sim.address_of(p)) is not None}
        bound = {
            keys.ip_parts(kv.key)[1]
            for kv in self.store.range(keys.ips_prefix(self.pool))[0]
            if not AddressRecord.decode(kv.value).is_detached
        }
        return waiting, held, bound

    def empty(self) -> bool:
        return (
            not self.sim.pods(self.namespace)
            and not self.store.range(keys.ips_prefix(self.pool))[0]
            and not self.store.range(keys.STICKY)[0]
        )

    def store_problems(self) -> list[Violation]:
        problems, _ = check(self.store)
        self.result.checks += 1
        return [Violation(time.time(), "check", p.key, f"{p.kind}: {p.detail}") for p in problems]
