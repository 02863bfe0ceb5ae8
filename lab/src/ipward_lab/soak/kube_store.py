"""The soak's `--store k8s`: ipward's ledger on the Kubernetes store, on a real
kube-apiserver of its own (KUBE_APISERVER; not the one the cluster may be published to),
and the faults of that API server:

  store-api-kill   SIGKILL, started again 3 s later (writes in flight may or may not
                   have been applied; watches break; everyone retries)
  store-conflicts  for 5 s, another ipward writer rewrites every ledger object as it is
                   (as a lease's keep-alive does), as fast as it can: the agents' and the
                   controllers' compare-and-swap updates meet 409s. (Not a foreign write
                   such as an annotation: an object's revisions written as "this update"
                   are read as its resourceVersion, which a foreign update would move;
                   the ledger's objects are ipward's alone.)
  store-relist     an agent paused (SIGSTOP) for 12 s, past the end the server gives
                   its watches (10 s); meanwhile an object no ledger watch sees written
                   and the etcd compacted to that revision. Resumed, the agent resumes
                   its watch where it was, a revision the server no longer has, is
                   answered 410, and its follower reads the ledger whole again (a
                   violation unless one does within 20 s)

The API server serves watches from etcd (`--watch-cache=false`, as for a resource it
does not cache), so that a compaction is what a resuming watch meets; with its cache,
the window of events it keeps decides instead, which a run cannot time. A watch that
keeps hearing its own objects' changes moves past any compaction: only a client that
heard nothing for a while (paused, as by a long GC pause or a frozen VM) resumes behind
it, which is what the fault makes.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from ipward.core import shards
from ipward.kubeapi.client import ApiClient, ApiError
from ipward.kubeapi.config import from_kubeconfig
from ipward.store import StoreError
from ipward.store.kube import DEFAULT_NAMESPACE, KubeStore
from ipward.store.kube.objects import Conflict
from ipward_lab.servers import kube_apiserver, kube_store
from ipward_lab.servers.etcd import run_etcdctl
from ipward_lab.soak.result import SoakError

KILLED_FOR = 3.0  # seconds the store's API server stays down after store-api-kill
STORM = 5.0  # seconds of store-conflicts
PAUSED = 12.0  # seconds store-relist pauses an agent: past its watch's end (10 s)
RELIST_WAIT = 20.0  # seconds from its resumption for a follower to meet the 410


class KubeStoreSide:
    """The store's API server, started on entering `exits`; its URL in `url`."""

    def __init__(self, workdir: Path, exits: contextlib.ExitStack) -> None:
        executable = kube_apiserver.binary()
        if executable is None:
            raise SoakError("--store k8s needs KUBE_APISERVER naming a kube-apiserver binary")
        where = workdir / "store-api"
        where.mkdir(exist_ok=True)
        self.lab = exits.enter_context(kube_apiserver.kube_apiserver(executable, where))
        self.lab.stop()  # again, watches from etcd
        self.lab.args.append("--watch-cache=false")
        self.lab.start()
        self.lab.wait_ready()
        kube_store.install(self.lab.kubeconfig, DEFAULT_NAMESPACE)
        self.url = kube_store.store_url(self.lab.kubeconfig, DEFAULT_NAMESPACE)
        etcd = next(a for a in self.lab.args if a.startswith("--etcd-servers="))
        self.etcd = etcd.partition("=")[2].removeprefix("http://")
        self.client = ApiClient(from_kubeconfig(str(self.lab.kubeconfig)), timeout=5.0)
        exits.callback(self.client.close)
        self.writer = KubeStore(self.url)  # the storm's
        exits.callback(self.writer.close)

    def kill(self) -> None:
        assert self.lab.proc is not None
        self.lab.proc.kill()
        self.lab.proc.wait()

    def start(self) -> None:
        """Started again, not waited for: everyone retries until it answers."""
        self.lab.start()

    def compact(self) -> None:
        """An object outside the ledger written, then its etcd compacted to the current
        revision: what every ledger watch would resume from is gone."""
        path = f"/api/v1/namespaces/{DEFAULT_NAMESPACE}/configmaps"
        marker = {"metadata": {"name": "soak-relist"}, "data": {"at": str(time.time())}}
        try:
            self.client.request("PUT", f"{path}/soak-relist", body=marker)
        except ApiError as e:
            if e.status != 404:
                raise
            self.client.request("POST", path, body=marker)
        status = json.loads(run_etcdctl([self.etcd], "endpoint", "status", "-w", "json"))
        revision = status[0]["Status"]["header"]["revision"]
        run_etcdctl([self.etcd], "compact", str(revision))

    def storm(self) -> None:
        """STORM seconds of another writer's updates to every ledger object, in a thread."""
        threading.Thread(target=self._storm, name="store-conflicts", daemon=True).start()

    def _storm(self) -> None:
        deadline = time.monotonic() + STORM
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                for shard in self.writer.objects.scope(shards.EVERYTHING)[0]:
                    with contextlib.suppress(Conflict, StoreError):  # ipward's came first
                        self.writer.committer.write_as_is(shard)
