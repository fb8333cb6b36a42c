"""Hostile and damaged manifests: whatever the manifest says, ``load``,
``load_full``, ``metadata`` and ``verify`` return or raise a ``ShardpointError``
(``verify`` may report problems instead), nothing hangs, and nothing outside the
checkpoint directory is opened.

A manifest is sealed (``format/digest.py``), so a damaged one never reaches the
parser. A hostile one can be sealed on purpose, so these cases seal each edited
manifest again (``_util.sealed``) to test the parser behind the seal; a few
cases (``seal-*``, ``unsealed``) attack the seal itself.

Every call runs in a sandbox worker process with a hard time bound (see
``_sandbox.py``); a call that blocks, say on opening a FIFO, fails the test as
``Hung`` instead of stalling the suite."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardpoint.format.digest import SEAL_HEADER_LEN, seal
from tests.failure._sandbox import Sandbox
from tests.failure._util import as_v1, as_v2, manifest, sealed, with_layouts

OUTSIDE = "outside.safetensors"  # a FIFO beside the checkpoint directory, where '../' names point


def check_outcomes(results: dict[str, dict[str, Any]], *, damaged: bool) -> None:
    """Only ShardpointError subclasses come out; with ``damaged``, verify must say so."""
    for call, r in results.items():
        assert r["ok"] or r["shardpoint"], f"{call} raised {r['type']} (not a ShardpointError):\n{r['traceback']}"
    v = results.get("verify")
    if damaged and v is not None and v["ok"]:
        assert not v["verified"] and v["problems"], "verify reported a damaged checkpoint as OK"


# -- hand-written cases -------------------------------------------------------------------

def _first_file(m: dict[str, Any]) -> str:
    return sorted(m["files"])[0]


def _rename_file(m: dict[str, Any], new: str) -> None:
    """Point the first data file's entry, and every chunk in it, at ``new``."""
    old = _first_file(m)
    m["files"][new] = m["files"].pop(old)

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if x.get("file") == old:
                x["file"] = new
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(m["entries"])


def _tensor(m: dict[str, Any], key: str = "model/w") -> dict[str, Any]:
    return m["entries"][key]


def _nest(depth: int) -> Any:
    v: Any = ["int", "1"]
    for _ in range(depth):
        v = [v]
    return v


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        x = m
        for p in path[:-1]:
            x = x[p]
        x[path[-1]] = value

    return edit


