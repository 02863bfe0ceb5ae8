"""The machine the labs run on: its tools (looked for on PATH and in the system's sbin
and bin directories, which a root shell's PATH may lack), its mount points and its cgroup
hierarchies."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SYSTEM_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin"]
)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def which(binary: str) -> str | None:
    return shutil.which(binary, path=SYSTEM_PATH)


def mounts_under(prefix: Path) -> list[str]:
    """Mount points at or below `prefix` in this mount namespace, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == str(prefix) or point.startswith(f"{prefix}/"):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def cgroup_hierarchies() -> list[Path]:
    """The root of every mounted cgroup hierarchy: the v2 tree alone, or each v1
    controller's."""
    if (CGROUP_ROOT / "cgroup.procs").exists():
        return [CGROUP_ROOT]
    return [d for d in sorted(CGROUP_ROOT.iterdir()) if (d / "cgroup.procs").exists()]
