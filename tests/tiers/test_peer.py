"""Peer memory as storage, its pure part and its view (issue 32, item 1): which byte
ranges each host fetches from whom (:func:`shardpoint.tiers.peer.plan_fetch`), and
the step folder a restore's load reads through (:class:`shardpoint.tiers.view.TieredView`,
on real files). The restores over real hosts: tests/distributed/test_tiers_peer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardpoint.errors import CorruptCheckpointError
from shardpoint.load.read import FileRange
from shardpoint.storage.local import LocalStorage
from shardpoint.tiers.hosts import Hosts, StepHolding
from shardpoint.tiers.peer import Wants, plan_fetch
from shardpoint.tiers.replicate import span
from shardpoint.tiers.shm import PrivateStorage
from shardpoint.tiers.view import TieredView

SIZES = {f"f{i}": 1000 + i for i in range(4)}


def have(*names: str, rel: str = "") -> dict[str, tuple[int, str]]:
    return {n: (SIZES[n], f"{rel}/{n}" if rel else n) for n in names}


def wants(*ranges: tuple[str, int, int]) -> Wants:
    rs = [FileRange(*r) for r in ranges]
    return Wants(rs, rs)


def test_each_host_fetches_its_ranks_ranges_once_from_a_holder() -> None:
    two = Hosts.of(["a", "a", "b", "b"])
    holdings = [StepHolding(have={**have("f0", "f1"), **have("f2", "f3", rel="replicas")}),
                StepHolding()]  # host B: an empty replacement
    # both of B's ranks read bytes 10..30 of f0 (a replicated value): they travel once
    w = [None, None, wants(("f0", 10, 20), ("f2", 0, 1002)), wants(("f0", 15, 30), ("f3", 0, 1003))]
    orders = plan_fetch(two, holdings, SIZES, w)
    moves = {m for o in orders for m in o.moves}
    got = sorted((m.name, m.offset, m.size, m.src_rel, m.dst_rel) for m in moves)
    assert got == [("f0", 10, 20, "f0", "ranges/f0/10-30"), ("f2", 0, 1002, "replicas/f2", "ranges/f2/0-1002"),
                   ("f3", 0, 1003, "replicas/f3", "ranges/f3/0-1003")]
    assert all(two.of_rank[m.src] == 0 and two.of_rank[m.dst] == 1 for m in moves)
    for r, o in enumerate(orders):  # each rank gets the moves it takes part in, and nothing else
        assert all(r in (m.src, m.dst) for m in o.moves)
        assert (o.needed, o.incoming) == ((0, 0) if r < 2 else (20 + 1002 + 1003, 20 + 1002 + 1003))
    tags = sorted((m.tag, m.tag + span(m.size)) for m in moves)  # one tag range per move, none shared
    assert all(a[1] <= b[0] for a, b in zip(tags, tags[1:]))
    assert len({m.dst for m in moves}) == 2 and len({m.src for m in moves}) == 2  # spread over both ranks of each host


def test_a_range_fetched_before_serves_and_a_lost_range_is_named() -> None:
    hosts = Hosts.of(["b", "c"])
    # host C holds f1 whole and bytes 0..50 of f0 (fetched by an earlier restore); B needs f0 10..20
    holdings = [StepHolding(), StepHolding(have=have("f1"), ranges={"f0": [(0, 50, "ranges/f0/0-50")]})]
    [_, o] = plan_fetch(hosts, holdings, SIZES, [wants(("f0", 10, 20), ("f1", 5, 6)), None])
    got = sorted((m.name, m.src_rel, m.offset, m.size, m.src_size) for m in o.moves)
    assert got == [("f0", "ranges/f0/0-50", 10, 10, 50), ("f1", "f1", 5, 1, 1001)]
    # bytes 40..60 of f0: no present host holds them all
    orders = plan_fetch(hosts, holdings, SIZES, [wants(("f0", 40, 60)), None])
    assert all(o.missing == orders[0].missing and not o.moves for o in orders)
    assert "bytes 40..60 of f0 (read on host b) are on no present host" in orders[0].missing


def test_the_view_reads_whole_files_and_fetched_ranges_and_names_what_it_lacks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 8  # 2048 bytes
    (tmp_path / "own").write_bytes(data)
    (tmp_path / "ranges" / "far").mkdir(parents=True)
    (tmp_path / "ranges" / "far" / "100-300").write_bytes(data[100:300])
    (tmp_path / "ranges" / "far" / "300-400").write_bytes(data[300:400])
    (tmp_path / "ranges" / "far" / "500-900").write_bytes(data[500:899])  # one byte short: never counted
    (tmp_path / "ranges" / "far" / ".600-700.part-1-ab").write_bytes(data[600:700])  # half-written: never read
    view = TieredView(PrivateStorage(LocalStorage(str(tmp_path))), {"own": 2048, "far": 2048})
    assert bytes(view.read("own", 5, 10)) == data[5:15]
    assert bytes(view.read("far", 150, 200)) == data[150:350]  # across two fetched ranges
    buf = bytearray(50)
    view.read_into("far", 120, memoryview(buf))
    assert bytes(buf) == data[120:170]
    bufs = [memoryview(bytearray(30)), memoryview(bytearray(20))]
    view.readv_into("far", 200, bufs)
    assert b"".join(bytes(b) for b in bufs) == data[200:250]
    assert view.size("far") == 2048 and view.exists("far") and not view.exists("nowhere")
    assert view.holds("far", 100, 400) and not view.holds("far", 90, 110) and not view.holds("far", 600, 650)
    with pytest.raises(CorruptCheckpointError, match=r"far: bytes 350\.\.450 are not on this host"):
        view.read("far", 350, 100)
    assert view.names == {"own", "far"}


def test_ranges_of_files_only_the_root_holds_are_not_moved_and_are_counted() -> None:
    """f2 is on no present host but the root holds it (the same save): no host fetches
    it, each host is told what its ranks need of it (each byte once), and a range of
    it that a peer holds (fetched by an earlier restore) still comes from that peer."""
    two = Hosts.of(["a", "a", "b", "b"])
    holdings = [StepHolding(have=have("f0", "f1", "f3")),
                StepHolding(ranges={"f2": [(0, 100, "ranges/f2/0-100")]})]
    w = [wants(("f2", 500, 700)), wants(("f2", 600, 800), ("f2", 10, 60)), wants(("f0", 0, 50), ("f2", 900, 1002)),
         None]
    orders = plan_fetch(two, holdings, SIZES, w, durable={"f2"})
    assert not any(o.missing for o in orders)
    moves = {m for o in orders for m in o.moves}
    got = sorted((m.name, m.src_rel, m.offset, m.size, two.of_rank[m.src], two.of_rank[m.dst]) for m in moves)
    assert got == [("f0", "f0", 0, 50, 0, 1), ("f2", "ranges/f2/0-100", 10, 50, 1, 0)]
    # host A's ranks need bytes 500..800 of f2 from the root (each byte once) and 10..60 from B; host B's
    # 900..1002 from the root and 0..50 of f0 from A
    assert [(o.durable, o.needed) for o in orders] == [(300, 50), (300, 50), (102, 50), (102, 50)]
    # without the root's copy, the same wants are refused, naming the bytes
    assert "of f2 (read on host a) are on no present host" in plan_fetch(two, holdings, SIZES, w)[0].missing


def test_the_view_reads_files_no_host_holds_from_the_root_and_counts_them(tmp_path: Path) -> None:
    data = bytes(range(256)) * 8  # 2048 bytes
    mem, root = tmp_path / "mem", tmp_path / "root"
    (mem / "ranges" / "lost").mkdir(parents=True)
    root.mkdir()
    (mem / "own").write_bytes(data)
    (mem / "ranges" / "lost" / "0-100").write_bytes(data[:100])  # fetched from a peer by an earlier restore
    (root / "lost").write_bytes(data[::-1])
    (root / "lost.index.json").write_bytes(b"{}")
    (root / "own").write_bytes(b"x" * 2048)  # a file the host holds is never read from the root
    view = TieredView(PrivateStorage(LocalStorage(str(mem))), {"own": 2048, "lost": 2048},
                      durable=LocalStorage(str(root)), rooted=["lost", "lost.index.json"])
    assert bytes(view.read("own", 0, 10)) == data[:10]
    assert bytes(view.read("lost", 10, 20)) == data[10:30]  # covered here: not from the root
    assert view.from_root == {}
    assert bytes(view.read("lost", 1000, 100)) == data[::-1][1000:1100]
    buf = bytearray(48)
    view.read_into("lost", 2000, memoryview(buf))
    assert bytes(buf) == data[::-1][2000:]
    bufs = [memoryview(bytearray(30)), memoryview(bytearray(20))]
    view.readv_into("lost", 90, bufs)  # starts here, ends beyond the range held: from the root
    assert b"".join(bytes(b) for b in bufs) == data[::-1][90:140]
    assert bytes(view.read("lost.index.json")) == b"{}"
    assert view.from_root == {"lost": 100 + 48 + 50, "lost.index.json": 2}
    assert view.exists("lost.index.json") and view.size("lost.index.json") == 2 and view.size("lost") == 2048
    # without a durable copy, the same read is refused, naming the bytes
    bare = TieredView(PrivateStorage(LocalStorage(str(mem))), {"lost": 2048}, rooted=["lost"])
    with pytest.raises(CorruptCheckpointError, match=r"lost: bytes 1000\.\.1100 are not on this host"):
        bare.read("lost", 1000, 100)
