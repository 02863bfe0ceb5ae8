"""What other distributions add to the product through its entry point groups
(`ipward.extensions`): the labs' commands (demo, sim, bench) and their `sim://` liveness
source are there with the lab installed, and simply absent from the product alone (run
here with the lab's files hidden from the interpreter); any distribution can add its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ipward.cluster.liveness import open_source
from ipward.core.errors import InvalidConfig
from ipward_lab.fleet import IPWARD
from ipward_lab.simcluster import SimFileSource
from support import REPO

LAB_COMMANDS = ("bench", "demo", "sim")


def listed_commands(help_text: str) -> set[str]:
    section = help_text.split("Commands:", 1)[1]
    return {line.split()[0] for line in section.splitlines() if line.strip()}


def run(argv: list[str], pythonpath: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [*argv, *extra], capture_output=True, text=True, env=env, timeout=60, check=False
    )


@pytest.fixture
def product_alone(tmp_path: Path) -> str:
    """A PYTHONPATH for `python -S` (no site, so no .pth and no editable lab): the
    product's source and the installed packages but the lab's own files."""
    site = Path(click.__file__).resolve().parent.parent
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in site.iterdir():
        if "ipward_lab" not in entry.name.replace("-", "_"):
            (view / entry.name).symlink_to(entry)
    return f"{REPO / 'src'}:{view}"


def test_the_lab_adds_its_commands() -> None:
    done = subprocess.run([*IPWARD, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = listed_commands(done.stdout)
    assert {"agent", "controller", "pool", *LAB_COMMANDS} <= commands


def test_without_the_lab_its_commands_and_source_are_absent(product_alone: str) -> None:
    python = [sys.executable, "-S"]
    hidden = run(python, product_alone, "-c", "import ipward_lab")
    assert hidden.returncode != 0 and "No module named 'ipward_lab'" in hidden.stderr
    listed = run([*python, "-m", "ipward"], product_alone, "--help")
    assert listed.returncode == 0, listed.stderr
    commands = listed_commands(listed.stdout)
    assert {"agent", "controller", "pool"} <= commands and not commands & set(LAB_COMMANDS)
    missing = run([*python, "-m", "ipward"], product_alone, "sim")
    assert missing.returncode == 2 and "No such command 'sim'" in missing.stderr
    source = run(
        python,
        product_alone,
        "-c",
        "from ipward.cluster.liveness import open_source\n"
        "try:\n    open_source('sim:///x')\nexcept Exception as e:\n    print(e)",
    )
    assert "unknown scheme 'sim' (known: cri://, k8s://)" in source.stdout, source


def test_the_lab_adds_the_sim_source(tmp_path: Path) -> None:
    source = open_source(f"sim://{tmp_path}/state.json", timeout=0.5)
    assert isinstance(source, SimFileSource) and source.path == f"{tmp_path}/state.json"


@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("nosuch://x", "unknown scheme 'nosuch' (known: cri://, k8s://, sim://)"),
        ("/run/containerd/containerd.sock", "not a URL (known: cri://, k8s://, sim://)"),
        ("cri://", "expected cri:///PATH"),
        ("sim://", "expected sim:///PATH"),
    ],
)
def test_a_bad_liveness_url_names_the_known_schemes(url: str, what: str) -> None:
    with pytest.raises(InvalidConfig) as raised:
        open_source(url)
    assert what in raised.value.msg


EXTRA_MODULE = """\
import click
from ipward.cluster.liveness import LivenessSource


@click.command()
def hello():
    click.echo("hello from extra_demo")


class Nothing(LivenessSource):
    def node_view(self, node):
        raise NotImplementedError

    def cluster_view(self):
        raise NotImplementedError


def open_nothing(url, node="", timeout=2.0):
    return Nothing()
"""


def test_any_distribution_can_add_a_command_and_a_source(tmp_path: Path) -> None:
    """A distribution of a module and two files of metadata: its command is listed and
    runs, its scheme opens, beside the lab's."""
    (tmp_path / "extra_demo.py").write_text(EXTRA_MODULE)
    dist = tmp_path / "extra_demo-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-demo\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[ipward.commands]\nhello = extra_demo:hello\n\n"
        "[ipward.liveness_sources]\nnothing = extra_demo:open_nothing\n"
    )
    path = str(tmp_path)
    listed = run(IPWARD, path, "--help")
    assert {"hello", *LAB_COMMANDS} <= listed_commands(listed.stdout), listed
    hello = run(IPWARD, path, "hello")
    assert hello.returncode == 0 and hello.stdout == "hello from extra_demo\n", hello
    opened = run(
        [sys.executable],
        path,
        "-c",
        "from ipward.cluster.liveness import open_source; print(type(open_source('nothing://x')).__name__)",
    )
    assert opened.stdout == "Nothing\n", opened