def _only_tensor(m: dict[str, Any], dtype: str, shape: list[int], nbytes: int, file_size: int | None = None) -> None:
    """One tensor of ``shape`` whose ``nbytes`` bytes the manifest says lie in a
    file of ``file_size`` bytes (default ``2 * nbytes``; the file is really 1 MiB)."""
    f = _first_file(m)
    m["checksum"]["block_size"] = 1 << 40
    m["files"] = {f: {"size": file_size or 2 * nbytes, "rank": 0}}
    m["entries"] = {"model/w": {"kind": "tensor", "dtype": dtype, "shape": shape, "chunks": [
        {"offsets": [0] * len(shape), "sizes": shape, "file": f, "offset": 0, "length": nbytes,
         "crc32": [0] * -(-nbytes // (1 << 40))}]}}


def _compact(m: dict[str, Any]) -> str:
    return json.dumps(m, separators=(",", ":"))


def _seal_as(m: dict[str, Any], hexd: bytes, prefix: bytes = b'{"seal":"sha256:') -> bytes:
    """``m`` behind a seal with the given (wrong) digest text."""
    return prefix + hexd + b'",' + _compact(m).encode()[1:]


def _seal_last(m: dict[str, Any]) -> bytes:
    """A correct digest of the body, but as the last member instead of the first."""
    body = _compact(m).encode()
    return body[:-1] + b',"seal":"' + seal(body)[9:SEAL_HEADER_LEN - 2] + b'"}'


def _crc_upper(m: dict[str, Any]) -> bytes:
    """The right CRC-32 seal of ``m`` in upper-case hex: ``save_id`` changed (and the
    seal made again) until the digest has a letter, so that upper case changes it."""
    for i in range(1000):
        m["save_id"] = f"{i:012x}"
        hexd = seal(_compact(m).encode(), "crc32")[15:23]
        if hexd != hexd.upper():
            return _seal_as(m, hexd.upper(), prefix=b'{"seal":"crc32:')
    raise AssertionError("no CRC-32 with a letter in 1000 tries")


def _seal_of_other(m: dict[str, Any]) -> bytes:
    """The seal of another manifest (step 8 instead of 7) on this one."""
    other = copy.deepcopy(m)
    other["entries"]["step"]["value"] = ["int", "8"]
    return seal(_compact(other).encode())[:SEAL_HEADER_LEN] + _compact(m).encode()[1:]


# each case edits the manifest dict (or returns raw bytes to write instead)
CASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "dotdot-file": lambda m: _rename_file(m, f"../{OUTSIDE}"),
    "dotdot-nested": lambda m: _rename_file(m, f"a/../../{OUTSIDE}"),
    "absolute-path": lambda m: _rename_file(m, "ABSOLUTE"),  # replaced by the FIFO's absolute path below
    "backslash-dotdot": lambda m: _rename_file(m, f"..\\{OUTSIDE}"),
    "manifest-as-data": lambda m: _rename_file(m, "manifest.json"),
    "empty-file-name": lambda m: _rename_file(m, ""),
    "huge-shape": lambda m: _only_tensor(m, "float32", [1 << 48], 1 << 50),
    "huge-shape-2d": lambda m: _only_tensor(m, "float64", [1 << 20, 1 << 20], 8 << 40),
    "huge-shape-short-chunk": lambda m: _only_tensor(m, "float32", [1 << 48], 400, file_size=1000),
    "64-dims": _set(("entries", "model/w", "shape"), [2] * 64),
    "65-dims": _set(("entries", "model/w", "shape"), [1] * 65),
    "negative-chunk-offsets": lambda m: _tensor(m)["chunks"][1].update(offsets=[-2, 0]),
    "negative-byte-offset": lambda m: _tensor(m)["chunks"][0].update(offset=-8),
    "negative-length": lambda m: _tensor(m)["chunks"][0].update(length=-48),
    "overlapping-chunks-with-gap": lambda m: _tensor(m)["chunks"][1].update(offsets=[1, 0]) or _tensor(m).update(shape=[4, 6]),
    "duplicate-chunk": lambda m: _tensor(m)["chunks"].__setitem__(1, copy.deepcopy(_tensor(m)["chunks"][0])),
    "chunk-past-file-end": lambda m: _tensor(m)["chunks"][0].update(offset=m["files"][_first_file(m)]["size"] - 8),
    "file-size-lies": lambda m: m["files"][_first_file(m)].update(size=1 << 40) or _tensor(m)["chunks"][0].update(offset=1 << 39),
    "length-does-not-match-box": lambda m: _tensor(m)["chunks"][0].update(length=40) or _tensor(m)["chunks"][0].update(crc32=[0]),
    "nan-created": lambda m: m.update(created=math.nan),
    "inf-created": lambda m: m.update(created=math.inf),
    "huge-created": lambda m: m.update(created=1e300),
    "nan-size": lambda m: m["files"][_first_file(m)].update(size=math.nan),
    "inf-shape": _set(("entries", "model/w", "shape"), [math.inf, 6]),
    "float-offsets": lambda m: _tensor(m)["chunks"][0].update(offset=344.0),
    "bool-size": lambda m: m["files"][_first_file(m)].update(size=True),
    "huge-world-size": lambda m: m.update(world_size=10**400),
    "huge-int-value": _set(("entries", "step", "value"), ["int", "9" * 4500]),
    "huge-int-key": lambda m: m["entries"].update({"1" * 5000: m["entries"].pop("step")}),
    "huge-int-container": lambda m: m["containers"].update({"9" * 5000: "dict"}),
    "superscript-rank": lambda m: m["entries"]["rng"]["ranks"].update({"\u00b2": m["entries"]["rng"]["ranks"]["1"]}),
    "rank-beyond-world": lambda m: m["entries"]["rng"]["ranks"].update({"7": m["entries"]["rng"]["ranks"]["1"]}),
    "per-rank-key-elsewhere": lambda m: m["entries"]["rng"]["ranks"]["0"].update(
        entries={"zzz": m["entries"]["rng"]["ranks"]["0"]["entries"]["rng/seed"]}),
    "per-rank-root-key": lambda m: m["entries"]["rng"]["ranks"]["0"].update(
        entries={"": m["entries"]["rng"]["ranks"]["0"]["entries"]["rng/seed"]}),
    "nested-per-rank": lambda m: m["entries"]["rng"]["ranks"]["0"]["entries"].update({"rng/x": copy.deepcopy(m["entries"]["rng"])}),
    "dtype-is-a-list": _set(("entries", "model/w", "dtype"), ["float32"]),
    "dtype-unknown": _set(("entries", "model/w", "dtype"), "object"),
    "numpy-bfloat16": lambda m: _tensor(m).update(dtype="bfloat16", shape=[4, 12], numpy=True) or [
        c.update(offsets=[c["offsets"][0], 0], sizes=[2, 12]) for c in _tensor(m)["chunks"]],
    "numpy-flag-not-bool": _set(("entries", "model/b", "numpy"), {"x": 1}),
    "crc-list-wrong-length": _set(("entries", "model/w", "chunks", 0, "crc32"), [1, 2, 3]),
    "crc-huge": _set(("entries", "model/w", "chunks", 0, "crc32"), [1 << 70]),
    "block-size-zero": _set(("checksum", "block_size"), 0),
    "block-size-one": _set(("checksum", "block_size"), 1),
    "unknown-kind": _set(("entries", "step", "kind"), "pickle"),
    "value-is-pickle": _set(("entries", "step", "value"), ["pickle", "gASVAAAAAAAAAAA="]),
    "container-unknown-type": lambda m: m["containers"].update(model="set"),
    "root-is-a-list": lambda m: m["containers"].update({"": "list"}),
    "root-leaf-beside-others": lambda m: m["entries"].update({"": m["entries"]["step"]}),
    "leaf-under-leaf": lambda m: m["entries"].update({"step/x": m["entries"]["model/b"]}),
    "entries-is-a-list": _set(("entries",), []),
    "files-is-a-list": _set(("files",), []),
    "chunk-is-a-string": _set(("entries", "model/w", "chunks"), ["chunk"]),
    "version-from-the-future": lambda m: m.update(version=99),
    "not-shardpoint": lambda m: m.update(format="torch-dcp"),
    "deep-value": _set(("entries", "step", "value"), _nest(900)),
    "deep-json": lambda m: b"[" * 200_000 + b"]" * 200_000,
    "deep-json-in-entry": lambda m: _compact(m).replace('"step":{', '"step":' + "[" * 50_000 + "]" * 50_000 + ',"x":{', 1).encode(),
    "nan-literals": lambda m: _compact(m).replace('"size":', '"size":NaN,"s":', 1).encode(),
    "not-json": lambda m: b"\x80\x04\x95 pickle? no.",
    "empty": lambda m: b"",
    "json-array": lambda m: b"[1, 2, 3]",
    "lone-surrogate-key": lambda m: _compact(m).replace('"model/b"', '"model/\\ud800"').encode(),
    "utf16": lambda m: json.dumps(m).encode("utf-16"),
    # the seal itself (these are written as they are, not sealed again)
    "unsealed": lambda m: _compact(m).encode(),
    "seal-wrong-digest": lambda m: _seal_as(m, b"0" * 64),
    "seal-not-hex": lambda m: _seal_as(m, b"g" * 64),
    "seal-upper-case": lambda m: _seal_as(m, seal(_compact(m).encode())[16:80].upper()),
    "seal-short": lambda m: _seal_as(m, b"abc"),
    "seal-other-algorithm": lambda m: _seal_as(m, b"0" * 32, prefix=b'{"seal":"md5:'),
    "seal-not-first": _seal_last,
    "seal-of-another-manifest": _seal_of_other,
    "seal-of-nothing": lambda m: seal(b'{"x":1}')[:SEAL_HEADER_LEN],
    # the CRC-32 seal a version-3 manifest is written with
    "seal-crc-wrong-digest": lambda m: _seal_as(m, b"0" * 8, prefix=b'{"seal":"crc32:'),
    "seal-crc-upper-case": lambda m: _crc_upper(m),
    "seal-crc-long": lambda m: _seal_as(m, seal(_compact(m).encode(), "crc32")[15:23] + b"0",
                                        prefix=b'{"seal":"crc32:'),
    "seal-crc-of-another-manifest": lambda m: seal(_compact(dict(m, save_id="x")).encode(), "crc32")[:25]
                                              + _compact(m).encode()[1:],
}
#: Cases written as they are: the seal is what they test.
UNSEALED = {c for c in CASES if c == "unsealed" or c.startswith("seal-")}


def _sealed_if_possible(raw: bytes) -> bytes:
    """``raw`` sealed when it is the text of a JSON object (a seal needs one), else as is."""
    try:
        return sealed(raw)
    except ValueError:
        return raw


#: Cases that are odd but not damage: verify may call them OK.
BENIGN = {"lone-surrogate-key"}


@pytest.fixture
def hostile(sample: Path) -> Path:
    """The sample checkpoint, with a FIFO beside it where '../' names point."""
    os.mkfifo(sample.parent / OUTSIDE)
    return sample


def test_fifo_would_block() -> None:
    """Control for the FIFO cases: opening the FIFO really blocks (until a writer
    comes), so a reader that followed a '../' name would hang, and the time bound
    would fail the test."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        fifo = os.path.join(d, OUTSIDE)
        os.mkfifo(fifo)
        opened = threading.Event()

        def reader() -> None:
            with open(fifo, "rb"):
                opened.set()

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        assert not opened.wait(0.3), "opening a FIFO with no writer returned at once"
        os.close(os.open(fifo, os.O_WRONLY))  # let the reader go
        t.join(5)
        assert opened.is_set()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_manifest(case: str, hostile: Path, sandbox: Sandbox) -> None:
    if case in UNSEALED:  # a version 2 manifest whose seal is missing or broken
        m = manifest(hostile)
        del m["seal"]
    else:
        m = as_v1(hostile)  # these cases damage chunk fields, which a version 1 manifest lists (still read)
    raw = CASES[case](m)
    if case == "absolute-path":
        raw = json.dumps(m).replace('"ABSOLUTE"', json.dumps(str(hostile.parent / OUTSIDE))).encode()
    data = raw if isinstance(raw, bytes) else json.dumps(m).encode()
    written = data if case in UNSEALED else _sealed_if_possible(data)
    (hostile / "manifest.json").write_bytes(written)
    results = sandbox.run(str(hostile))
    assert raw is None or json.dumps(m).encode() != raw, "the case changed nothing"
    check_outcomes(results, damaged=case not in BENIGN)
    for call in ("load", "load_full", "metadata"):
        msg = results[call].get("message", "")
        if case in UNSEALED:  # refused at the seal, before the parser
            assert not results[call]["ok"] and ("seal" in msg or "SHA-256" in msg), msg
        elif written != data:  # sealed again: the parser, not the seal, decided
            assert "seal" not in msg and "SHA-256" not in msg, msg
    # a '../' or absolute name is refused before any I/O, so the FIFO was never opened
    if case in ("dotdot-file", "dotdot-nested", "absolute-path"):
        for call in ("load", "load_full", "metadata"):
            assert not results[call]["ok"] and "not a plain relative name" in results[call]["message"]


def _index_of(m: dict[str, Any]) -> str:
    return m["files"][_first_file(m)]["index"]["name"]


def _grid(m: dict[str, Any], key: str = "model/b") -> dict[str, Any]:
    return m["entries"][key]["grid"]


#: Cases of V2_CASES that damage a version-3 index record (a CRC-32), made in that form.
V3_INDEX_CASES = {"index-crc-wrong", "index-crc-not-int", "index-crc-too-big"}

# version 2: compact layouts and the per-file index objects the manifest protects by digest
V2_CASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "grid-cuts-zero": lambda m: _grid(m).update(cuts=[0]),
    "grid-cuts-negative": lambda m: _grid(m).update(cuts=[-1]),
    "grid-cuts-huge-count": lambda m: _tensor(m).update(shape=[1 << 40], grid={"cuts": [1], "ranks": {"first": 0, "step": 0}}),
    "grid-cuts-not-increasing": lambda m: _grid(m).update(cuts=[[0, 3, 2, 5]], ranks=[0, 0, 0]),
    "grid-cuts-wrong-end": lambda m: _grid(m).update(cuts=[[0, 7]]),
    "grid-cuts-float": lambda m: _grid(m).update(cuts=[2.5]),
    "grid-cuts-wrong-count": lambda m: _grid(m).update(cuts=[5, 5]),
    "grid-ranks-beyond-world": lambda m: _grid(m).update(ranks=[9]),
    "grid-ranks-too-few": lambda m: _grid(m).update(cuts=[1]),
    "grid-ranks-step-out": lambda m: _grid(m).update(cuts=[1], ranks={"first": 1, "step": 5}),
    "grid-ranks-extra-field": lambda m: _grid(m).update(ranks={"first": 0, "step": 0, "x": 1}),
    "grid-and-chunks": lambda m: m["entries"]["model/b"].update(chunks=[]),
    "no-layout": lambda m: [m["entries"]["model/b"].pop(f, None) for f in ("grid", "flat", "chunks")],
    "grid-rank-without-file": lambda m: [m["files"].pop(f) for f in sorted(m["files"]) if m["files"][f]["rank"] == 0],
    "flat-gap": lambda m: _tensor(m).update(flat=[[0, 10, 0], [11, 24, 1]]) or _tensor(m).pop("grid", None),
    "flat-past-end": lambda m: _tensor(m).update(flat=[[0, 30, 0]]) or _tensor(m).pop("grid", None),
    "flat-not-a-list": lambda m: _tensor(m).update(flat={"0": 1}) or _tensor(m).pop("grid", None),
    "flat-wrong-rank": lambda m: _tensor(m).update(flat=[[0, 24, 5]]) or _tensor(m).pop("grid", None),
    "flat-unknown-boxes": lambda m: _tensor(m).update(flat=[[0, 7, 0], [7, 24, 1]]) or _tensor(m).pop("grid", None),
    "chunks-v2-no-rank": lambda m: _tensor(m).update(chunks=[{"offsets": [0, 0], "sizes": [4, 6]}]) or _tensor(m).pop("grid", None),
    "chunks-v2-wrong-box": lambda m: _tensor(m).update(chunks=[{"offsets": [0, 0], "sizes": [4, 6], "rank": 0}])
    or _tensor(m).pop("grid", None),
    "index-missing": lambda m: m["files"][_first_file(m)].pop("index"),
    "index-sha-wrong": lambda m: m["files"][_first_file(m)]["index"].update(sha256="0" * 64),
    "index-sha-not-hex": lambda m: m["files"][_first_file(m)]["index"].update(sha256="zz"),
    "index-crc-wrong": lambda m: m["files"][_first_file(m)]["index"].update(crc32=(m["files"][_first_file(m)]["index"]["crc32"] + 1) % (1 << 32)),
    "index-crc-not-int": lambda m: m["files"][_first_file(m)]["index"].update(crc32="0"),
    "index-crc-too-big": lambda m: m["files"][_first_file(m)]["index"].update(crc32=1 << 32),
    "index-size-lies": lambda m: m["files"][_first_file(m)]["index"].update(size=1 << 40),
    "index-dotdot": lambda m: m["files"][_first_file(m)]["index"].update(name=f"../{OUTSIDE}"),
    "index-is-manifest": lambda m: m["files"][_first_file(m)]["index"].update(name="manifest.json"),
    "index-is-data": lambda m: m["files"][_first_file(m)]["index"].update(name=_first_file(m)),
    "two-files-one-rank": lambda m: [f.update(rank=0) for f in m["files"].values()],
    "file-rank-missing": lambda m: m["files"][_first_file(m)].pop("rank"),
    "health-nan-not-a-list": lambda m: m.update(health={"nonfinite": ["model/w"], "nan": "model/w", "metrics": {}}),
    "health-roles-not-names": lambda m: m.update(health={"nonfinite": ["model/w"], "nan": [], "roles": {"model/w": 1},
                                                        "metrics": {}}),
}


def _resign(m: dict[str, Any], path: Path, name: str, data: bytes) -> None:
    """Write index ``name`` with ``data`` and record its true digest, so the damage
    is inside a trusted-looking index."""
    import zlib

    (path / name).write_bytes(data)
    for f in m["files"].values():
        if f["index"]["name"] == name:
            f["index"].update(size=len(data), crc32=zlib.crc32(data))


# index objects whose digest matches (a writer that lies): every field is still checked
INDEX_CASES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "not-json": lambda ix: b"\x80 not json",
    "deep-json": lambda ix: b"[" * 100_000 + b"]" * 100_000,
    "other-file": lambda ix: ix.update(file="r00009-x.safetensors"),
    "chunks-a-list": lambda ix: ix.update(chunks=[]),
    "entry-short": lambda ix: [ix["chunks"].update({k: [0, 4]}) for k in list(ix["chunks"])[:1]],
    "entry-past-end": lambda ix: [ix["chunks"].update({k: [1 << 40, 4, [0]]}) for k in list(ix["chunks"])[:1]],
    "entry-negative": lambda ix: [ix["chunks"].update({k: [-8, 4, [0]]}) for k in list(ix["chunks"])[:1]],
    "entry-crc-count": lambda ix: [v.__setitem__(2, [1, 2, 3]) for v in list(ix["chunks"].values())[:1]],
    "entry-crc-huge": lambda ix: [v.__setitem__(2, [1 << 40]) for v in list(ix["chunks"].values())[:1]],
    "entry-length-lies": lambda ix: [v.__setitem__(1, v[1] - 4) for v in list(ix["chunks"].values())[:1]],
    "entry-missing": lambda ix: [ix["chunks"].pop(k) for k in list(ix["chunks"])[:1]],
    "entry-moved": lambda ix: [v.__setitem__(0, v[0] - 4) for v in list(ix["chunks"].values())[:1]],
}


@pytest.mark.parametrize("case", sorted(V2_CASES))
@pytest.mark.parametrize("version", [2, 3])
def test_hostile_v2_manifest(case: str, version: int, hostile: Path, sandbox: Sandbox) -> None:
    """A version 2 manifest whose layout fields or index records are damaged, and the
    same damage in a version 3 manifest (the layout in a row of its table), sealed so
    that the parser decides: a ShardpointError (CorruptCheckpointError) from every
    call, never another exception."""
    index_case = case.startswith("index-")  # damage to the index record: made in the version's own form
    if version == 2 and case in V3_INDEX_CASES:
        pytest.skip("a version-3 index record (its CRC-32)")
    m = as_v2(hostile)
    if version == 3 and index_case:
        with_layouts(m, hostile)
    before = json.dumps(m)
    V2_CASES[case](m)
    assert json.dumps(m) != before, "the case changed nothing"
    if version == 3 and not index_case:  # the layout damaged, then moved into a row of the table
        with_layouts(m, hostile)
    (hostile / "manifest.json").write_bytes(sealed(m))
    results = sandbox.run(str(hostile))
    check_outcomes(results, damaged=True)
    for call in ("load", "load_full"):
        assert not results[call]["ok"], f"{call} accepted a damaged manifest ({case})"
        assert "seal" not in results[call].get("message", ""), results[call]  # the parser refused it


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_hostile_index_object(case: str, hostile: Path, sandbox: Sandbox) -> None:
    """An index object damaged, its digest in the manifest updated to match: every
    field of the index is still checked before use."""
    m = manifest(hostile)
    name = _index_of(m)
    ix = json.loads((hostile / name).read_text())
    raw = INDEX_CASES[case](ix)
    data = raw if isinstance(raw, bytes) else json.dumps(ix).encode()
    _resign(m, hostile, name, data)
    (hostile / "manifest.json").write_text(json.dumps(m))
    results = sandbox.run(str(hostile))
    check_outcomes(results, damaged=True)
    assert not results["load_full"]["ok"], f"load_full accepted a damaged index ({case})"


def test_index_bytes_changed_under_the_manifest(hostile: Path, sandbox: Sandbox) -> None:
    """An index whose bytes differ from the digest the manifest committed is refused
    before it is parsed."""
    m = manifest(hostile)
    p = hostile / _index_of(m)
    p.write_bytes(p.read_bytes().replace(b'"format"', b'"Format"'))
    results = sandbox.run(str(hostile))
    check_outcomes(results, damaged=True)
    assert not results["load_full"]["ok"] and "CRC-32" in results["load_full"]["message"]


def test_fifo_inside_checkpoint(hostile: Path, sandbox: Sandbox) -> None:
    """A data file (or the manifest) that is a FIFO inside the checkpoint: refused,
    not opened for a blocking read."""
    f = sorted(manifest(hostile)["files"])[0]
    os.remove(hostile / f)
    os.mkfifo(hostile / f)
    check_outcomes(sandbox.run(str(hostile)), damaged=True)
    shutil.copy(hostile / "manifest.json", hostile / "m.bak")
    os.remove(hostile / "manifest.json")
    os.mkfifo(hostile / "manifest.json")
    check_outcomes(sandbox.run(str(hostile)), damaged=True)


def test_directory_as_data_file(hostile: Path, sandbox: Sandbox) -> None:
    f = sorted(manifest(hostile)["files"])[0]
    os.remove(hostile / f)
    os.mkdir(hostile / f)
    check_outcomes(sandbox.run(str(hostile)), damaged=True)


def test_symlink_to_outside_fifo(hostile: Path, sandbox: Sandbox) -> None:
    """A data file that is a symlink to the FIFO outside: still never blocks."""
    f = sorted(manifest(hostile)["files"])[0]
    os.remove(hostile / f)
    os.symlink(hostile.parent / OUTSIDE, hostile / f)
    check_outcomes(sandbox.run(str(hostile)), damaged=True)


# -- generated mutations -------------------------------------------------------------------

def _paths(x: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, here + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, here + (i,))
    return out


_SPECIAL_STRINGS = ["../" + OUTSIDE, "/etc/passwd", "manifest.json", "", ".", "..", "float32", "bfloat16", "tensor",
                    "per_rank", "value", "dict", "list", "model/w", "0", "1", "-1", "%", "%ZZ", "\u00b2", "a/../b"]
_SPECIAL_INTS = [-1, 0, 1, 2, 7, 63, 64, 65, 1 << 20, (1 << 31) - 1, 1 << 32, (1 << 62) - 1, 1 << 62, 1 << 63, 1 << 64, -(1 << 63), 10**30]

json_scalars = (
    st.none() | st.booleans() | st.sampled_from(_SPECIAL_INTS) | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(_SPECIAL_STRINGS) | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(_SPECIAL_STRINGS) | st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_manifests(draw: Any, base: dict[str, Any]) -> bytes:
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "number", "duplicate", "swap-type"]))
        if not path:
            continue
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        cur = parent[last]
        if op == "delete":
            del parent[last]
        elif op == "number":
            parent[last] = draw(st.sampled_from(_SPECIAL_INTS) | st.floats(allow_nan=True, allow_infinity=True))
        elif op == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(cur))
        elif op == "swap-type":
            parent[last] = [cur] if not isinstance(cur, list) else {"x": cur}
        else:
            parent[last] = draw(json_values)
    raw = json.dumps(doc, allow_nan=True).encode()
    if draw(st.integers(0, 9)) == 0:  # now and then, damage the bytes instead of the structure
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + draw(st.integers(0, 2)) :]
    how = draw(st.sampled_from(["seal"] * 8 + ["seal, then damage", "unsealed"]))
    if how != "unsealed":  # sealed again, the mutation reaches the parser
        raw = _sealed_if_possible(raw)
    if how == "seal, then damage":
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ (1 << draw(st.integers(0, 7)))]) + raw[i + 1 :]
    return raw


_EXAMPLES = int(os.environ.get("SHARDPOINT_HOSTILE_EXAMPLES", 150))


def test_generated_hostile_manifests(_sample_master: Path, tmp_path_factory: pytest.TempPathFactory, sandbox: Sandbox) -> None:
    work = tmp_path_factory.mktemp("hostile") / "ckpt"
    shutil.copytree(_sample_master, work)
    os.mkfifo(work.parent / OUTSIDE)
    base = manifest(work)
    del base["seal"]

    @settings(max_examples=_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=mutated_manifests(base))
    def run(raw: bytes) -> None:
        (work / "manifest.json").write_bytes(raw)
        check_outcomes(sandbox.run(str(work)), damaged=False)

    run()


# -- incremental references (format/refs.py) ------------------------------------------------------
def _incremental_pair(root: Path) -> Path:
    """``root/step-00000000`` (full) and ``root/step-00000001``, whose tensor is a
    reference into step 0's data file. Returns step 1's folder."""
    import torch

    import shardpoint

    mgr = shardpoint.CheckpointManager(root, incremental=True)
    w = torch.arange(4096, dtype=torch.float32)
    mgr.save({"model": {"w": w}}, 0)
    mgr.save({"model": {"w": w}}, 1)
    return root / "step-00000001"


def _retarget(m: dict[str, Any], path: Path, new: str) -> None:
    """Point step 1's reference (manifest 'refs' and index entries) at ``new``."""
    (old,) = list(m["refs"])
    m["refs"][new] = m["refs"].pop(old)
    name = _index_of(m)
    ix = json.loads((path / name).read_text())
    for v in ix["chunks"].values():
        if len(v) == 4:
            v[3] = new
    _resign(m, path, name, json.dumps(ix).encode())


def _own_file(m: dict[str, Any]) -> str:
    return f"../step-00000001/{_first_file(m)}"


REF_CASES: dict[str, Callable[[dict[str, Any], Path], Any]] = {
    # '../' beyond the manager's root, to the FIFO beside it
    "ref-beyond-root": lambda m, p: _retarget(m, p, f"../../{OUTSIDE}"),
    "ref-absolute": lambda m, p: _retarget(m, p, "/etc/passwd.safetensors"),
    "ref-dotdot-folder": lambda m, p: _retarget(m, p, "../../x.safetensors"),
    # a reference that would chain to metadata (a manifest, an index) instead of data: refused, so no cycle can form
    "ref-to-manifest": lambda m, p: _retarget(m, p, "../step-00000000/manifest.json"),
    "ref-to-index": lambda m, p: _retarget(m, p, "../step-00000000/" + sorted(
        f.name for f in (p.parent / "step-00000000").glob("*.index.json"))[0]),
    # a cycle: the checkpoint referring to its own folder
    "ref-cycle-self": lambda m, p: _retarget(m, p, _own_file(m)),
    "ref-missing-target": lambda m, p: _retarget(m, p, "../step-00000000/r00000-000000000000.safetensors"),
    "ref-target-deleted": lambda m, p: [os.remove(f) for f in (p.parent / "step-00000000").glob("*.safetensors")],
    "ref-not-listed": lambda m, p: m["refs"].clear(),
    "ref-size-lies": lambda m, p: [r.update(size=8) for r in m["refs"].values()],
    "ref-not-an-object": lambda m, p: m.update(refs=["../step-00000000/x.safetensors"]),
    "ref-fifo": lambda m, p: (os.mkfifo(p.parent / "step-00000000" / "fifo.safetensors"),
                              _retarget(m, p, "../step-00000000/fifo.safetensors")),
}


@pytest.mark.parametrize("case", sorted(REF_CASES))
def test_hostile_reference(case: str, tmp_path: Path, sandbox: Sandbox) -> None:
    """A hostile or dangling reference: a ShardpointError from load, load_full,
    metadata or verify (verify reports it), never another exception, never a hang,
    and nothing outside the manager's root is opened."""
    root = tmp_path / "root"
    path = _incremental_pair(root)
    os.mkfifo(tmp_path / OUTSIDE)  # where '../../' would lead
    m = manifest(path)
    assert m["refs"], "the sample holds no reference"
    REF_CASES[case](m, path)
    (path / "manifest.json").write_bytes(sealed(m))
    results = sandbox.run(str(path))
    check_outcomes(results, damaged=True)
    for call in ("load", "load_full"):
        assert not results[call]["ok"], f"{call} accepted a hostile reference ({case})"
