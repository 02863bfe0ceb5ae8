"""The benchmark's parts in this process, on SQLite: percentiles, the command's options,
rates and latencies (figures measured, never judged), the bulk fills writing exactly
what ledgers and the controller write, scale sizes, and the report's page (its plots,
drawn by matplotlib: `tests/system/test_report_plots.py`).
(The runs with processes: `tests/system/test_bench.py`.)"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from ipward.core.keys import node_key
from ipward.core.pool import PoolSpec
from ipward.core.records import Attachment, PodInfo
from ipward.ipam.check import check
from ipward.ipam.ledger import Ledger
from ipward.store import schema
from ipward.store.base import Put
from ipward.store.sqlite import SqliteStore
from ipward_lab.bench import (
    NODE,
    PoolFill,
    bench_command,
    bulk_fill,
    ledger_pair_rate,
    p99,
    percentile,
    raw_cas_rate,
    write_adds,
    write_all,
)
from ipward_lab.bench.k8s_store import request_counts, request_outcomes, writes_by_resource
from ipward_lab.bench.scale import FULL as FULL_SCALE
from ipward_lab.bench.scale import scale_sizes
from ipward_lab.report import PNG_MAGIC, Page, save_png


def test_p99_nearest_rank() -> None:
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 41)]) == 40.0  # fewer than 100: the maximum


def test_percentile_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 90) == 90.0
    assert percentile(samples, 99) == p99(samples) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 1) == 7.0


def test_raw_cas_and_ledger_rates_on_sqlite(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "bench.db"))
    try:
        cas = raw_cas_rate(store, n=20, warmup=2)
        pairs = ledger_pair_rate(store, n=20, warmup=2)
    finally:
        store.close()
    assert cas > 0 and math.isfinite(cas)
    assert pairs > 0 and math.isfinite(pairs)


def test_command_options() -> None:
    result = CliRunner().invoke(bench_command, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--quick",
        "--no-etcd",
        "--json",
        "--cluster",
        "--agents",
        "--concurrency",
        "--report",
        "--scale",
        "--k8s-store",
        "--records",
        "--k8s",
        "--pods",
        "--kube",
        "--rounds",
    ):
        assert option in result.output
    for wrong, named in (
        (["--records", "2000"], "--scale"),
        (["--pods", "2000"], "--k8s"),
        (["--k8s", "--pods", "109"], "110"),
        (["--rounds", "3"], "--kube"),
        (["--k8s", "--scale"], "--scale"),
        (["--kube", "--k8s"], "--k8s"),
        (["--kube", "--scale"], "--scale"),
        (["--kube", "--cluster"], "--cluster"),
        (["--kube", "--report", "/nonexistent/x"], "--report"),
        (["--kube", "--no-etcd"], "--no-etcd"),
        (["--kube", "--pods", "0"], "--pods"),
        (["--scale", "--cluster"], "--cluster"),
        (["--scale", "--no-etcd"], "--no-etcd"),
        (["--k8s-store", "--scale"], "--scale"),
        (["--k8s-store", "--cluster"], "--cluster"),
        (["--k8s-store", "--k8s"], "--k8s"),
        (["--k8s-store", "--no-etcd"], "--no-etcd"),
        (["--k8s-store", "--report", "/nonexistent/x"], "--report"),
    ):
        refused = CliRunner().invoke(bench_command, wrong)
        assert refused.exit_code == 2 and named in refused.output, refused.output
    misplaced = CliRunner().invoke(bench_command, ["--agents", "2"])
    assert misplaced.exit_code == 2 and "--cluster" in misplaced.output
    both = CliRunner().invoke(bench_command, ["--cluster", "--report", "/nonexistent/x"])
    assert both.exit_code == 2 and "--report" in both.output


def _store_items(store: SqliteStore) -> dict[str, bytes]:
    return {kv.key: kv.value for kv in store.range("")[0]}


@pytest.mark.parametrize(
    "count",
    [
        1,  # one block claimed, its cursor at 1
        13,  # the first /28 block exactly used up (16 less network, gateway, an exclusion)
        150,  # dual stack, exclusions, a block emptied by them, the last block part used
    ],
)
def test_bulk_fill_writes_what_the_ledger_writes(tmp_path: Path, count: int) -> None:
    """bulk_fill's keys and values are byte for byte those of `count` ADDs through a
    ledger on an empty pool, and `ipward check` finds nothing wrong with them."""
    spec = PoolSpec(
        "eq",
        [[{"subnet": "10.5.0.0/24", "gateway": "10.5.0.1"}], [{"subnet": "fd00:5::/120"}]],
        exclude=["10.5.0.15", "10.5.0.32/28", "10.5.0.70", "fd00:5::20/124"],
        block_prefix={4: 28, 6: 124},
        cooldown=0,
    )
    at = 1_700_000_000.0
    through_ledger = SqliteStore(str(tmp_path / "ledger.db"))
    bulk = SqliteStore(str(tmp_path / "bulk.db"))
    try:
        ledger = Ledger(through_ledger, NODE, clock=lambda: at)
        pod = PodInfo("bench", "fill", "uid-fill")
        for i in range(count):
            ledger.allocate([spec], Attachment("benchfill", f"fill-{i}", "eth0"), pod)
        attachments = bulk_fill(bulk, spec, count, created_at=at, batch=37)
        assert [a.container for a in attachments] == [f"fill-{i}" for i in range(count)]
        expected, got = _store_items(through_ledger), _store_items(bulk)
        differ = {k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k)}
        assert not differ, sorted(differ)[:10]
        assert check(bulk)[0] == []
        # And the ledger carries on from it as from its own work.
        more = Ledger(bulk, NODE).allocate([spec], Attachment("benchfill", "next", "eth0"), pod)
        again = Ledger(through_ledger, NODE).allocate(
            [spec], Attachment("benchfill", "next", "eth0"), pod
        )
        assert [a.ip for a in more] == [a.ip for a in again]
    finally:
        through_ledger.close()
        bulk.close()


def _register(store: SqliteStore, nodes: list[str]) -> None:
    lease = store.lease_grant(600)
    store.txn([], [Put(node_key(n), b"{}", lease=lease) for n in nodes])


def test_pool_fill_writes_what_ledgers_and_the_controller_write(tmp_path: Path) -> None:
    """PoolFill's keys and values are byte for byte those of ledgers on several nodes
    and the controller's passes (warm target) between their ADDs, over two stages (the
    second carrying on from the store's block cursor), and `ipward check` finds nothing
    wrong with them."""
    from ipward.controller.election import Election
    from ipward.controller.metrics import Metrics
    from ipward.controller.passes import Controller
    from ipward.ipam.pools import create_pool

    spec = PoolSpec(
        "cl",
        [[{"subnet": "10.7.0.0/22"}], [{"subnet": "fd00:7::/112"}]],
        exclude=["10.7.0.20/30"],
        block_prefix={4: 28, 6: 124},
        cooldown=0,
        warm=20,  # more than a /28 holds: two blocks a node, assigned in two rounds
    )
    stages = [{"n0": 25, "n1": 3, "n2": 0, "n3": 17}, {"n4": 40, "n5": 1}]
    at = 1_700_000_000.0

    def pod(i: int) -> PodInfo:
        return PodInfo("ns", f"pod-{i}", f"uid-{i}")

    def adds(stage: dict[str, int], start: int) -> list[tuple[str, Attachment, PodInfo]]:
        out = []
        for node, count in stage.items():
            for _ in range(count):
                out.append((node, Attachment("net", f"c-{start}", "eth0"), pod(start)))
                start += 1
        return out

    real = SqliteStore(str(tmp_path / "real.db"))
    bulk = SqliteStore(str(tmp_path / "bulk.db"))
    try:
        for store, path in ((real, "real.db"), (bulk, "bulk.db")):
            schema.ensure(store, str(tmp_path / path), create=True)
            create_pool(store, spec)
        election = Election(real, "t", 600)
        election.campaign()
        controller = Controller(
            real, election, Metrics("t", lambda: True), interval=1, ready_delay=0
        )
        fill = PoolFill(spec)
        nodes: list[str] = []
        done = 0
        for stage in stages:
            nodes += list(stage)
            _register(real, list(stage))
            controller.run_pass()
            for node, attachment, p in adds(stage, done):
                Ledger(real, node, clock=lambda: at).allocate([spec], attachment, p)
            controller.run_pass()
            # The bulk side, carrying on from the store's cursors as the scale run does.
            fill.carry_on(bulk)
            fill.warm(nodes)
            write_adds(bulk, fill, adds(stage, done), at, batch=29)
            fill.warm(nodes)
            write_all(bulk, fill.ops())
            done += sum(stage.values())
        leased = ("nodes/", "controller/")
        expected = {k: v for k, v in _store_items(real).items() if not k.startswith(leased)}
        got = {k: v for k, v in _store_items(bulk).items() if not k.startswith(leased)}
        differ = {k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k)}
        assert not differ, sorted(differ)[:10]
        assert check(bulk)[0] == []
    finally:
        real.close()
        bulk.close()


def test_bulk_fill_refuses_more_than_the_pool_holds(tmp_path: Path) -> None:
    from ipward_lab.bench import BenchError

    store = SqliteStore(str(tmp_path / "b.db"))
    try:
        spec = PoolSpec("small", [[{"subnet": "10.6.0.0/29"}]])  # 6 usable
        assert len(bulk_fill(store, spec, 6)) == 6
        with pytest.raises(BenchError):
            bulk_fill(SqliteStore(str(tmp_path / "c.db")), spec, 7)
    finally:
        store.close()


def test_page_is_self_contained_and_escaped(tmp_path: Path) -> None:
    png = _one_pixel_png()
    page = Page("bench <script>alert(1)</script>")
    page.heading("a & b").paragraph('say "hi" <now>')
    page.table(["name", "value"], [["<td>", "1,234.5x"], ["x", "2^64"]])
    page.figure(png, "caption <i>")
    page.preformatted("<pre> & more")
    path = tmp_path / "page.html"
    page.write(path)
    text = path.read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "a &amp; b" in text and "say &quot;hi&quot; &lt;now&gt;" in text
    assert "<td>&lt;td&gt;</td>" in text and 'class="num">1,234.5x<' in text
    assert "caption &lt;i&gt;" in text and "&lt;pre&gt; &amp; more" in text
    assert text.count('src="data:image/png;base64,') == 1
    assert base64.b64encode(png).decode() in text
    for external in ('src="http', "href=", "@import", "url("):
        assert external not in text
    with pytest.raises(ValueError):
        page.figure(b"GIF89a", "not a PNG")
    save_png(png, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes() == png
    with pytest.raises(ValueError):
        save_png(b"not a png", tmp_path / "q.png")


def _one_pixel_png() -> bytes:
    """A PNG made here, not drawn: drawing is matplotlib's, which on its first run on a
    machine lists the machine's fonts with a process (`tests/system/test_report_plots.py`)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)  # 1x1, 8-bit grey
    return (
        PNG_MAGIC
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0\0"))
        + chunk(b"IEND", b"")
    )


