"""Container images made on this machine, without a registry.

* Test images (`build_test_image`): static programs compiled here (`gcc -static`), a
  `pause` (the CRI sandbox image) and a `sleep` (the test pods' command), packed as a
  one-layer OCI image layout tarball for `ctr images import`. Used by
  `ipward_lab.containerd.lab` and the cluster lab (`ipward_lab.kubecluster`).
* The ipward image (`build_ipward_image`): the repository's `Containerfile`, built by
  Debian's `buildah` on a base made from Debian's own packages (`debootstrap
  --variant=minbase --include=python3,python3-venv bookworm`, from the Debian source
  the machine's apt uses) and given to the Containerfile as its `BASE` build argument,
  and as its `BUILDER` (the native plugin's build stage installs its compiler there);
  written as a docker-archive tarball for `ctr images import`. Cached by the content of
  what goes into it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from ipward.core.startpath import NATIVE_PLUGIN
from ipward_lab import machine

PAUSE_IMAGE = "ipward.test/pause:lab"
SLEEP_IMAGE = "ipward.test/sleep:lab"
IPWARD_IMAGE = "localhost/ipward:0.1.0"  # deploy/base/kustomization.yaml's `images:`
BASE_IMAGE = "localhost/ipward-base:bookworm"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv")  # venv: the Containerfile makes /opt/ipward
BUILD_TIMEOUT = 1200.0


class ImageError(RuntimeError):
    """An image could not be built (a missing tool, a failed step)."""


def which(binary: str, package: str) -> str:
    found = machine.which(binary)
    if found is None:
        raise ImageError(f"{binary} not found (Debian package {package})")
    return found


def run(args: list[str], timeout: float = 120.0, **kw: Any) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"{' '.join(args)} timed out after {timeout:g}s") from e
    if proc.returncode != 0:
        out = (proc.stderr.strip() or proc.stdout.strip())[-3000:]
        raise ImageError(f"{' '.join(args)} exited {proc.returncode}: {out}")
    return proc.stdout


# -- static programs ----------------------------------------------------------------------

PAUSE_C = r"""
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

static void on_chld(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;)
        pause();
}
"""

# `sleep [SECONDS]`: sleeps that long (forever without an argument), exits 0 at once on
# SIGTERM or SIGINT, so a test pod stops without waiting out its grace period; with
# SLEEP_IGNORE_TERM set in its environment it ignores them (a pod slow to stop: the
# kubelet kills it at the end of its grace period).
SLEEP_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }

int main(int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = getenv("SLEEP_IGNORE_TERM") ? SIG_IGN : on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (argc > 1) {
        unsigned left = (unsigned)strtoul(argv[1], NULL, 10);
        while (left > 0)
            left = sleep(left);
        return 0;
    }
    for (;;)
        pause();
}
"""


def build_static(source: str, out: Path) -> Path:
    """Compile C `source`, static and stripped, into `out`."""
    src = out.with_suffix(".c")
    src.write_text(source)
    try:
        run([which("gcc", "gcc"), "-static", "-Os", "-s", "-o", str(out), str(src)], timeout=120)
    except ImageError as e:
        raise ImageError(
            f"cannot build the static {out.name} (needs gcc and libc6-dev): {e}"
        ) from e
    return out


def build_pause(workdir: Path) -> Path:
    """Compile the pause program, static, into `workdir/pause`."""
    return build_static(PAUSE_C, workdir / "pause")


def _oci_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _tar_add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _tar_add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    info.mtime = 0
    tar.addfile(info)


