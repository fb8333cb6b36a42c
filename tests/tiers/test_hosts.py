"""The memory tier over several hosts, its pure part: hosts by name, where replicas
go, what a snapshot's replication sends, which step a restore over hosts picks and
what it fetches; and file transfers on real gloo ranks (a half-written or unreadable
replica is never counted). The two-host runs: tests/distributed/test_tiers_hosts.py."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from shardpoint.format.manifest import MANIFEST_NAME
from shardpoint.format.model import DataFile, IndexFile
from shardpoint.tiers.drain import DrainJob
from shardpoint.tiers.hosts import (
    FileSpec,
    HostInventory,
    Hosts,
    RestoreDecision,
    StepHolding,
    drain_parts,
    rank_files,
    redrain_parts,
    replica_plan,
    restore_plan,
)
from shardpoint.tiers.shm import JobArea
from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_hosts_are_ordered_by_their_lowest_rank() -> None:
    h = Hosts.of(["n2", "n1", "n2", "n1", "n3"])
    assert h.names == ("n2", "n1", "n3") and h.ranks == ((0, 2), (1, 3), (4,)) and h.of_rank == (0, 1, 0, 1, 2)
    assert [h.leader(i) for i in range(3)] == [0, 1, 4] and h.is_leader(1) and not h.is_leader(3)


def test_replicas_never_land_on_their_own_host() -> None:
    h = Hosts.of(["a", "a", "b", "b", "c"])
    assert h.targets(0, 1) == [2] and h.targets(1, 1) == [3]  # host (h + 1) mod H, same position
    assert h.targets(1, 2) == [3, 4]  # host c has one rank: positions wrap
    assert h.targets(4, 2) == [0, 2]  # from the last host to the first ones
    assert h.targets(0, 5) == [2, 4]  # clamped to the other hosts' number
    for r in range(5):
        assert all(h.of_rank[t] != h.of_rank[r] for t in h.targets(r, 4))
    assert Hosts.of(["a", "a"]).targets(0, 1) == []


def files(world: int, sid: str = "s1", size: int = 100) -> dict[str, DataFile]:
    """A manifest's ``files`` table: one data file and its index per rank."""
    return {f"r{r:05d}-{sid}.safetensors": DataFile(size + r, r, IndexFile(f"r{r:05d}-{sid}.index.json", 10, f"h{r}"))
            for r in range(world)}


def test_replication_sends_the_state_times_replicas() -> None:
    h = Hosts.of(["a", "a", "b", "b"])
    saver = rank_files(files(4))
    state = sum(s.size for specs in saver.values() for s in specs)
    for k in (1, 3):
        moves = replica_plan(h, saver, k)
        assert sum(m.size for m in moves) == state * min(k, 1)  # two hosts: at most one other
        assert all(h.of_rank[m.src] != h.of_rank[m.dst] and m.dst_rel == f"replicas/{m.name}" for m in moves)
    assert {m.src: m.dst for m in replica_plan(h, saver, 1)} == {0: 2, 1: 3, 2: 0, 3: 1}
    assert drain_parts(h, saver) == {0: saver[0] + saver[1], 1: saver[2] + saver[3]}


def inventory(step: int, sid: str, man: bool, have: dict[str, tuple[int, str]], world: int = 4) -> HostInventory:
    need = {n: e.size for n, e in files(world, sid).items()}
    need.update({e.index.name: 10 for e in files(world, sid).values() if e.index is not None})
    if not man:
        return {str(step): StepHolding(have=dict(have))}
    return {str(step): StepHolding(save_id=sid, manifest=500, need=need, data=sorted(files(world, sid)), have=dict(have))}


def host_files(ranks: list[int], sid: str, rel: str = "") -> dict[str, tuple[int, str]]:
    out = {}
    for r in ranks:
        for n, s in ((f"r{r:05d}-{sid}.safetensors", 100 + r), (f"r{r:05d}-{sid}.index.json", 10)):
            out[n] = (s, f"{rel}/{n}" if rel else n)
    return out


def test_restore_picks_the_newest_step_the_present_hosts_hold_between_them() -> None:
    a_only = Hosts.of(["a", "a"])
    # host A after host B's loss: step 7 with its own files and replicas of B's; step 6 without the replicas
    inv_a = {**inventory(7, "s7", True, {**host_files([0, 1], "s7"), **host_files([2, 3], "s7", "replicas")}),
             **inventory(6, "s6", True, host_files([0, 1], "s6"))}
    cands, passed = restore_plan(a_only, [inv_a], durable=5)
    assert [(c.step, c.save_id, c.fetch) for c in cands] == [(7, "s7", [])]
    assert "on no present host" in passed[6]
    assert restore_plan(a_only, [inv_a], durable=8)[0] == []  # the durable tier is newer
    # the replica is one byte short (a torn copy under its final name): never counted
    torn = {**inv_a}
    torn["7"] = msgspec.structs.replace(
        inv_a["7"], have={**inv_a["7"].have, "r00003-s7.safetensors": (102, "replicas/r00003-s7.safetensors")})
    assert restore_plan(a_only, [torn], durable=None)[0] == []


