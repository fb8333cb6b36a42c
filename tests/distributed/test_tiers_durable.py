"""The last rung of the restore ladder (issue 32, item 1), on real hosts (network
namespaces, as tests/distributed/test_tiers_peer.py): a snapshot some of whose files
are on no present host is still restored from memory when the durable root holds
the same save of it: every file a present host holds is read from memory (its own
host's, or a peer's byte ranges), and only the lost files' byte ranges that the
ranks read come from the root.

Needs root, ``ip netns`` and ``unshare``. If a namespace cannot be made, the test
fails under ``CI=true`` with the reason and is skipped (visibly) elsewhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_tiers_hosts import _env
from tests.distributed.test_tiers_peer import SLACK, check, hosts, new_run, resume, train_then_lose

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
MB = 12.0  # the ballast: 2 MiB of it per saving rank on 6 ranks, 3 MiB per rank on 4


def lost_files(root: Path, ranks: set[int]) -> dict[str, int]:
    """The files (data files and indexes) that the saving ``ranks`` wrote for step 7, with their sizes."""
    man = json.loads((root / "step-00000007" / "manifest.json").read_text())
    out = {}
    for name, e in man["files"].items():
        if int(e["rank"]) in ranks:
            out[name] = int(e["size"])
            out[e["index"]["name"]] = int(e["index"]["size"])
    return out


def from_root(results: list[dict[str, Any]], lost: dict[str, int], what: str) -> dict[str, dict[str, int]]:
    """Per host: the bytes its ranks read from the durable root and what they need of
    the lost files (as the restore planned it). Checks that only lost files were read
    from the root, and that everything else came from memory."""
    out: dict[str, dict[str, int]] = {}
    for got in results:
        rooted = {n for n, where in got["pieces"].items() if where == "durable"}
        assert rooted <= set(lost), (what, got["rank"], sorted(rooted - set(lost)))
        assert {n for n in got["pieces"] if n in lost} == rooted, (what, got["rank"], got["pieces"])
        h = out.setdefault(got["host"], {"read": 0, "needed": got["host_durable_needed"]})
        h["read"] += got["durable_read"]
    total = sum(lost.values())
    for name, h in out.items():
        print(f"{what}, host {name}: read {h['read']} B from the durable root; its ranks need {h['needed']} B of "
              f"the lost files; the lost files (data and indexes): {total} B")
    return out


def test_two_hosts_lost_with_replicas_1_the_lost_files_come_from_the_root(tmp_path: Path) -> None:
    """3 hosts x 2 ranks, ``replicas=1`` (host h's files also on host h+1), step 7 a
    snapshot drained to the root; hosts B and C lost together: B's ranks' files are on
    no present host (their replicas were on C), C's survive as replicas on A. The job
    restarts on A and an empty replacement B' (2 x 2): step 7 is restored from memory,
    A's own files and replicas read in place, the byte ranges B' needs of them fetched
    from A, and only B's lost files read from the root, each host only the ranges its
    ranks read. Then on A alone with 3 ranks (one host: no peers) the same. Byte-equal
    to the uninterrupted run at step 7, losses continuing equal."""
    env = {**_env(), "TIERS_DURABLE_EVERY": "7"}
    out, root, base, names, job, argv = new_run(tmp_path, "durable", "d", 3, str(MB))
    try:
        with hosts(3) as ns:
            train_then_lose(tmp_path, ns, names, 2, job, argv, env, [1, 2], base)
            mixed = resume(tmp_path, ns[:2], names, 2, 29611, job, argv, env, "mixed")
            alone = resume(tmp_path, ns[:1], names, 3, 29612, job, argv, env, "alone")
        check(mixed, out)
        check(alone, out)
        lost = lost_files(root, {2, 3})
        lost_data = sum(s for n, s in lost.items() if n.endswith(".safetensors"))
        rows = int(MB * (1 << 20)) // 1024  # the ballast's rows of 256 float32s, 1/6 of them per saving rank
        lost_ballast = 2 * (rows // 6) * 1024  # what old ranks 2 and 3 held of it: every restore needs it all
        total = sum(int(e["size"]) for e in json.loads((root / "step-00000007" / "manifest.json").read_text())[
            "files"].values())
        print(f"\nthe snapshot's data files: {total} B, of which lost (old ranks 2 and 3): {lost_data} B")

        got = from_root(mixed, lost, "A + empty B' (2 x 2)")
        a, b = got[names[0]], got[names[1]]
        for h in (a, b):  # each host needs part of the lost files, and reads that part, not the rest
            assert 0 < h["needed"] <= h["read"] <= 1.1 * h["needed"] + SLACK, got
            assert h["read"] < 0.75 * lost_data, got
        # between them the hosts read the lost files once, and nothing else from the root
        assert lost_ballast <= a["read"] + b["read"] <= 1.1 * lost_data + SLACK, (got, lost_data)
        for g in mixed:  # the survivors' files: from memory (own, replicas on A; B' fetched from A)
            kinds = set(g["pieces"].values())
            assert kinds - {"durable"} <= ({"own", "replica"} if g["host"] == names[0] else {"fetched"}), g
        for name in names[:2]:
            assert any("durable" in g["pieces"].values() for g in mixed if g["host"] == name), name
        assert sum(g["received"] for g in mixed if g["host"] == names[1]) > 0

        one = from_root(alone, lost, "A alone (3 ranks)")[names[0]]
        assert 0 < one["needed"] <= one["read"] <= 1.1 * one["needed"] + SLACK, one
        assert lost_ballast <= one["read"] <= sum(lost.values()), (one, lost)  # never more than the lost files
        for g in alone:
            assert set(g["pieces"].values()) - {"durable"} <= {"own", "replica"}, g
        assert sum(1 for g in alone if "durable" in g["pieces"].values()) >= 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