def build_oci_image(
    programs: dict[str, Path], entrypoint: list[str], out: Path, image_name: str
) -> Path:
    """A one-layer OCI image layout tarball holding each of `programs` at `/NAME`."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for d in ("dev", "etc", "proc", "sys"):
            _tar_add_dir(layer, d)
        for name, path in sorted(programs.items()):
            _tar_add_bytes(layer, name, path.read_bytes(), 0o755)
    layer_tar = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_tar).hexdigest()
    layer_gz = gzip.compress(layer_tar, mtime=0)

    arch = _oci_arch()
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Env": ["PATH=/"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }
    ).encode()
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": blob(config, "application/vnd.oci.image.config.v1+json"),
            "layers": [blob(layer_gz, "application/vnd.oci.image.layer.v1.tar+gzip")],
        }
    ).encode()
    manifest_desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["platform"] = {"architecture": arch, "os": "linux"}
    manifest_desc["annotations"] = {
        "io.containerd.image.name": image_name,
        "org.opencontainers.image.ref.name": image_name.rpartition(":")[2],
    }
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [manifest_desc],
        }
    ).encode()

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        _tar_add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _tar_add_bytes(tar, "index.json", index)
        _tar_add_dir(tar, "blobs")
        _tar_add_dir(tar, "blobs/sha256")
        for digest, data in blobs.items():
            _tar_add_bytes(tar, f"blobs/sha256/{digest}", data)
    return out


def build_pause_image(pause_binary: Path, out: Path, image_name: str = PAUSE_IMAGE) -> Path:
    """A one-layer OCI image layout tarball holding `/pause` as its entrypoint."""
    return build_oci_image({"pause": pause_binary}, ["/pause"], out, image_name)


def build_test_images(workdir: Path) -> list[Path]:
    """The sandbox image (PAUSE_IMAGE) and the test pods' image (SLEEP_IMAGE: `/sleep`,
    forever unless given seconds), as OCI tarballs in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    pause = build_pause(workdir)
    sleep = build_static(SLEEP_C, workdir / "sleep")
    return [
        build_pause_image(pause, workdir / "pause-oci.tar"),
        build_oci_image({"sleep": sleep}, ["/sleep"], workdir / "sleep-oci.tar", SLEEP_IMAGE),
    ]


# -- the ipward image ---------------------------------------------------------------------

BUILD_TOOLS = {"buildah": "buildah", "debootstrap": "debootstrap"}


def missing_build_tools() -> list[str]:
    return [
        f"{tool} (Debian package {package})"
        for tool, package in BUILD_TOOLS.items()
        if machine.which(tool) is None
    ]


