"""The on-disk format as docs/format.md writes it down: an independent reader
built from the document alone agrees with shardpoint; exact bytes of a data file
and a manifest; block checksums; hostile manifests are refused."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import shardpoint
from shardpoint import CorruptCheckpointError
from shardpoint.format import manifest as mf
from shardpoint.format.model import TensorEntry
from shardpoint.layout import FlatShard
from tests.failure._util import sealed

# --- a reader written from docs/format.md alone (json, struct, zlib; no shardpoint) --------

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
ST_CODE = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


class Raw:
    """A tensor as the document describes it: dtype name, shape, row-major bytes."""

    def __init__(self, dtype: str, shape: tuple[int, ...], data: bytes, numpy: bool = False) -> None:
        self.dtype, self.shape, self.data, self.numpy = dtype, shape, data, numpy

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raw) and (self.dtype, self.shape, self.data) == (other.dtype, other.shape, other.data)

    def __repr__(self) -> str:
        return f"Raw({self.dtype}, {self.shape}, {len(self.data)} bytes)"


def doc_decode_key(key: str) -> tuple:
    if key == "":
        return ()
    out: list[Any] = []
    for seg in key.split("/"):
        if re.fullmatch(r"-?[0-9]+", seg):
            out.append(int(seg))
        elif seg == "%":
            out.append("")
        else:
            out.append(re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), seg))
    return tuple(out)


def doc_value(v: list) -> Any:
    kind = v[0]
    if kind == "none":
        return None
    return {"bool": lambda p: p, "int": int, "float": float.fromhex, "str": lambda p: p,
            "bytes": base64.b64decode}[kind](v[1])


def doc_flat_boxes(shape: tuple, start: int, stop: int) -> list[tuple[list[int], list[int]]]:
    """Section 3.3: the boxes of the flat range [start, stop) of a tensor of ``shape``."""
    out: list[tuple[list[int], list[int]]] = []

    def rec(prefix: list[int], d: int, lo: int, hi: int) -> None:
        ones = [1] * len(prefix)
        if d == len(shape) - 1:
            out.append((prefix + [lo], ones + [hi - lo]))
            return
        inner = math.prod(shape[d + 1 :])
        rest0, rest = [0] * (len(shape) - d - 1), list(shape[d + 1 :])
        a, b = lo // inner, (hi - 1) // inner
        if lo % inner == 0 and hi % inner == 0:
            out.append((prefix + [a] + rest0, ones + [b - a + 1] + rest))
        elif a == b:
            rec(prefix + [a], d + 1, lo - a * inner, hi - a * inner)
        else:
            first = a
            if lo % inner:
                rec(prefix + [a], d + 1, lo - a * inner, inner)
                first = a + 1
            last = b + 1 if hi % inner == 0 else b
            if last > first:
                out.append((prefix + [first] + rest0, ones + [last - first] + rest))
            if hi % inner:
                rec(prefix + [b], d + 1, 0, hi - b * inner)

    if stop > start:
        if shape:
            rec([], 0, start, stop)
        else:
            out.append(([], []))
    return out


def doc_entry(m: dict, e: dict) -> dict:
    """A tensor entry as version 2 spells it out: in version 3 the entry names a row of
    the ``layouts`` table, which holds its shape and layout (section 3.3)."""
    if m["version"] < 3 or "shape" in e:
        return e
    assert set(e) <= {"kind", "dtype", "layout", "numpy"}
    return {**m["layouts"][e["layout"]], **{k: v for k, v in e.items() if k != "layout"}}


def doc_chunks(root: Path, m: dict, key: str, e: dict, per_rank: bool) -> list[dict]:
    """The chunks of a tensor entry with file, offset, length and crc32 (section 3.2;
    versions 2 and 3: section 3.3 and the file's index, section 4.1)."""
    if m["version"] == 1:
        return e["chunks"]
    e = doc_entry(m, e)
    shape = tuple(e["shape"])
    boxes: list[tuple[list[int], list[int], int]] = []
    if "grid" in e:
        pieces = []
        for spec, n in zip(e["grid"]["cuts"], shape, strict=True):
            cuts = spec if isinstance(spec, list) else list(range(0, n, spec)) + [n]
            pieces.append(list(zip(cuts[:-1], cuts[1:])))
        ranks = e["grid"]["ranks"]
        for i, cell in enumerate(itertools.product(*pieces)):
            rank = ranks[i] if isinstance(ranks, list) else ranks["first"] + i * ranks["step"]
            boxes.append(([a for a, _ in cell], [b - a for a, b in cell], rank))
    elif "flat" in e:
        for start, stop, rank in e["flat"]:
            boxes += [(off, size, rank) for off, size in doc_flat_boxes(shape, start, stop)]
    else:
        boxes = [(c["offsets"], c["sizes"], c["rank"]) for c in e["chunks"]]
    out = []
    for off, size, rank in boxes:
        (fname,) = [f for f, info in m["files"].items() if info["rank"] == rank]
        rec = m["files"][fname]["index"]
        raw = (root / rec["name"]).read_bytes()
        if m["version"] == 2:
            assert len(raw) == rec["size"] and hashlib.sha256(raw).hexdigest() == rec["sha256"] and "crc32" not in rec
        else:  # version 3: the index's CRC-32
            assert len(raw) == rec["size"] and zlib.crc32(raw) == rec["crc32"] and "sha256" not in rec
        index = json.loads(raw)
        assert index["format"] == "shardpoint-index" and index["file"] == fname
        name = ("/per_rank/" if per_rank else "") + key + "@" + ",".join(map(str, off))
        offset, length, crcs = index["chunks"][name]
        out.append({"offsets": off, "sizes": size, "file": fname, "offset": offset, "length": length, "crc32": crcs})
    return out


def doc_tensor(root: Path, m: dict, key: str, e: dict, per_rank: bool) -> Raw:
    block, files = m["checksum"]["block_size"], m["files"]
    e = doc_entry(m, e)
    shape = tuple(e["shape"])
    item = ITEMSIZE[e["dtype"]]
    numel = math.prod(shape)
    out = bytearray(numel * item)
    strides = [item] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    for c in doc_chunks(root, m, key, e, per_rank):
        assert c["file"] in files
        raw = (root / c["file"]).read_bytes()
        # section 4: the chunk is one safetensors tensor
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        assert n % 8 == 0 and header["__metadata__"] == {"format": "shardpoint"}
        (name,) = [k for k, h in header.items() if k != "__metadata__" and 8 + n + h["data_offsets"][0] == c["offset"]
                   and h["data_offsets"][1] - h["data_offsets"][0] == c["length"]]
        h = header[name]
        if e["dtype"] in ST_CODE:
            assert h["dtype"] == ST_CODE[e["dtype"]] and h["shape"] == c["sizes"], name
        else:
            assert h["dtype"] == "U8" and h["shape"] == [c["length"]], name
        data = raw[c["offset"] : c["offset"] + c["length"]]
        assert len(data) == c["length"] == math.prod(c["sizes"]) * item
        # section 6: block checksums
        want = [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)] or [0]
        assert c["crc32"] == want, f"checksum of a chunk in {c['file']}"
        # section 3.2: copy the box, row by row (the innermost dimension is contiguous)
        sizes, offs = c["sizes"], c["offsets"]
        if not shape:
            out[:] = data
            continue
        row = sizes[-1] * item
        if row == 0 or math.prod(sizes) == 0:
            continue
        for r, idx in enumerate(itertools.product(*(range(s) for s in sizes[:-1]))):
            dst = sum((o + i) * st for o, i, st in zip(offs[:-1], idx, strides[:-1], strict=True)) + offs[-1] * item
            out[dst : dst + row] = data[r * row : (r + 1) * row]
    return Raw(e["dtype"], shape, bytes(out), bool(e.get("numpy")))