def test_scale_sizes() -> None:
    assert scale_sizes(False, None) == FULL_SCALE
    assert scale_sizes(False, 20_000).stages == (1_000, 1_500, 10_000, 20_000)
    assert scale_sizes(True, 5_000).stages == (1_000, 1_500, 5_000)
    assert scale_sizes(True, 5_000).agents == scale_sizes(True, None).agents


def test_api_requests_are_counted_by_what_they_did() -> None:
    """`--k8s-store` counts the API server's requests from its /metrics (lines of a real
    kube-apiserver 1.26.1 after 2 creates and 2 updates of ledger objects): every write,
    of every resource, by outcome; reads apart; watches (counted as each ends) left out."""
    text = (Path(__file__).parent / "data" / "kube-apiserver-metrics.txt").read_text()
    put = next(
        line for line in text.splitlines() if 'verb="PUT"' in line and "ledgershards" in line
    )
    text += put.replace('verb="PUT"', 'verb="WATCH"') + "\n"
    counts = request_counts(text)
    assert counts["PUT ledgershards 200"] == 2
    assert counts["POST ledgershards 201"] == 2
    assert counts["PUT customresourcedefinitions/status 200"] == 2  # a subresource apart
    assert writes_by_resource(counts)["ledgershards"] == 4
    assert not any(key.startswith("WATCH") for key in counts)
    outcomes = request_outcomes(counts)
    assert outcomes["ledger_writes"] == 4
    assert outcomes["writes"] > 4  # the API server's own: namespaces, roles, its lease
    assert outcomes["conflicts"] == 1  # its own create of a namespace that was there
    samples = [line for line in text.splitlines() if line.startswith("apiserver_request_total{")]
    served = sum(int(line.rsplit(" ", 1)[1]) for line in samples if 'verb="WATCH"' not in line)
    assert sum(outcomes.values()) - outcomes["ledger_writes"] == served