def test_restore_fetches_the_manifest_and_indexes_a_host_lacks_from_one_that_has_them() -> None:
    two = Hosts.of(["a", "a", "b", "b"])
    inv_a = inventory(7, "s7", True, {**host_files([0, 1], "s7"), **host_files([2, 3], "s7", "replicas")})
    inv_b = inventory(7, "s7", False, host_files([2], "s7"))  # B lost its manifest and rank 3's file
    [cand], _ = restore_plan(two, [inv_a, inv_b], durable=None)
    got = {(m.name, m.src in (0, 1), m.dst in (2, 3), m.dst_rel) for m in cand.fetch}
    # data files are not fetched whole: the load fetches the byte ranges its ranks read (tiers/peer.py)
    want = {(n, True, True, f"fetched/{n}") for n in [*host_files([0, 1], "s7"), *host_files([3], "s7")]
            if n.endswith(".index.json")}
    assert got == want | {(MANIFEST_NAME, True, True, MANIFEST_NAME)}
    assert cand.fetch[-1].name == MANIFEST_NAME  # the manifest last
    # re-draining the restored step: each file from the first host that holds it whole (A holds all of it)
    r = redrain_parts(two, [inv_a, inv_b], cand, [5, 7], 5)
    assert r is not None and (r.step, r.save_id, list(r.parts)) == (7, "s7", [0])
    assert redrain_parts(two, [inv_a, inv_b], cand, [5], 5) is None  # already durable
    # host A holds only its own files: B's part of the redrain comes from B
    inv_a2 = inventory(7, "s7", True, {**host_files([0, 1], "s7"), **host_files([3], "s7", "replicas")})
    r = redrain_parts(two, [inv_a2, inv_b], cand, [5, 7], 5)
    assert r is not None and sorted(r.parts) == [0, 1]
    assert sorted(f.name for f in r.parts[1]) == sorted(host_files([2], "s7"))
    # rank 0's decision travels as JSON and comes back the same records (int keys, files typed)
    decision = RestoreDecision({3: "unhealthy"}, [7], [msgspec.structs.replace(cand, redrain=r)])
    back = RestoreDecision.from_wire(decision.wire())
    assert back == decision and isinstance(back.cands[0].redrain.parts[1][0], FileSpec)  # type: ignore[union-attr]
    # and a host's part of the drain reaches the helper process as the same file specs
    job = DrainJob(step=7, src="/s", root="/r", folder="step-7", files=r.parts[1], commit=False, save_id="s7")
    assert DrainJob.from_wire(job.wire()) == job and DrainJob.from_wire(
        DrainJob(step=7, src="/s", root="/r", folder="step-7").wire()).files is None


def test_inventory_never_lists_half_written_files(tmp_path: Path) -> None:
    area = JobArea(str(tmp_path), "run=x\0root=y")
    area.open()
    folder = Path(area.path(3))
    (folder / "replicas").mkdir(parents=True)
    (folder / "r00000-s.safetensors").write_bytes(b"x" * 5)
    (folder / "replicas" / "r00002-s.safetensors").write_bytes(b"y" * 7)
    (folder / "replicas" / ".r00003-s.safetensors.part-1-ab").write_bytes(b"z")
    (folder / "ranges" / "r00003-s.safetensors").mkdir(parents=True)
    (folder / "ranges" / "r00003-s.safetensors" / "10-14").write_bytes(b"abcd")
    (folder / "ranges" / "r00003-s.safetensors" / "20-30").write_bytes(b"short")  # torn: never counted
    (folder / "ranges" / "r00003-s.safetensors" / ".30-34.part-1-ab").write_bytes(b"abcd")
    inv = area.inventory()["3"]
    assert inv.save_id is None and inv.have == {"r00000-s.safetensors": (5, "r00000-s.safetensors"),
                                                "r00002-s.safetensors": (7, "replicas/r00002-s.safetensors")}
    assert inv.ranges == {"r00003-s.safetensors": [(10, 14, "ranges/r00003-s.safetensors/10-14")]}
    area.place(3, ["r00002-s.safetensors"])
    assert area.origin(3, "r00002-s.safetensors") == "replica" and area.origin(3, "r00000-s.safetensors") == "own"