def doc_tree(root: Path, m: dict, containers: dict, entries: dict, base: tuple = (), per_rank: bool = False) -> Any:
    nodes: dict[tuple, Any] = {}
    kinds = {doc_decode_key(k): t for k, t in containers.items()}
    for path in sorted(kinds, key=len):
        nodes[path] = {}
    for k, e in entries.items():
        path = doc_decode_key(k)
        if e["kind"] == "value":
            v = doc_value(e["value"])
        elif e["kind"] == "tensor":
            v = doc_tensor(root, m, k, e, per_rank)
        else:
            v = {int(r): doc_tree(root, m, sub["containers"], sub["entries"], path, True) for r, sub in e["ranks"].items()}
        if path == base:
            return v
        nodes[path[:-1]][path[-1]] = v
    for path in sorted(kinds, key=len, reverse=True):  # deepest first: typed containers into parents
        d = nodes[path]
        val: Any = d
        if kinds[path] in ("list", "tuple"):
            seq = [d[i] for i in range(len(d))]
            val = seq if kinds[path] == "list" else tuple(seq)
        if path == base:
            return val
        nodes[path[:-1]][path[-1]] = val
    raise AssertionError("no root")


def doc_read(root: Path) -> Any:
    raw = (root / "manifest.json").read_bytes()
    m = json.loads(raw.decode("utf-8"))
    assert m["format"] == "shardpoint" and m["version"] in (1, 2, 3)
    if m["version"] == 2:  # the seal: SHA-256 of the document without its first member
        assert raw[:16] == b'{"seal":"sha256:' and raw[80:82] == b'",'
        assert hashlib.sha256(b"{" + raw[82:]).hexdigest() == raw[16:80].decode()
    elif m["version"] == 3:  # the seal: CRC-32 of the document without its first member
        assert raw[:15] == b'{"seal":"crc32:' and raw[23:25] == b'",'
        assert f"{zlib.crc32(b'{' + raw[25:]):08x}" == raw[15:23].decode()
    assert m["checksum"]["algorithm"] == "crc32"
    for name, info in m["files"].items():
        assert (root / name).stat().st_size == info["size"] and 0 <= info["rank"] < m["world_size"]
    return doc_tree(root, m, m["containers"], m["entries"])


def as_raw(x: Any) -> Any:
    """shardpoint's load_full result in the reader's terms."""
    import numpy as np

    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
        t = x.contiguous()
        return Raw(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes(), True)
    if isinstance(x, torch.Tensor):
        t = x.contiguous()
        return Raw(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(x, dict):
        return {k: as_raw(v) for k, v in x.items()}
    if isinstance(x, list):
        return [as_raw(v) for v in x]
    if isinstance(x, tuple):
        return tuple(as_raw(v) for v in x)
    return x


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def rich_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {"layers.0.weight": torch.randn(5, 3, generator=g), "emb": torch.randn(4, 2, generator=g).to(torch.bfloat16)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=g)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
        "odd": {"a/b": 1, "%": b"\x00\x01", "0": "str zero", 0: "int zero", -1: None, "": math.inf, "nan": math.nan},
        "c": torch.complex(torch.arange(3.0), -torch.arange(3.0)),
        "f8": torch.linspace(-2, 2, 6).to(torch.float8_e4m3fnuz),
        "flat": FlatShard(torch.arange(12, dtype=torch.int16), (3, 4), 0),
        "rng": shardpoint.PerRank({"seed": 7, "state": torch.arange(4, dtype=torch.uint8)}),
        "empty": {"d": {}, "l": []},
        "zero": torch.zeros(0, 3),
    }


def test_document_reader_agrees_with_load_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardpoint.format.datafile as df
    import shardpoint.saving.coordinator as coord_mod

    # small checksum blocks, so chunks span several
    monkeypatch.setattr(df, "CRC_BLOCK", 16)
    monkeypatch.setattr(coord_mod, "CRC_BLOCK", 16)
    shardpoint.save(rich_state(), tmp_path / "ckpt")
    mine = doc_read(tmp_path / "ckpt")
    theirs = as_raw(shardpoint.load_full(tmp_path / "ckpt"))
    assert mine["odd"] == {"a/b": 1, "%": b"\x00\x01", "0": "str zero", 0: "int zero", -1: None, "": math.inf, "nan": mine["odd"]["nan"]}
    assert math.isnan(mine["odd"]["nan"])
    assert mine["empty"] == {"d": {}, "l": []}
    assert same(mine, theirs), (mine, theirs)
    assert mine["flat"] == Raw("int16", (3, 4), torch.arange(12, dtype=torch.int16).numpy().tobytes())
    indexes = [json.loads(p.read_text()) for p in (tmp_path / "ckpt").glob("*.index.json")]
    assert any(len(crcs) > 1 for ix in indexes for _, _, crcs in ix["chunks"].values())


