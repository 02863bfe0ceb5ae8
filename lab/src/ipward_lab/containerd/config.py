"""containerd 1.6's configuration for the labs: the CRI plugin with runc (cgroupfs), the
CNI dirs given, `restrict_oom_score_adj` (this kernel refuses a negative
`oom_score_adj`, so runc fails every sandbox without it) and the sandboxes' network
namespaces under the state dir. Used by `ipward_lab.containerd.lab` and by each node of the
cluster lab (`ipward_lab.kubecluster`)."""

from __future__ import annotations

import json
from pathlib import Path

from ipward_lab.containerd.images import PAUSE_IMAGE

# What a lab running containerd on this configuration, with the images compiled here,
# needs of the machine: binary -> the Debian package that provides it.
CONTAINERD_TOOLS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "gcc": "gcc",
}


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for these paths


def containerd_config(
    root: Path,
    state: Path,
    address: Path,
    runc_root: Path,
    opt_dir: Path,
    cni_bin: Path,
    cni_conf: Path,
    runc: str,
    image: str = PAUSE_IMAGE,
) -> str:
    q = _toml_str
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = {q(str(root))}
state = {q(str(state))}
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = {q(str(address))}

[ttrpc]
  address = {q(str(address) + ".ttrpc")}

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = {q(str(opt_dir))}
  [plugins."io.containerd.runtime.v1.linux"]
    runtime_root = {q(str(runc_root) + "-v1")}
  [{cri}]
    sandbox_image = {q(image)}
    disable_apparmor = true
    restrict_oom_score_adj = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    netns_mounts_under_state_dir = true
    [{cri}.containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [{cri}.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [{cri}.containerd.runtimes.runc.options]
          SystemdCgroup = false
          BinaryName = {q(runc)}
          Root = {q(str(runc_root))}
    [{cri}.cni]
      bin_dir = {q(str(cni_bin))}
      conf_dir = {q(str(cni_conf))}
      max_conf_num = 1
"""