def install_build_tools(say: Any = print) -> None:
    """apt-get install buildah and debootstrap when missing (the first image build)."""
    if not missing_build_tools():
        return
    say("installing buildah and debootstrap (Debian packages, first image build only)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], timeout=600, env=env)
    run(
        ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-qq", *BUILD_TOOLS.values()],
        timeout=900,
        env=env,
    )


def debian_mirror() -> str:
    """The Debian archive the machine's apt is configured with (deb822 sources first,
    then sources.list); Debian's own when none is found."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in candidates:
        text = path.read_text(errors="replace")
        for stanza in text.split("\n\n"):
            if re.search(rf"^Suites:.*\b{SUITE}\b", stanza, re.M) and "security" not in stanza:
                found = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
                if found:
                    return found.group(1)
    lists = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*.list")]
    for path in lists:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                url = next(p for p in parts[1:] if not p.startswith("["))
                return url
    return "http://deb.debian.org/debian"


def image_inputs_digest(repo: Path) -> str:
    """A digest of what goes into the ipward image: the Containerfile and what it leaves
    out of its context, the product's pyproject and README, every file under src/ (what
    `pip install .` reads, and the native plugin's source) but the checkout's own build
    of the native plugin (the image builds its own)."""
    h = hashlib.sha256()
    files = [repo / name for name in ("Containerfile", ".containerignore", "pyproject.toml")]
    files.append(repo / "README.md")
    checkouts_build = repo / "src" / "ipward" / NATIVE_PLUGIN
    files += sorted(
        p
        for p in (repo / "src").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p != checkouts_build
    )
    for path in files:
        h.update(str(path.relative_to(repo)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("IPWARD_LAB_CACHE") or Path.home() / ".cache" / "ipward-lab")


class Buildah:
    """buildah on a storage of its own under the cache (never /var/lib/containers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.binary = which("buildah", "buildah")

    def __call__(self, *args: str, timeout: float = BUILD_TIMEOUT, **kw: Any) -> str:
        return run(
            [
                self.binary,
                f"--root={self.root / 'storage'}",
                f"--runroot={self.root / 'run'}",
                "--storage-driver=vfs",
                *args,
            ],
            timeout=timeout,
            **kw,
        )

    def has_image(self, name: str) -> bool:
        out = self("images", "--json", timeout=60)
        return any(name in (image.get("names") or []) for image in json.loads(out or "[]"))


def build_base(buildah: Buildah, workdir: Path, say: Any = print) -> None:
    """BASE_IMAGE: a Debian bookworm root made by debootstrap from the machine's apt
    source, committed by buildah as a one-layer image."""
    mirror = debian_mirror()
    rootfs = workdir / "rootfs"
    say(f"making the base image: debootstrap --variant=minbase {SUITE} from {mirror}")
    run(
        [
            which("debootstrap", "debootstrap"),
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(rootfs),
            mirror,
        ],
        timeout=BUILD_TIMEOUT,
    )
    # What a container's base has no use for (apt's lists and caches, docs).
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        shutil.rmtree(rootfs / junk, ignore_errors=True)
    archive = workdir / "rootfs.tar"
    run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(archive), "."], timeout=600)
    shutil.rmtree(rootfs, ignore_errors=True)
    container = buildah("from", "scratch").strip()
    try:
        buildah("add", container, str(archive), "/")
        buildah(
            "config",
            "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            container,
        )
        buildah("commit", "--rm", container, BASE_IMAGE)
    except BaseException:
        buildah("rm", container, timeout=60)
        raise
    archive.unlink()


CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def ca_bundle_volume() -> list[str]:
    """The machine's CA bundle, lent to the build's RUN steps: where the way out to PyPI
    presents certificates of a local authority (as here), the build trusts what the
    machine trusts (Debian's pip reads this file)."""
    return [f"--volume={CA_BUNDLE}:{CA_BUNDLE}:ro"] if CA_BUNDLE.exists() else []


def build_ipward_image(repo: Path, say: Any = print) -> Path:
    """The ipward image (IPWARD_IMAGE) from `repo`'s Containerfile, as a docker-archive
    tarball in the cache (built again only when its inputs changed)."""
    cache = cache_dir()
    out = cache / f"ipward-image-{image_inputs_digest(repo)}.tar"
    if out.exists():
        return out
    install_build_tools(say)
    cache.mkdir(parents=True, exist_ok=True)
    buildah = Buildah(cache / "buildah")
    with tempfile.TemporaryDirectory(prefix="ipward-image-", dir=cache) as tmp:
        if not buildah.has_image(BASE_IMAGE):
            build_base(buildah, Path(tmp), say)
        say(f"building {IPWARD_IMAGE} from {repo / 'Containerfile'} with buildah")
        buildah(
            "bud",
            "--network=host",  # the build's RUN installs from PyPI
            *ca_bundle_volume(),
            "--pull=never",
            f"--build-arg=BASE={BASE_IMAGE}",
            f"--build-arg=BUILDER={BASE_IMAGE}",
            "--layers=false",
            f"--file={repo / 'Containerfile'}",
            f"--tag={IPWARD_IMAGE}",
            str(repo),
        )
        partial = Path(tmp) / "image.tar"
        buildah("push", IPWARD_IMAGE, f"docker-archive:{partial}:{IPWARD_IMAGE}")
        buildah("rmi", "--prune")  # earlier builds' images, untagged by this one
        for old in cache.glob("ipward-image-*.tar"):
            old.unlink()
        partial.rename(out)
    return out