def test_exact_bytes_of_a_small_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.tensor([1.0, -2.0], dtype=torch.float32), "v": 0.1, "s": "x", "n": None}, p)
    m = json.loads((p / "manifest.json").read_text())
    (fname,) = m["files"]
    assert fname == f"r00000-{m['save_id']}.safetensors" and len(m["save_id"]) == 12
    raw = (p / fname).read_bytes()
    header = b'{"__metadata__":{"format":"shardpoint"},"w@0":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    header += b" " * (-(8 + len(header)) % 64)  # the data starts 64-byte aligned (docs/format.md, section 4)
    assert len(header) == 120
    data = struct.pack("<2f", 1.0, -2.0)
    assert raw == struct.pack("<Q", len(header)) + header + data
    iname = f"r00000-{m['save_id']}.index.json"
    index = (p / iname).read_bytes()
    assert index == json.dumps({"format": "shardpoint-index", "file": fname, "chunks": {
        "w@0": [8 + len(header), 8, [zlib.crc32(data)]]}}, separators=(",", ":")).encode()
    assert m["files"] == {fname: {"size": len(raw), "rank": 0, "index": {
        "name": iname, "size": len(index), "crc32": zlib.crc32(index)}}}
    assert list(m) == ["seal", "format", "version", "library_version", "created", "world_size", "save_id",
                       "checksum", "files", "containers", "layouts", "entries", "health"]
    assert m["health"] == {"nonfinite": [], "metrics": {}}
    assert (m["format"], m["version"], m["world_size"]) == ("shardpoint", 3, 1)
    text = (p / "manifest.json").read_bytes()
    body = b'{"format":"shardpoint","version":3,' + text.split(b'"version":3,', 1)[1]
    assert text == b'{"seal":"crc32:' + f"{zlib.crc32(body):08x}".encode() + b'",' + body[1:]
    assert m["library_version"] == shardpoint.__version__
    assert m["checksum"] == {"algorithm": "crc32", "block_size": 1 << 20}
    assert m["containers"] == {"": "dict"}
    assert m["entries"] == {
        "v": {"kind": "value", "value": ["float", "0x1.999999999999ap-4"]},
        "s": {"kind": "value", "value": ["str", "x"]},
        "n": {"kind": "value", "value": ["none"]},
        "w": {"kind": "tensor", "dtype": "float32", "layout": 0},
    }
    assert m["layouts"] == [{"shape": [2], "grid": {"cuts": [2], "ranks": [0]}}]


def test_block_checksums_catch_damage_in_any_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardpoint.format.datafile as df
    import shardpoint.saving.coordinator as coord_mod

    monkeypatch.setattr(df, "CRC_BLOCK", 64)
    monkeypatch.setattr(coord_mod, "CRC_BLOCK", 64)
    p = tmp_path / "ckpt"
    w = torch.arange(100, dtype=torch.float32)  # 400 bytes: 7 blocks, the last one short
    shardpoint.save({"w": w}, p)
    m = json.loads((p / "manifest.json").read_text())
    (c,) = doc_chunks(p, m, "w", m["entries"]["w"], False)
    assert m["checksum"]["block_size"] == 64 and len(c["crc32"]) == 7
    good = (p / c["file"]).read_bytes()
    for block in (0, 3, 6):
        raw = bytearray(good)
        raw[c["offset"] + block * 64 + 1] ^= 0x40
        (p / c["file"]).write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match=rf"checksum mismatch in {c['file']}.*'w'"):
            shardpoint.load_full(p)
    (p / c["file"]).write_bytes(good)
    assert torch.equal(shardpoint.load_full(p)["w"], w)


def test_truncated_data_file_is_reported(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.arange(10.0)}, p)
    (f,) = [x for x in p.iterdir() if x.suffix == ".safetensors"]
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        shardpoint.load_full(p)
    f.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        shardpoint.load({"w": torch.zeros(10)}, p)


# --- hostile manifests --------------------------------------------------------------------

def _damaged(tmp_path: Path, edit, v1: bool = True, v3: bool = False) -> Path:  # type: ignore[no-untyped-def]
    p = tmp_path / "ckpt"
    if not p.exists():
        from tests.failure._util import as_v1, as_v2

        shardpoint.save({"w": torch.arange(6.0).reshape(2, 3), "v": 1}, p)
        # the chunk cases damage a version 1 manifest, the layout cases a version 2 one (every later
        # version keeps reading both), the layout table's cases the version 3 one a save writes
        doc = json.loads((p / "manifest.json").read_text()) if v3 else as_v1(p) if v1 else as_v2(p)
        (p / "good.json").write_text(json.dumps(doc))
    m = json.loads((p / "good.json").read_text())
    edit(m)
    (p / "manifest.json").write_bytes(sealed(m))
    return p


def _chunk(m: dict) -> dict:
    return m["entries"]["w"]["chunks"][0]