def _transfer(rank: int, world: int, base: str) -> list[str]:
    from shardpoint.collective import Comm
    from shardpoint.tiers.replicate import BLOCK, Move, transfer

    comm = Comm()
    comm.open_side()
    folder = os.path.join(base, f"host{rank}")
    os.makedirs(folder, exist_ok=True)
    big = BLOCK + 12345  # more than one block
    if rank == 0:
        with open(os.path.join(folder, "big"), "wb") as f:
            f.write(bytes(range(256)) * (big // 256) + bytes(big % 256))
        with open(os.path.join(folder, "short"), "wb") as f:
            f.write(b"abc")  # the move says 10 bytes: its sender cannot send it whole
    moves = [Move("big", "big", big, 0, 1, "replicas/big"), Move("short", "short", 10, 0, 1, "replicas/short"),
             Move("gone", "gone", 4, 0, 1, "replicas/gone"),
             # a byte range across a block boundary, served from the middle of the file
             Move("big", "big", 5000, 0, 1, "ranges/big/piece", offset=BLOCK - 576, src_size=big)]
    problems = transfer(comm, folder, moves)
    return sorted(problems) + sorted(os.listdir(os.path.join(folder, "replicas"))) if rank == 1 else problems


def test_transfers_rename_whole_files_only(tmp_path: Path) -> None:
    from shardpoint.tiers.replicate import BLOCK

    base = str(tmp_path)
    sender, receiver = run_ranks(_transfer, 2, base, timeout=100)
    assert len(sender) == 2 and "has 3 bytes, 10 expected" in sender[0] + sender[1]
    assert receiver[-1:] == ["big"] and all("sender could not read it" in p for p in receiver[:-1])
    src, dst = Path(base, "host0", "big").read_bytes(), Path(base, "host1", "replicas", "big").read_bytes()
    assert src == dst and os.stat(Path(base, "host1", "replicas", "big")).st_mode & 0o077 == 0
    got = Path(base, "host1", "ranges", "big", "piece").read_bytes()
    assert got == src[BLOCK - 576: BLOCK - 576 + 5000]


def test_hosts_travel_as_runs() -> None:
    """The grouping every rank needs is sent as runs of ranks per host: its size grows with
    the hosts, not the ranks, and it comes back as it was, consecutive or not."""
    from shardpoint.tiers.hosts import Hosts

    for names in (["a"] * 8, ["a", "a", "b", "b", "c", "c"], ["a", "b", "a", "b"], [f"h{i // 8}" for i in range(8192)]):
        h = Hosts.of(names)
        assert Hosts.from_wire(h.wire()) == h
    assert len(Hosts.of([f"h{i // 8}" for i in range(8192)]).wire()["runs"]) == 1024


def test_files_on_no_present_host_come_from_the_root_only_when_it_holds_the_same_save() -> None:
    """Hosts B and C lost with replicas=1 (3 hosts x 1 rank: B's file was only on B and
    C): step 7 is still a candidate when the root holds step 7 of save s7, B's files read
    from there and everything else as before; with the root holding another save of
    step 7, or nothing, the step is passed over, naming what is lost."""
    a_only = Hosts.of(["a", "a"])
    # host A: its own ranks' files (0, 1) and its replicas of C's (4, 5); B's (2, 3) are nowhere
    inv_a = inventory(7, "s7", True, {**host_files([0, 1], "s7"), **host_files([4, 5], "s7", "replicas")}, world=6)
    asked: list[tuple[int, str]] = []

    def root_has(step: int, sid: str) -> bool:
        asked.append((step, sid))
        return (step, sid) == (7, "s7")

    [cand], passed = restore_plan(a_only, [inv_a], durable=7, rooted=root_has)
    assert asked == [(7, "s7")] and passed == {}
    assert (cand.step, cand.save_id, cand.fetch) == (7, "s7", [])
    assert cand.durable == sorted(host_files([2, 3], "s7"))  # the data files and their indexes
    # the root holds another save of step 7 (a later attempt's), or none: passed over as before
    for other in (lambda s, i: False, lambda s, i: (s, i) == (7, "s7-other"), None):
        cands, passed = restore_plan(a_only, [inv_a], durable=7, rooted=other)
        assert cands == [] and "4 of its files are on no present host" in passed[7]
        assert "the durable root holds no copy of this save" in passed[7]
    # a step whose files are all held never asks the root
    asked.clear()
    whole = inventory(7, "s7", True, {**host_files([0, 1], "s7"), **host_files([2, 3], "s7", "replicas")})
    [cand], _ = restore_plan(a_only, [whole], durable=None, rooted=root_has)
    assert asked == [] and cand.durable == []
    # over two hosts: an index on no host is read from the root too, never fetched; B' (empty) gets the rest
    two = Hosts.of(["a", "a", "b", "b"])
    [cand], _ = restore_plan(two, [inv_a, {}], durable=7, rooted=root_has)
    fetched = {m.name for m in cand.fetch}
    assert fetched == {n for n in host_files([0, 1, 4, 5], "s7") if n.endswith(".index.json")} | {MANIFEST_NAME}
    assert not fetched & set(cand.durable)
    # no re-drain: the root holds the step already
    assert redrain_parts(two, [inv_a, {}], cand, [7], 7) is None
    back = RestoreDecision.from_wire(RestoreDecision({}, [7], [cand]).wire())
    assert back.cands[0].durable == cand.durable
