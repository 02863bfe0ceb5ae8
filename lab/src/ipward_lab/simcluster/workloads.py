"""Owners and the scheduler of the simulated cluster: Deployments (surge, rolling
restarts), StatefulSets (OrderedReady or Parallel), Jobs (completions, parallelism, TTL),
reconciled on every tick, and the binding of pods to nodes."""

from __future__ import annotations

from ipward_lab.simcluster.model import (
    OWNER_KINDS,
    ClusterModel,
    Deployment,
    Job,
    Owner,
    SimPod,
    StatefulSet,
    checked_annotations,
)


class Workloads(ClusterModel):
    def create_deployment(
        self,
        namespace: str,
        name: str,
        replicas: int,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods named `<name>-<5 random letters>`, kept at `replicas`; `annotations`: the
        pod template's, a copy for every pod of the Deployment."""
        self._add_owner(
            Deployment(
                namespace,
                name,
                replicas,
                node or "",
                self._grace(grace),
                annotations=checked_annotations(annotations),
            )
        )

    def create_statefulset(
        self,
        namespace: str,
        name: str,
        replicas: int,
        ordered: bool = True,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods named `<name>-<ordinal>`. `ordered` (OrderedReady): one pod at a time, up
        from the lowest missing ordinal once the lower ones are ready, down from the
        highest once no pod of the set is terminating. Otherwise (Parallel): all at once.
        A pod gone from the API is recreated under its name with a new UID. Pods are
        published with `owner_kind` "StatefulSet" and `owner_name` `name`, the set as
        "statefulsets": {"namespace/name": replicas} (following `scale`, gone with
        `delete_statefulset`). `annotations`: the pod template's, a copy for every pod."""
        self._add_owner(
            StatefulSet(
                namespace,
                name,
                replicas,
                ordered,
                node or "",
                self._grace(grace),
                annotations=checked_annotations(annotations),
            )
        )

    def create_job(
        self,
        namespace: str,
        name: str,
        completions: int = 1,
        parallelism: int = 1,
        duration: float = 1.0,
        ttl_after_finished: float | None = None,
        node: str | None = None,
        grace: float | None = None,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Pods run `duration` seconds, then are Succeeded (their sandbox stopped, listed
        not ready, no DEL: the address stays allocated, as with a real completed pod);
        `ttl_after_finished` seconds after the last completion the pods are deleted
        (None: kept). `annotations`: the pod template's, a copy for every pod."""
        self._add_owner(
            Job(
                namespace,
                name,
                completions,
                parallelism,
                duration,
                ttl_after_finished,
                node or "",
                self._grace(grace),
                annotations=checked_annotations(annotations),
            )
        )

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set a Deployment's or StatefulSet's replicas."""
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        with self._mutate():
            owner = self._owner(namespace, name)
            if isinstance(owner, Job):
                raise ValueError(f"{namespace}/{name} is a Job")
            owner.replicas = replicas
            self._event("owner", f"scaled {namespace}/{name} to {replicas}")

    def rolling_restart(self, namespace: str, name: str) -> None:
        """Replace every pod of a Deployment: new pods first, each old one deleted as a
        new one is ready."""
        with self._mutate():
            owner = self._owner(namespace, name)
            if not isinstance(owner, Deployment):
                raise ValueError(f"{namespace}/{name} is not a Deployment")
            owner.generation += 1
            self._event("owner", f"rolling restart {namespace}/{name}")

    def delete_statefulset(self, namespace: str, name: str) -> None:
        """The set leaves the API (and the published `statefulsets`); its pods are
        deleted, all at once, with their grace."""
        self._delete_owner(namespace, name, StatefulSet)

    def delete_deployment(self, namespace: str, name: str) -> None:
        """The Deployment leaves the API; its pods are deleted, all at once."""
        self._delete_owner(namespace, name, Deployment)

    def delete_job(self, namespace: str, name: str) -> None:
        """The Job leaves the API; its pods, running or finished, are deleted."""
        self._delete_owner(namespace, name, Job)

    def _delete_owner(self, namespace: str, name: str, kind: type) -> None:
        with self._mutate():
            owner = self._owner(namespace, name)
            if not isinstance(owner, kind):
                raise ValueError(f"{namespace}/{name} is not a {kind.__name__}")
            del self._owners[f"{namespace}/{name}"]
            now = self.clock()
            for pod in self._owned(owner):
                self._delete(pod, now)
            self._event("owner", f"deleted {kind.__name__} {namespace}/{name}")

    # -- reconciling (under the lock) ------------------------------------------------

    def _add_owner(self, owner: Owner) -> None:
        if isinstance(owner, Job):
            if owner.completions < 1 or owner.parallelism < 1 or owner.duration < 0:
                raise ValueError("a Job needs completions, parallelism >= 1, duration >= 0")
        elif owner.replicas < 0:
            raise ValueError("replicas must be >= 0")
        with self._mutate():
            key = f"{owner.namespace}/{owner.name}"
            if key in self._owners:
                raise ValueError(f"{key} exists")
            self._owners[key] = owner
            self._event("owner", f"created {OWNER_KINDS[type(owner)]} {key}")

    def _owner(self, namespace: str, name: str) -> Owner:
        try:
            return self._owners[f"{namespace}/{name}"]
        except KeyError:
            raise KeyError(f"no owner {namespace}/{name}") from None

    def _owned(self, owner: Owner) -> list[SimPod]:
        kind = OWNER_KINDS[type(owner)]
        return sorted(
            (
                p
                for p in self._pods.values()
                if p.owner_kind == kind
                and p.owner_name == owner.name
                and p.namespace == owner.namespace
            ),
            key=lambda p: p.seq,
        )

    def _reconcile_owners(self, now: float) -> bool:
        changed = False
        for owner in list(self._owners.values()):
            pods = self._owned(owner)
            if isinstance(owner, Deployment):
                changed |= self._reconcile_deployment(owner, pods, now)
            elif isinstance(owner, StatefulSet):
                changed |= self._reconcile_statefulset(owner, pods, now)
            else:
                changed |= self._reconcile_job(owner, pods, now)
        return changed

    def _reconcile_deployment(self, d: Deployment, pods: list[SimPod], now: float) -> bool:
        live = [p for p in pods if p.deleted_at is None]
        current = [p for p in live if p.generation == d.generation]
        old = [p for p in live if p.generation != d.generation]
        missing = d.replicas - len(current)
        for _ in range(missing):
            name = self._random_name(d.namespace, d.name)
            self._new_pod(d.namespace, name, d.node, d.grace, d, generation=d.generation)
        surplus = sorted(current, key=self._deletion_order)[: max(-missing, 0)]
        # Old pods go only as new ones are ready: never fewer ready than replicas.
        ready_new = min(sum(self._ready(p) for p in current), d.replicas)
        retired = sorted(old, key=self._deletion_order)[: max(len(old) + ready_new - d.replicas, 0)]
        for pod in surplus + retired:
            self._delete(pod, now)
        return bool(missing > 0 or surplus or retired)

    def _deletion_order(self, pod: SimPod) -> tuple[bool, int]:
        """As a ReplicaSet picks pods to delete: not ready before ready, newest first."""
        return self._ready(pod), -pod.seq

    def _reconcile_statefulset(self, s: StatefulSet, pods: list[SimPod], now: float) -> bool:
        by_ordinal = {p.ordinal: p for p in pods}  # terminating ones too: names are taken
        condemned = sorted((o for o in by_ordinal if o >= s.replicas), reverse=True)
        if s.ordered:
            if any(p.deleted_at is not None for p in pods):
                return False  # wait for it to leave the API
            if condemned:
                self._delete(by_ordinal[condemned[0]], now)
                return True
            for ordinal in range(s.replicas):
                pod = by_ordinal.get(ordinal)
                if pod is None:
                    self._new_statefulset_pod(s, ordinal)
                    return True
                if not self._ready(pod):
                    return False
            return False
        changed = False
        for ordinal in condemned:
            if by_ordinal[ordinal].deleted_at is None:
                self._delete(by_ordinal[ordinal], now)
                changed = True
        for ordinal in range(s.replicas):
            if ordinal not in by_ordinal:
                self._new_statefulset_pod(s, ordinal)
                changed = True
        return changed

    def _new_statefulset_pod(self, s: StatefulSet, ordinal: int) -> None:
        self._new_pod(s.namespace, f"{s.name}-{ordinal}", s.node, s.grace, s, ordinal=ordinal)

    def _reconcile_job(self, j: Job, pods: list[SimPod], now: float) -> bool:
        if j.finished_at is None:
            if j.succeeded >= j.completions:
                j.finished_at = now
                self._event("owner", f"Job {j.namespace}/{j.name} complete")
                return True
            active = sum(1 for p in pods if p.deleted_at is None and not p.terminal)
            wanted = min(j.parallelism, j.completions - j.succeeded) - active
            for _ in range(wanted):
                name = self._random_name(j.namespace, j.name)
                self._new_pod(j.namespace, name, j.node, j.grace, j, duration=j.duration)
            return wanted > 0
        if j.ttl_after_finished is not None and now >= j.finished_at + j.ttl_after_finished:
            del self._owners[f"{j.namespace}/{j.name}"]
            for pod in pods:
                self._delete(pod, now)
            self._event("owner", f"Job {j.namespace}/{j.name} deleted after its TTL")
            return True
        return False

    def _schedule(self) -> bool:
        """Bind unscheduled pods: the fixed node if it is in the cluster, else the live
        node with the fewest pods. An unscheduled pod that is deleted just goes."""
        changed = False
        load = {n.name: 0 for n in self._nodes.values() if n.up}
        for pod in self._pods.values():
            if pod.node in load and pod.deleted_at is None:
                load[pod.node] += 1
        for pod in sorted(self._pods.values(), key=lambda p: p.seq):
            if pod.node:
                continue
            if pod.deleted_at is not None:
                self._forget(pod, "deleted before it was scheduled")
                changed = True
            elif pod.fixed_node:
                if pod.fixed_node in self._nodes:
                    pod.node = pod.fixed_node
                    changed = True
            elif load:
                pod.node = min(load, key=lambda n: (load[n], n))
                load[pod.node] += 1
                changed = True
        return changed