HOSTILE = {
    "not shardpoint": (lambda m: m.update(format="other"), "missing 'format'"),
    "version not int": (lambda m: m.update(version="1"), "'version' is not an integer"),
    "file outside": (lambda m: (_chunk(m).update(file="../x"), m["files"].update({"../x": {"size": 10}})), "not a plain relative name"),
    "absolute file": (lambda m: m["files"].update({"/etc/passwd": {"size": 1}}), "not a plain relative name"),
    "unlisted file": (lambda m: _chunk(m).update(file="other.safetensors"), "not listed in 'files'"),
    "past the end": (lambda m: _chunk(m).update(offset=10**6), "beyond the end"),
    "unknown dtype": (lambda m: m["entries"]["w"].update(dtype="object"), "unknown dtype"),
    "huge shape": (lambda m: m["entries"]["w"].update(shape=[2**40, 2**40]), "implausibly large"),
    "box outside": (lambda m: _chunk(m).update(offsets=[1, 0]), "outside the shape"),
    "gap": (lambda m: _chunk(m).update(sizes=[1, 3]), "cover 3 elements"),
    "crc count": (lambda m: _chunk(m).update(crc32=[1, 2]), "must list 1 block checksums"),
    "bad value": (lambda m: m["entries"]["v"].update(value=["int", 5]), "not a valid encoded value"),
    "unknown kind": (lambda m: m["entries"]["v"].update(kind="pickle"), "unknown kind"),
    "bad container": (lambda m: m["containers"].update({"x": "set"}), "unknown type"),
    "per-rank rank": (lambda m: m["entries"].update(p={"kind": "per_rank", "ranks": {"5": {"containers": {}, "entries": {}}}}), "not a rank"),
    "not json": (None, "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_is_refused(tmp_path: Path, case: str) -> None:
    edit, msg = HOSTILE[case]
    if edit is None:
        p = _damaged(tmp_path, lambda m: None)
        (p / "manifest.json").write_bytes(b"{not json")
    else:
        p = _damaged(tmp_path, edit)
    with pytest.raises(CorruptCheckpointError, match=msg):
        shardpoint.load_full(p)
    with pytest.raises(CorruptCheckpointError):
        shardpoint.load({"w": torch.zeros(2, 3), "v": 0}, p)


HOSTILE_V2 = {
    "grid cuts": (lambda m: m["entries"]["w"]["grid"].update(cuts=[0, 3]), "grid cuts 0 do not split"),
    "grid ranks": (lambda m: m["entries"]["w"]["grid"].update(ranks=[3]), "grid 'ranks' must list 1 ranks"),
    "two layouts": (lambda m: m["entries"]["w"].update(chunks=[]), "exactly one of 'grid', 'flat', 'chunks'"),
    "flat gap": (lambda m: m["entries"]["w"].pop("grid") and m["entries"]["w"].update(flat=[[0, 2, 0], [3, 6, 0]]),
                 "'flat' ranges must follow each other"),
    "index record": (lambda m: next(iter(m["files"].values()))["index"].update(sha256="x"), "'index' must be"),
    "index digest": (lambda m: next(iter(m["files"].values()))["index"].update(sha256="0" * 64), "SHA-256"),
    # version 2 records a SHA-256, never a CRC-32 (version 3 the other way round)
    "index crc32 in v2": (lambda m: next(iter(m["files"].values()))["index"].update(crc32=0),
                          r"'index' must be \{'name', 'size', 'sha256'\}"),
    "layouts in v2": (lambda m: m.update(layouts=[]) or m["entries"].update(w={"kind": "tensor", "dtype": "float32", "layout": 0}),
                      r"entry 'w': .*missing required field `shape`"),
    # refused by the typed decoder: the message still names the key (or file) and the field
    "shape not ints": (lambda m: m["entries"]["w"].update(shape=[2, "3"]), r"entry 'w': 'shape\[1\]': Expected `int`, got `str`"),
    "grid ranks field": (lambda m: m["entries"]["w"]["grid"].update(ranks={"first": 0, "step": 0, "x": 1}),
                         r"entry 'w': 'grid.ranks': Object contains unknown field `x`"),
    "file size": (lambda m: next(iter(m["files"].values())).update(size=True), r"files\['r00000-.*'\]: 'size': Expected `int`"),
    "value not a list": (lambda m: m["entries"]["v"].update(value="5"), r"entry 'v': 'value': Expected `array`, got `str`"),
    "checksum": (lambda m: m["checksum"].update(algorithm="md5"), r"'checksum.algorithm': Invalid enum value 'md5'"),
}


def _index(m: dict) -> dict:
    return next(iter(m["files"].values()))["index"]


def _row(m: dict) -> dict:
    return m["layouts"][m["entries"]["w"]["layout"]]


HOSTILE_V3 = {
    # the index's digest: a CRC-32, exactly one
    "index digest": (lambda m: _index(m).update(crc32=(_index(m)["crc32"] + 1) % (1 << 32)), "CRC-32"),
    "index sha256 in v3": (lambda m: _index(m).update(sha256="0" * 64), r"'index' must be \{'name', 'size', 'crc32'\}"),
    "index without digest": (lambda m: _index(m).pop("crc32"), "'index' must be"),
    "index crc32 not an int": (lambda m: _index(m).update(crc32="0"), r"'index' must be .*Expected `int"),
    # the layouts table and the rows tensor entries name
    "layout out of range": (lambda m: m["entries"]["w"].update(layout=7), r"entry 'w': 'layout' 7 is not a row of 'layouts' \(1 rows\)"),
    "no layouts": (lambda m: m.pop("layouts"), r"entry 'w': 'layout' 0 is not a row of 'layouts' \(0 rows\)"),
    "layout not an int": (lambda m: m["entries"]["w"].update(layout="0"), r"entry 'w': 'layout': Expected `int`, got `str`"),
    "layout negative": (lambda m: m["entries"]["w"].update(layout=-1), r"entry 'w': 'layout': Expected `int` >= 0"),
    "entry spelled out": (lambda m: m["entries"]["w"].update(shape=[2, 3]), r"entry 'w': .*unknown field `shape`"),
    "entry without layout": (lambda m: m["entries"]["w"].pop("layout"), r"entry 'w': .*missing required field `layout`"),
    "unknown dtype": (lambda m: m["entries"]["w"].update(dtype="object"), "entry 'w': unknown dtype 'object'"),
    "numpy bfloat16": (lambda m: m["entries"]["w"].update(dtype="bfloat16", numpy=True), "numpy has no bfloat16"),
    "row two layouts": (lambda m: _row(m).update(chunks=[]), "entry 'w': layouts\\[0\\] must have exactly one of"),
    "row no layout": (lambda m: _row(m).pop("grid"), "entry 'w': layouts\\[0\\] must have exactly one of"),
    "row grid cuts": (lambda m: _row(m)["grid"].update(cuts=[0, 3]), "entry 'w': grid cuts 0 do not split"),
    "row grid ranks": (lambda m: _row(m)["grid"].update(ranks=[3]), "entry 'w': grid 'ranks' must list 1 ranks"),
    "row huge shape": (lambda m: _row(m).update(shape=[2**40, 2**40]), "entry 'w': .*implausibly large"),
    "row shape not ints": (lambda m: _row(m).update(shape=[2, "3"]), r"'layouts\[0\].shape\[1\]': Expected `int`, got `str`"),
    "row unknown field": (lambda m: _row(m).update(x=1), r"'layouts\[0\]': Object contains unknown field `x`"),
    "layouts not a list": (lambda m: m.update(layouts={}), r"'layouts': Expected `array`, got `object`"),
    "version 2 with rows": (lambda m: m.update(version=2), r"entry 'w': .*missing required field `shape`"),
}


@pytest.mark.parametrize(("version", "case"), [(2, c) for c in sorted(HOSTILE_V2)] + [(3, c) for c in sorted(HOSTILE_V3)])
def test_hostile_compact_manifest_is_refused(tmp_path: Path, version: int, case: str) -> None:
    """A version-2 manifest (layouts in its entries) or a version-3 one (layouts in its
    table) damaged: refused, naming the key or file and the field."""
    edit, msg = (HOSTILE_V2 if version == 2 else HOSTILE_V3)[case]
    p = _damaged(tmp_path, edit, v1=False, v3=version == 3)
    with pytest.raises(CorruptCheckpointError, match=msg):
        shardpoint.load_full(p)
    with pytest.raises(CorruptCheckpointError):
        shardpoint.load({"w": torch.zeros(2, 3), "v": 0}, p)


def test_overlapping_chunks_are_refused(tmp_path: Path) -> None:
    def overlap(m: dict) -> None:
        c = _chunk(m)
        a = dict(c, sizes=[1, 3], length=12, crc32=[0])
        b = dict(c, offsets=[0, 0], sizes=[1, 3], length=12, crc32=[0])  # the same box twice: row 1 is a gap
        m["entries"]["w"]["chunks"] = [a, b]

    p = _damaged(tmp_path, overlap)
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        shardpoint.load_full(p)


# --- the checked-in version-1 checkpoint (tests/data/v1, made by tests/data/make_v1.py) -----

V1 = Path(__file__).resolve().parent / "data" / "v1"


def v1_expected() -> dict:
    """The values tests/data/v1 holds, written out independently of the script."""
    import numpy as np

    return {
        "model": {
            "grid.weight": torch.arange(35, dtype=torch.float32).reshape(7, 5) * 0.25 - 3,
            "rows": (torch.arange(18, dtype=torch.float64).reshape(9, 2) / 3).to(torch.bfloat16),
            "flat": torch.arange(-11, 11, dtype=torch.int16).reshape(2, 11),
            "bias": torch.tensor([0.5, -1.5, 2.5]),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.linspace(-1, 1, 5, dtype=torch.float64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": "all"}],
        },
        "odd": {"a/b": 1, "%": b"\x00\xff", "0": "str zero", 0: "int zero", -1: None, "": -math.inf,
                "nan": math.nan, "big": 2**80 + 1, "neg0": -0.0, "yes": True},
        "dtypes": {
            "c64": torch.complex(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])),
            "f8": torch.tensor([-1.5, 0.25, 2.0]).to(torch.float8_e4m3fnuz),
            "f8fn": torch.tensor([-1.5, 0.25, 2.0]).to(torch.float8_e4m3fn),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "mask": torch.tensor([True, False, True]),
            "u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        },
        "np": np.arange(6, dtype=np.int32).reshape(3, 2),
        "zero": torch.zeros(0, 3),
        "scalar": torch.tensor(-0.125, dtype=torch.float16),
    }


def test_v1_fixture_loads_with_exact_values() -> None:
    full = shardpoint.load_full(V1)
    want = v1_expected()
    rng = full.pop("rng")
    assert full.pop("empty") == {"d": {}, "l": []}
    assert same(as_raw(full), as_raw(want))
    assert isinstance(full["np"], np.ndarray)
    assert sorted(rng) == [0, 1, 2, 3]
    for r in range(4):
        assert rng[r]["seed"] == 100 + r and torch.equal(rng[r]["state"], torch.arange(4, dtype=torch.uint8) + r)
    # and the reader written from docs/format.md reads it the same
    mine = doc_read(V1)
    assert mine["empty"] == {"d": {}, "l": []}
    mine.pop("empty")
    mine.pop("rng")
    assert same(mine, as_raw(want))


def test_v1_fixture_metadata() -> None:
    meta = shardpoint.metadata(V1)
    assert meta.version == 1 and meta.world_size == 4
    assert len(meta.tensors["model/grid.weight"].chunks) == 4  # 2x2 mesh
    assert meta.tensors["model/rows"].dtype == torch.bfloat16 and meta.tensors["model/rows"].shape == (9, 2)
    assert len(meta.tensors["model/bias"].chunks) == 1  # replicated: written once
    assert meta.per_rank == {"rng": [0, 1, 2, 3]}
    assert meta.values["odd/big"] == 2**80 + 1 and meta.values["optim/param_groups/0/betas/1"] == 0.999


def test_v1_fixture_loads_in_place_into_another_layout(tmp_path: Path) -> None:
    """One process, targets in a different layout: full tensors, part of a flat
    partition, and a per-rank value (this process is rank 0)."""
    import shutil

    import numpy as np

    ckpt = tmp_path / "v1"
    shutil.copytree(V1, ckpt)  # never touch the checked-in bytes
    want = v1_expected()
    part = torch.zeros(9, dtype=torch.int16)
    state = {
        "model": {"grid.weight": torch.zeros(7, 5), "rows": torch.zeros(9, 2, dtype=torch.bfloat16),
                  "flat": FlatShard(part, (2, 11), 7), "bias": torch.zeros(3)},
        "np": np.zeros((3, 2), dtype=np.int32),
        "rng": shardpoint.PerRank({"seed": 0, "state": torch.zeros(4, dtype=torch.uint8)}),
    }
    ptr = state["model"]["grid.weight"].data_ptr()
    report = shardpoint.load(state, ckpt, only=["model", "np", "rng"])
    assert state["model"]["grid.weight"].data_ptr() == ptr
    for k in ("grid.weight", "rows", "bias"):
        assert torch.equal(state["model"][k], want["model"][k]), k
    assert torch.equal(part, want["model"]["flat"].reshape(-1)[7:16])
    assert np.array_equal(state["np"], want["np"])
    assert state["rng"].value["seed"] == 100 and report.per_rank == {"rng": "restored"}
    assert report.loaded == ["model/bias", "model/flat", "model/grid.weight", "model/rows", "np", "rng/seed", "rng/state"]
    assert "optim/state/0/step" in report.skipped and report.created == [] and report.missing == []
    # no stray files
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in V1.iterdir())


# --- version 2 layouts: what the coordinator encodes, a reader expands to the same chunks ---

def _encode_expand(shape: tuple, boxes: list, ranks: list) -> tuple[dict, list]:
    from shardpoint.format import layouts

    nd = len(shape)
    offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
    enc = json.loads(json.dumps(msgspec.to_builtins(layouts.encode(shape, offs, sizes, np.array(ranks, dtype=np.int64)))))
    doc = {"kind": "tensor", "dtype": "float32", "shape": list(shape), **enc}
    entry = msgspec.json.decode(json.dumps(doc), type=TensorEntry)  # as a load reads it back
    assert layouts.check(entry, 64) is None, entry
    return enc, sorted((tuple(o), tuple(s), r) for o, s, r in layouts.expand(entry, shape))


@pytest.mark.parametrize("shape,cuts", [((3, 4), [0, 5, 12]), ((2, 3, 5), [0, 7, 8, 29, 30]), ((6, 10), [0, 20, 40, 60]),
                                        ((5,), [0, 2, 5]), ((4, 1, 3), [0, 1, 11, 12])])
def test_flat_partitions_encode_in_one_entry_per_range_and_expand_back(shape: tuple, cuts: list) -> None:
    from shardpoint.plan.boxes import flat_range_boxes

    boxes, ranks = [], []
    for r, (a, b) in enumerate(zip(cuts, cuts[1:])):
        for box in flat_range_boxes(shape, a, b):
            boxes.append((box.offsets, box.sizes))
            ranks.append(r)
    enc, back = _encode_expand(shape, boxes, ranks)
    assert back == sorted((o, s, r) for (o, s), r in zip(boxes, ranks))
    aligned = all(c % math.prod(shape[1:]) == 0 for c in cuts)
    assert ("grid" if aligned else "flat") in enc, enc  # row-aligned partitions are a grid
    if "flat" in enc:
        assert enc["flat"] == [[a, b, r] for r, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def test_uneven_2d_grid_and_irregular_chunks() -> None:
    # Shard(0) x Shard(1) of a 10 x 7 tensor on a 4 x 3 mesh: pieces of 3 rows (the last 1) and 3 columns (the last 1)
    boxes, ranks = [], []
    for i in range(4):
        for j in range(3):
            boxes.append(((3 * i, 3 * j), (min(3, 10 - 3 * i), min(3, 7 - 3 * j))))
            ranks.append(3 * i + j)
    enc, back = _encode_expand((10, 7), boxes, ranks)
    assert enc == {"grid": {"cuts": [3, 3], "ranks": {"first": 0, "step": 1}}}
    assert back == sorted((o, s, r) for (o, s), r in zip(boxes, ranks))
    # an L-shaped tiling is no grid: kept chunk by chunk
    odd = [((0, 0), (2, 3)), ((2, 0), (2, 1)), ((2, 1), (2, 2))]
    enc, back = _encode_expand((4, 3), odd, [0, 1, 2])
    assert "chunks" in enc and back == sorted((o, s, r) for (o, s), r in zip(odd, [0, 1, 2]))


# --- the checked-in version-2 checkpoint (tests/data/v2, made by tests/data/make_v2.py with the
# code as it stood before the save and load pipelines were rebuilt) -------------------------------

V2 = Path(__file__).resolve().parent / "data" / "v2"


def test_v2_fixture_loads_with_exact_values() -> None:
    full = shardpoint.load_full(V2)
    want = v1_expected()  # make_v2.py saves make_v1.py's state
    rng = full.pop("rng")
    assert full.pop("empty") == {"d": {}, "l": []}
    assert same(as_raw(full), as_raw(want))
    assert isinstance(full["np"], np.ndarray)
    for r in range(4):
        assert rng[r]["seed"] == 100 + r and torch.equal(rng[r]["state"], torch.arange(4, dtype=torch.uint8) + r)
    mine = doc_read(V2)  # and the reader written from docs/format.md reads it the same
    mine.pop("empty")
    mine.pop("rng")
    assert same(mine, as_raw(want))
    meta = shardpoint.metadata(V2)
    assert meta.version == 2 and meta.world_size == 4 and len(meta.tensors["model/grid.weight"].chunks) == 4


def _save_v1_state(rank: int, world: int, path: str) -> None:
    from tests.data.make_v1 import rank_state

    shardpoint.save(rank_state(rank), path)


def _aligned_layout(old: bytes) -> tuple[bytes, dict[str, int]]:
    """A data file written before issue 34 (``old``) laid out as docs/format.md,
    section 4, says a writer lays one out since: the same chunks, those whose length
    is a multiple of 64 first (in the old order), then the others longest first (ties
    in the old order), the header padded with spaces so the data starts at a multiple
    of 64. Returns the file's bytes and each chunk's absolute offset in it."""
    (n,) = struct.unpack("<Q", old[:8])
    header = json.loads(old[8 : 8 + n])
    meta = header.pop("__metadata__")
    chunks = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])  # the old order
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in chunks}
    order = [kv for kv in chunks if size[kv[0]] % 64 == 0]
    order += sorted((kv for kv in chunks if size[kv[0]] % 64), key=lambda kv: -size[kv[0]])
    new: dict[str, Any] = {"__metadata__": meta}
    pos, data = 0, b""
    for k, v in order:
        b, e = v["data_offsets"]
        new[k] = {"dtype": v["dtype"], "shape": v["shape"], "data_offsets": [pos, pos + e - b]}
        data += old[8 + n + b : 8 + n + e]
        pos += e - b
    hb = json.dumps(new, separators=(",", ":")).encode()
    hb += b" " * (-(8 + len(hb)) % 64)
    return struct.pack("<Q", len(hb)) + hb + data, {k: 8 + len(hb) + new[k]["data_offsets"][0] for k, _ in order}


