"""How the lab reaches the cluster, from the control plane's network namespace (the only
one where the API and ipward's store answer): the API as the admin, kubectl, the ipward
CLI against the deployed store, an endpoint's Prometheus samples."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ipward_lab.kubecluster.common import CALL_TIMEOUT, ClusterError, wait_for
from ipward_lab.kubecluster.netns import in_netns
from ipward_lab.kubecluster.prerequisites import kubectl_binary
from ipward_lab.kubecluster.state import ClusterState

KUBECTL_TIMEOUT = 120.0


class Clients:
    def __init__(self, lab: ClusterState) -> None:
        self.lab = lab

    def api(self, path: str, timeout: float = 10.0) -> Any:
        """GET `path` of the API as the admin (from the control plane's namespace)."""

        def get() -> Any:
            context = ssl.create_default_context(cafile=str(self.lab.pki_dir / "ca.crt"))
            request = urllib.request.Request(
                f"{self.lab.api_url}{path}",
                headers={"Authorization": f"Bearer {self.lab.info['admin_token']}"},
            )
            with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
                body = answer.read()
            try:
                return json.loads(body)
            except ValueError:
                return body.decode(errors="replace")

        return in_netns(self.lab.cp_netns, get)

    def kubectl(
        self, *args: str, timeout: float = KUBECTL_TIMEOUT, check: bool = True, input: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """kubectl with the admin kubeconfig, run where the API is reached."""
        argv = self.lab.in_cp([kubectl_binary(), f"--kubeconfig={self.lab.kubeconfig}", *args])
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, input=input or None
        )
        if check and proc.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def make_namespace(self, name: str) -> None:
        """Namespace `name`, once its default ServiceAccount exists (a pod made before
        it is refused)."""
        self.kubectl("create", "namespace", name)
        wait_for(
            lambda: (
                self.kubectl(
                    f"--namespace={name}", "get", "serviceaccount", "default", check=False
                ).returncode
                == 0
            ),
            f"{name}'s default ServiceAccount",
            60.0,
            0.5,
        )

    def ipward_argv(self, args: Sequence[str]) -> list[str]:
        """The ipward CLI against the deployed store, where the store is reached."""
        ipward = str(Path(sys.executable).parent / "ipward")
        return self.lab.in_cp([ipward, "--store", self.lab.ipward_store_url, *args])

    def ipward_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The ipward CLI against the deployed store; ClusterError on a non-zero exit
        with `check`."""
        env = {k: v for k, v in os.environ.items() if k != "IPWARD_STORE"}
        proc = subprocess.run(
            self.ipward_argv(args), capture_output=True, text=True, timeout=CALL_TIMEOUT, env=env
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"ipward {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def metrics(self, address: str, port: int) -> dict[str, float]:
        """The Prometheus samples at http://ADDRESS:PORT/metrics (an agent on its node's
        address, 9310; a controller on its pod's, 9311), read from the control plane's
        namespace: {`name{labels}`: value}."""

        def get() -> str:
            url = f"http://{address}:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as answer:
                return str(answer.read().decode())

        samples = {}
        for line in in_netns(self.lab.cp_netns, get).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples
