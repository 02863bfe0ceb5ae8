"""`ipward export` / `ipward import`: a whole ledger at one revision, moved SQLite ->
etcd -> SQLite key for key, `check` clean on each; imports refused into a store that is
not empty and from files that are not whole exports; an interrupted import is refused
by every other process and finished by running it again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from ipward.core import keys
from ipward.core import records as rec
from ipward.store import open_backend, open_store, schema
from ipward.store.base import Put, StoreMissing
from ipward_lab import fleet
from ipward_lab.fleet import IPWARD, run_cli
from ipward_lab.servers.etcd import etcd_server
from ipward_lab.waiting import wait_for
from support import exec_plugin

INCOMPATIBLE = 106
HOST = os.uname().nodename  # the node of the plugin's allocations in single-node mode
KINDS = {"pools", "ips", "attach", "blocks", "affinity", "fill", "blockcursor", "free", "freeq",
         "sticky", "nodeips"}  # fmt: skip


def cni(url: str, network: str, **ipam: object) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": network,
        "ipam": {"type": "ipward", "store": url, **ipam},
    }


def pod_args(name: str, uid: str) -> str:
    return f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={name};K8S_POD_UID={uid}"


def build_ledger(plugin: Path, url: str) -> None:
    """Every kind of record, written the way ipward writes them: a dual-stack pool made
    with the CLI and an inline one, allocations, released addresses in cooldown (free
    queues), blocks, a sticky reservation (detached), and leased keys, which are not
    exported."""
    run_cli(
        "pool", "create", "web", "--range", "10.9.0.0/24,gateway=10.9.0.1",
        "--range", "fd09::/64", "--cooldown", "3600", store=url, check=True,
    )  # fmt: skip
    web = cni(url, "net", pool="web")
    for i in range(4):
        out = exec_plugin(plugin, "ADD", web, container=f"c{i}", args=pod_args(f"p{i}", f"u{i}"))
        assert out.returncode == 0, out
    assert exec_plugin(plugin, "DEL", web, container="c2").returncode == 0
    inline = cni(url, "inl", ranges=[[{"subnet": "10.8.0.0/24"}]])
    assert exec_plugin(plugin, "ADD", inline, container="i1").returncode == 0
    sticky = cni(url, "db", pool="web", sticky=True)
    out = exec_plugin(plugin, "ADD", sticky, container="s1", args=pod_args("db-0", "u9"))
    assert out.returncode == 0, out
    assert exec_plugin(plugin, "DEL", sticky, container="s1").returncode == 0
    with open_store(url) as store:
        lease = store.lease_grant(300)
        store.txn(
            [],
            [
                Put(keys.node_key("n1"), rec.encode({"node": "n1"}), lease=lease),
                Put("controller/leader", rec.encode({"id": "c"}), lease=lease),
            ],
        )


def export(url: str, path: Path) -> tuple[dict, list[str]]:
    run_cli("export", "-o", str(path), store=url, check=True)
    header, *lines = path.read_text().splitlines()
    return json.loads(header), lines


def check_clean(url: str) -> None:
    proc = run_cli("--json", "check", store=url)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_round_trip_sqlite_etcd_sqlite_is_key_for_key(
    plugin: Path, tmp_path: Path, sqlite_url: str
) -> None:
    build_ledger(plugin, sqlite_url)
    check_clean(sqlite_url)
    with open_store(sqlite_url) as store:
        revision = store.revision()
    header, lines = export(sqlite_url, tmp_path / "a.jsonl")
    keys = [json.loads(line)["key"] for line in lines]
    assert header["revision"] == revision and header["schema"] == schema.VERSION
    assert header["keys"] == len(lines) and set(header["counts"]) == KINDS
    assert not [k for k in keys if k.startswith(("nodes/", "controller/", "meta/"))]
    assert "nodes/" in header["not_exported"] and "controller/leader" in header["not_exported"]

    with etcd_server(tmp_path / "etcd") as server:
        imported = run_cli("--json", "import", str(tmp_path / "a.jsonl"), store=server.url)
        assert imported.returncode == 0, imported.stderr
        assert json.loads(imported.stdout)["keys"] == len(lines)
        check_clean(server.url)
        header_b, lines_b = export(server.url, tmp_path / "b.jsonl")
    assert lines_b == lines
    assert (header_b["keys"], header_b["counts"]) == (header["keys"], header["counts"])

    back = f"sqlite://{tmp_path}/back/ipward.db"
    assert run_cli("import", str(tmp_path / "b.jsonl"), store=back).returncode == 0
    check_clean(back)
    assert export(back, tmp_path / "c.jsonl")[1] == lines
    # The imported ledger is the ledger: ADD is idempotent on it, DEL frees.
    again = exec_plugin(plugin, "ADD", cni(back, "net", pool="web"), container="c1")
    first = exec_plugin(plugin, "ADD", cni(sqlite_url, "net", pool="web"), container="c1")
    assert again.json["ips"] == first.json["ips"]
    assert exec_plugin(plugin, "DEL", cni(back, "net", pool="web"), container="c1").returncode == 0
    check_clean(back)


@pytest.mark.kstore
def test_a_ledger_moves_from_etcd_to_the_kubernetes_store_and_back(
    plugin: Path, tmp_path: Path, sqlite_url: str, new_kube_store_url: str
) -> None:
    """What an operator moving to `k8s://` does (README, Moving the ledger): export from
    etcd, import into the Kubernetes store, key for key (a sticky reservation detached,
    addresses cooling in their queues, an inline pool); the imported ledger serves
    through an agent: an ADD retried answers what the attachment holds, the sticky
    identity's next sandbox takes its address over, a DEL frees. And back to etcd, key
    for key."""
    build_ledger(plugin, sqlite_url)
    with etcd_server(tmp_path / "etcd") as server:
        assert (
            run_cli(
                "import", str(export_to(sqlite_url, tmp_path / "s.jsonl")), store=server.url
            ).returncode
            == 0
        )
        header, lines = export(server.url, tmp_path / "etcd.jsonl")
        imported = run_cli(
            "--json", "import", str(tmp_path / "etcd.jsonl"), store=new_kube_store_url
        )
        assert imported.returncode == 0, imported.stderr
        check_clean(new_kube_store_url)
        header_k, lines_k = export(new_kube_store_url, tmp_path / "k8s.jsonl")
        assert lines_k == lines and header_k["counts"] == header["counts"]
        cooling = [k for line in lines_k if (k := json.loads(line)["key"]).startswith("freeq/")]
        assert cooling, "the ledger moved holds addresses in their cooldown"

        run_dir = Path(tempfile.mkdtemp(prefix="ipw-move-"))
        agent = fleet.Agent(HOST, new_kube_store_url, run_dir / "agent.sock", tmp_path)
        try:
            agent.wait_ready()
            via = {"agentSocket": str(agent.socket)}
            held = exec_plugin(plugin, "ADD", cni(sqlite_url, "net", pool="web"), container="c1")
            again = exec_plugin(plugin, "ADD", cni("", "net", pool="web", **via), container="c1")
            assert again.returncode == 0 and again.json["ips"] == held.json["ips"], again
            sticky = cni("", "db", pool="web", sticky=True, **via)
            was = exec_plugin(
                plugin,
                "ADD",
                cni(sqlite_url, "db", pool="web", sticky=True),
                container="s1",
                args=pod_args("db-0", "u9"),
            )
            taken = exec_plugin(plugin, "ADD", sticky, container="s2", args=pod_args("db-0", "u10"))
            assert taken.returncode == 0 and taken.json["ips"] == was.json["ips"], taken
            gone = exec_plugin(plugin, "DEL", cni("", "net", pool="web", **via), container="c3")
            assert gone.returncode == 0, gone
        finally:
            agent.kill()
            shutil.rmtree(run_dir, ignore_errors=True)
        check_clean(new_kube_store_url)
        export(new_kube_store_url, tmp_path / "k8s-after.jsonl")
        back = etcd_server(tmp_path / "etcd-back")
        with back as server_back:
            done = run_cli("import", str(tmp_path / "k8s-after.jsonl"), store=server_back.url)
            assert done.returncode == 0, done.stderr
            check_clean(server_back.url)
            assert (
                export(server_back.url, tmp_path / "back.jsonl")[1]
                == export(new_kube_store_url, tmp_path / "k8s-again.jsonl")[1]
            )


def export_to(url: str, path: Path) -> Path:
    run_cli("export", "-o", str(path), store=url, check=True)
    return path


def test_import_only_into_an_empty_store(plugin: Path, tmp_path: Path, sqlite_url: str) -> None:
    build_ledger(plugin, sqlite_url)
    export(sqlite_url, tmp_path / "a.jsonl")
    other = f"sqlite://{tmp_path}/other.db"
    run_cli("pool", "create", "x", "--range", "10.1.0.0/24", store=other, check=True)
    with open_store(other) as store:
        before = store.snapshot(keys.PREFIXES)
    proc = run_cli("import", str(tmp_path / "a.jsonl"), store=other)
    assert proc.returncode == 2 and "not empty: it holds pools/x" in proc.stderr, proc
    with open_store(other) as store:
        assert store.snapshot(keys.PREFIXES) == before


def write_export(path: Path, header: dict, entries: list[object]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in [header, *entries]))
    return path


GOOD_HEADER = {
    "format": "ipward-export",
    "format_version": 1,
    "schema": schema.VERSION,
    "revision": 9,
    "keys": 1,
    "counts": {"pools": 1},
}
POOL = {"key": "pools/p", "value": '{"name":"p"}'}


@pytest.mark.parametrize(
    ("header", "entries", "needle"),
    [
        ({**GOOD_HEADER, "format": "other"}, [POOL], "line 1: not an 'ipward export' header"),
        ({**GOOD_HEADER, "format_version": 2}, [POOL], "export format version 2"),
        ({**GOOD_HEADER, "schema": schema.VERSION + 1}, [POOL], "newer than this ipward's"),
        ({**GOOD_HEADER, "keys": "1"}, [POOL], "line 1: 'keys' and 'counts'"),
        (GOOD_HEADER, [{"key": "nodes/n1", "value": "{}"}], "line 2: key 'nodes/n1'"),
        (GOOD_HEADER, [{"key": "meta/schema", "value": "{}"}], "line 2: key 'meta/schema'"),
        (GOOD_HEADER, [{"key": "pools/p", "value": {"a": 1}}], "must be a string"),
        (GOOD_HEADER, [{"key": "pools/p"}], "line 2: expected"),
        (GOOD_HEADER, ["not an object"], "line 2: expected"),
        ({**GOOD_HEADER, "keys": 2, "counts": {"pools": 2}}, [POOL, POOL], "line 3: key"),
        ({**GOOD_HEADER, "keys": 2, "counts": {"pools": 2}}, [POOL], "cut short"),
    ],
)
def test_a_bad_export_file_is_refused_before_anything_is_made(
    tmp_path: Path, header: dict, entries: list[object], needle: str
) -> None:
    path = write_export(tmp_path / "bad.jsonl", header, entries)
    target = tmp_path / "new" / "ipward.db"
    proc = run_cli("import", str(path), store=f"sqlite://{target}")
    assert proc.returncode == 2 and needle in proc.stderr, proc
    assert not target.parent.exists()


def test_an_interrupted_import_is_refused_by_all_then_finished(
    plugin: Path, tmp_path: Path, sqlite_url: str
) -> None:
    build_ledger(plugin, sqlite_url)
    _, lines = export(sqlite_url, tmp_path / "a.jsonl")
    target = f"sqlite://{tmp_path}/target/ipward.db"
    importing = subprocess.Popen(
        [*IPWARD, "--store", target, "import", str(tmp_path / "a.jsonl"), "--batch-keys", "5"],
        env={**os.environ, "IPWARD_TEST_PAUSES": "import-batch=120"},
        stderr=subprocess.PIPE,
    )
    try:

        def written() -> int:
            try:
                with open_backend(target, create=False) as store:
                    state = schema.read(store, target)
            except StoreMissing:  # not made yet
                return 0
            return int(state.importing["written"]) if state and state.importing else 0

        assert wait_for(written, "the first batch of the import") == 5
        importing.send_signal(signal.SIGKILL)  # in its pause after the first batch
        importing.wait(30)
    finally:
        importing.kill()
        importing.wait()

    # Every other process refuses the half-imported store, permanently.
    out = exec_plugin(plugin, "ADD", cni(target, "net", pool="web"), container="c1")
    assert out.returncode == 1 and out.json["code"] == INCOMPATIBLE, out
    assert "import is in progress (5 of" in out.json["msg"]
    for args in (["status"], ["export"], ["pool", "create", "q", "--range", "10.2.0.0/24"]):
        proc = run_cli(*args, store=target)
        assert proc.returncode == 2 and "import is in progress" in proc.stderr, (args, proc)
    agent = run_cli(
        "agent", "--node", "n1", "--socket", str(tmp_path / "a.sock"), "--metrics-address", "off",
        store=target,
    )  # fmt: skip
    assert agent.returncode == 2 and "import is in progress" in agent.stderr
    other = write_export(tmp_path / "other.jsonl", GOOD_HEADER, [POOL])
    proc = run_cli("import", str(other), store=target)
    assert proc.returncode == 2 and "another import is in progress" in proc.stderr

    # The same import again goes on where it stopped.
    done = run_cli("import", str(tmp_path / "a.jsonl"), store=target)
    assert done.returncode == 0 and "resumed after key 5" in done.stdout, done
    assert export(target, tmp_path / "b.jsonl")[1] == lines
    check_clean(target)