@pytest.mark.distributed
def test_the_same_state_is_written_byte_for_byte_as_before_but_aligned(tmp_path: Path) -> None:
    """4 real ranks save make_v2.py's state with today's code: every data file holds
    exactly the bytes of the fixture's file of the same rank (written before issue
    34), laid out as docs/format.md says a writer lays them out now (data start and
    chunks 64-byte aligned: :func:`_aligned_layout`); every index lists the same
    chunks with the same lengths and checksums, at those offsets; and the manifest
    says the same thing but for the save's id, time and the files' sizes. The
    on-disk format moved only by that layout, which readers need not know."""
    from tests._dist import run_ranks

    out = tmp_path / "now"
    run_ranks(_save_v1_state, 4, str(out), timeout=300)

    def by_rank(folder: Path, suffix: str) -> dict[str, bytes]:
        return {p.name[:6]: p.read_bytes() for p in folder.iterdir() if p.name.endswith(suffix)}

    old, new = by_rank(V2, ".safetensors"), by_rank(out, ".safetensors")
    assert sorted(old) == sorted(new) == ["r00000", "r00001", "r00002", "r00003"]
    old_idx, new_idx = by_rank(V2, ".index.json"), by_rank(out, ".index.json")
    moved = 0
    for r in old:
        want, offsets = _aligned_layout(old[r])
        assert new[r] == want, f"data file of {r} differs"
        a, b = json.loads(old_idx[r])["chunks"], json.loads(new_idx[r])["chunks"]
        assert b == {k: [offsets[k], length, crcs] for k, (_, length, crcs) in a.items()}, r
        moved += sum(a[k][0] != b[k][0] for k in a)
    assert moved == sum(len(json.loads(old_idx[r])["chunks"]) for r in old)  # the header grew: every chunk moved
    a, b = (mf.Manifest.parse((d / "manifest.json").read_bytes()) for d in (V2, out))
    assert (a.version, b.version) == (2, 3) and a.world_size == b.world_size  # version 3: CRC-32 digests
    assert a.tree.containers == b.tree.containers and a.tree.entries == b.tree.entries
    assert sorted(f.size for f in b.files.values()) == sorted(len(new[r]) for r in new)


# --- aligned data files (issue 34): chunks of whole 64-byte lines start at 64-byte offsets ------

_FLAT_CUTS = [0, 112, 224, 330]  # a (10, 33) float32 tensor as ZeRO-style partitions: 448, 448, 424 bytes


def _aligned_state(rank: int, world: int) -> dict[str, Any]:
    """A state whose chunks are of both kinds, in an order that the writer before issue
    34 would have put almost all of them off a 64-byte boundary: ``odd`` first (4104,
    4104, 4100 bytes), then chunks of whole 64-byte lines and odd ones mixed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    lo, hi = _FLAT_CUTS[rank], _FLAT_CUTS[rank + 1]
    return {
        "odd": distribute_tensor(torch.arange(3077, dtype=torch.float32), mesh, [Shard(0)]),
        "bias": torch.tensor([0.5, -1.5, 2.5]),  # replicated: written once
        "w": distribute_tensor(torch.arange(800, dtype=torch.float32).reshape(50, 16), mesh, [Shard(0)]),
        "step": torch.tensor(0.0),
        "emb": (torch.arange(768).reshape(96, 8) / 7).to(torch.bfloat16),
        "flat": FlatShard(torch.arange(330, dtype=torch.float32)[lo:hi].clone(), (10, 33), lo),
        "c": torch.complex(torch.arange(8.0), -torch.arange(8.0)),  # stored as bytes (U8), 64 of them
        "rng": shardpoint.PerRank({"seed": torch.arange(5, dtype=torch.uint8) + rank,
                                   "state": torch.arange(64, dtype=torch.int32) + rank}),
    }


def _save_aligned(rank: int, world: int, root: str) -> None:
    mgr = shardpoint.CheckpointManager(root, incremental=True)
    state = _aligned_state(rank, world)
    mgr.save(state, 0)
    for t in (state["odd"].to_local(), state["w"].to_local(), state["step"], state["rng"].value["state"]):
        t.add_(1)  # in place: the second save refers to the chunks that did not change
    mgr.save(state, 1)


@pytest.mark.distributed
def test_chunks_of_whole_64_byte_lines_start_64_byte_aligned(tmp_path: Path) -> None:
    """3 real ranks save twice (the second save incremental): in every data file the
    data starts at a multiple of 64 and so does every chunk whose length is one; the
    file is a valid safetensors file (``safe_open`` reads each chunk's bytes, data back
    to back from the header's end to the file's); both checkpoints load exactly."""
    from safetensors import safe_open

    from tests._dist import run_ranks

    run_ranks(_save_aligned, 3, str(tmp_path), timeout=180)
    refs = 0
    for step in range(2):
        folder = tmp_path / f"step-{step:08d}"
        files = sorted(folder.glob("*.safetensors"))
        assert len(files) == 3
        for f in files:
            raw = f.read_bytes()
            (n,) = struct.unpack("<Q", raw[:8])
            assert (8 + n) % 64 == 0 and raw[8 : 8 + n].rstrip(b" ").endswith(b"}"), f.name
            index = json.loads(f.with_name(f.name.replace(".safetensors", ".index.json")).read_bytes())["chunks"]
            here = {k: (v[0], v[1]) for k, v in index.items() if len(v) == 3}
            refs += len(index) - len(here)
            spans = sorted(here.values())
            assert [a for a, _ in spans] == list(itertools.accumulate([8 + n] + [b for _, b in spans[:-1]]))
            assert sum(b for _, b in spans) == len(raw) - 8 - n  # no gap, nothing after the last chunk
            with safe_open(str(f), "pt") as st:
                assert sorted(st.keys()) == sorted(here)
                for name, (off, length) in here.items():
                    t = st.get_tensor(name).reshape(-1)
                    assert bytes(t.view(torch.uint8).numpy()) == raw[off : off + length], (f.name, name)
            assert {length % 64 == 0 for _, length in spans} == {True, False}, f.name  # both kinds in every file
            for name, (off, length) in here.items():
                if length % 64 == 0:
                    assert off % 64 == 0, f"{f.name}: chunk {name!r} of {length} bytes starts at byte {off}"
    assert refs >= 10  # the incremental save wrote only what changed
    for step in range(2):
        full = shardpoint.load_full(tmp_path / f"step-{step:08d}")
        assert torch.equal(full["odd"], torch.arange(3077, dtype=torch.float32) + step)
        assert torch.equal(full["w"], torch.arange(800, dtype=torch.float32).reshape(50, 16) + step)
        assert torch.equal(full["flat"], torch.arange(330, dtype=torch.float32).reshape(10, 33))
        assert torch.equal(full["emb"], (torch.arange(768).reshape(96, 8) / 7).to(torch.bfloat16))
        assert torch.equal(full["c"], torch.complex(torch.arange(8.0), -torch.arange(8.0)))
        assert torch.equal(full["bias"], torch.tensor([0.5, -1.5, 2.5])) and float(full["step"]) == step
        for r in range(3):
            assert torch.equal(full["rng"][r]["seed"], torch.arange(5, dtype=torch.uint8) + r)
            assert torch.equal(full["rng"][r]["state"], torch.arange(64, dtype=torch.int32) + r + step)


def test_what_the_writer_learns_of_a_moved_chunk_stays_with_its_key(tmp_path: Path) -> None:
    """The writer puts ``b`` (64 bytes) before ``a`` and ``c`` (12 and 20), then ``c``
    before ``a`` (longest first): the non-finite values it finds while streaming, and
    each chunk's place in the index, still belong to the right keys."""
    b = torch.zeros(16)
    b[3] = math.nan
    state = {"a": torch.ones(3), "b": b, "c": torch.full((5,), math.inf)}
    shardpoint.save(state, tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["health"]["nonfinite"] == ["b", "c"] and m["health"]["nan"] == ["b"]
    (index,) = [json.loads(p.read_text())["chunks"] for p in tmp_path.glob("*.index.json")]
    start = index["b@0"][0]
    assert start % 64 == 0 and index["c@0"][0] == start + 64 and index["a@0"][0] == start + 84
    back = shardpoint.load_full(tmp_path)
    assert all(torch.equal(back[k].nan_to_num(), v.nan_to_num()) for k, v in state.items())


def test_replaced_files_is_the_whole_parse_or_none(tmp_path: Path) -> None:
    """A commit's read of the manifest it replaces gives what the whole parse gives,
    and leaves anything it does not vouch for (unsealed, a name not plain) to it."""
    from shardpoint.format.manifest import Manifest, replaced_files

    shardpoint.save({"w": torch.arange(6.0), "n": 3}, tmp_path / "c")
    data = (tmp_path / "c" / "manifest.json").read_bytes()
    m = Manifest.parse(data)
    assert replaced_files(data) == (m.save_id, m.stored_files())
    assert replaced_files(data.replace(b'"seal"', b'"seaL"', 1)) is None
    name = m.stored_files()[0].encode()
    assert replaced_files(data.replace(name, b"../" + name[3:])) is None  # the seal no longer matches either
    doc = json.loads(data)
    doc["files"] = {"../" + k: v for k, v in doc["files"].items()}
    assert replaced_files(sealed(doc)) is None  # sealed, but a name not plain: left to the whole parse
    doc = json.loads(data)
    doc["version"] = 1
    assert replaced_files(sealed(doc)) is None


def test_manifest_bytes_are_the_json_modules(tmp_path: Path) -> None:
    """A manifest's bytes, made by msgspec, are what ``json.dumps`` (compact, no NaN)
    wrote before: floats as ``repr`` writes them (``1e+16``, ``2.5e-07``), non-ASCII
    and DEL escaped, a non-finite ``created`` refused the same way."""
    import dataclasses

    from shardpoint.format.digest import seal
    from shardpoint.format.manifest import Manifest, _number_out

    def by_json(m: Manifest) -> bytes:
        doc: dict[str, Any] = {
            "format": "shardpoint", "version": m.version, "library_version": m.library_version, "created": m.created,
            "world_size": m.world_size, "save_id": m.save_id, "checksum": {"algorithm": "crc32", "block_size": m.crc_block},
            "files": m.files, "containers": m.tree.containers, "entries": m.tree.entries}
        if m.version >= 3:  # the entries name rows of the layouts table
            del doc["entries"]
            doc["layouts"], doc["entries"] = mf._with_rows(m.tree.entries, mf.RowsMemo())
        if m.refs:
            doc["refs"] = m.refs
        if m.nonfinite is not None:
            health: dict[str, Any] = {"nonfinite": m.nonfinite}
            if m.nonfinite:
                health["nan"] = sorted(m.nan or [])
                health["roles"] = {k: m.roles.get(k, "state") for k in m.nonfinite}
            health["metrics"] = {k: _number_out(v) for k, v in sorted(m.metrics.items())}
            doc["health"] = health
        return seal(json.dumps(doc, default=msgspec.to_builtins, separators=(",", ":"), allow_nan=False).encode(),
                    "sha256" if m.version == 2 else "crc32")

    def outcome(fn: Any) -> Any:
        try:
            return fn()
        except ValueError as e:
            return type(e), str(e)

    shardpoint.save({"w": torch.arange(6.0), "b": torch.tensor([math.inf]), "x": {"n": 3, "s": "a\n\"\\\x01"}},
                    tmp_path / "a")
    shardpoint.save({"é": torch.ones(2), "v": "h\x7fé"}, tmp_path / "b")
    for d in (tmp_path / "a", tmp_path / "b", V2):
        m = Manifest.parse((d / "manifest.json").read_bytes())
        assert m.to_bytes() == by_json(m) == (d / "manifest.json").read_bytes()
        for v in (1e16, 2.5e-07, 0.1, -0.0, 1.7976931348623157e308, 5e-324, 1764161234.123456, 7, math.nan, math.inf):
            for other in (dataclasses.replace(m, created=v), dataclasses.replace(m, metrics={"z": v, "a": 1e-5}),
                          dataclasses.replace(m, metrics={"z": 1e22}, nonfinite=None)):
                assert outcome(other.to_bytes) == outcome(lambda o=other: by_json(o)), v


def test_a_saves_layout_rows_are_kept_for_the_next_save_of_the_same_plan(tmp_path: Path) -> None:
    """Version 3: tensors of one shape and layout share a row of ``layouts``; a save
    that reuses its cached plan reuses the rows of the top-level tensors (made once)
    and adds its per-rank values' rows in its own table: each manifest is the one a
    first save writes, and loads."""
    from shardpoint.runtime import PROCESS
    from shardpoint.saving.coordinator import CachedPlan

    state = {"a": torch.ones(4, 3), "b": torch.full((4, 3), 2.0), "c": torch.arange(5.0), "v": 1,
             "rng": shardpoint.PerRank({"s": torch.arange(7, dtype=torch.uint8)})}
    for i in range(3):
        shardpoint.save(state, tmp_path / f"c{i}")
    docs = [json.loads((tmp_path / f"c{i}" / "manifest.json").read_text()) for i in range(3)]
    rows = docs[0]["layouts"]
    assert len(rows) == 3 and [r["shape"] for r in rows] == [[4, 3], [5], [7]]
    assert docs[0]["entries"]["a"]["layout"] == docs[0]["entries"]["b"]["layout"] == 0
    for d in docs[1:]:
        assert d["layouts"] == rows and d["entries"] == docs[0]["entries"]
    memos = [p.rows for p in PROCESS.plans.values() if isinstance(p, CachedPlan) and p.rows.refs]
    assert memos and sorted(memos[-1].refs) == ["a", "b", "c"] and len(memos[-1].table) == 2  # no per-rank row kept
    for i in range(3):
        got = shardpoint.load_full(tmp_path / f"c{i}")
        assert torch.equal(got["b"], state["b"]) and torch.equal(got["rng"][0]["s"], torch.arange(7, dtype=torch.uint8))


def test_a_manifest_whose_head_and_version_disagree_is_refused(tmp_path: Path) -> None:
    """The parse picks its decoder by the head a writer puts first; a 'version' member
    given twice (the head's 3, then 2) is refused, naming the field, never read as
    either version."""
    from shardpoint.format.digest import check_seal, seal

    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(3)}, p)
    raw = (p / "manifest.json").read_bytes()
    body = b"{" + raw[check_seal(raw, "m"):]
    assert body.startswith(b'{"format":"shardpoint","version":3,')
    (p / "manifest.json").write_bytes(seal(body[:-1] + b',"version":2}', "crc32"))
    with pytest.raises(CorruptCheckpointError, match="'version'"):
        shardpoint.load_full(p)
