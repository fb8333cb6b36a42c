"""Small helpers to find and damage the bytes of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardpoint.format.digest import is_sealed, seal


def manifest(path: Path) -> dict[str, Any]:
    """The manifest as a dict (its ``seal`` member included: a sealed manifest is JSON)."""
    return json.loads((path / "manifest.json").read_text())


def sealed(doc: Any) -> bytes:
    """A manifest document (a dict, or JSON text/bytes of an object) sealed again
    after an edit, so that it reaches the parser behind the seal: its old ``seal``
    member is dropped and a matching one put first (a SHA-256 seal, which a reader
    accepts on a manifest of version 2 or 3)."""
    if isinstance(doc, dict):
        doc = json.dumps({k: v for k, v in doc.items() if k != "seal"})
    raw = doc.encode() if isinstance(doc, str) else bytes(doc)
    if is_sealed(raw):  # JSON text still carrying the old seal
        raw = b"{" + raw[raw.index(b'",') + 2 :]  # the seal's member ends at the first '",' (after its hex digits)
    return seal(raw)


def write_manifest(path: Path, doc: Any, *, raw: bytes | None = None) -> None:
    """Write ``doc`` as the manifest, sealed (or ``raw`` bytes as they are)."""
    (path / "manifest.json").write_bytes(raw if raw is not None else sealed(doc))


def inline_layouts(doc: dict[str, Any]) -> dict[str, Any]:
    """A version-3 manifest document with its ``layouts`` table written into each
    tensor entry, as version 2 spells entries out (``doc`` changed in place; its
    ``version`` left as it is)."""
    rows = doc.pop("layouts", None)
    if rows is None:
        return doc

    def fix(entries: dict[str, Any]) -> None:
        for key, e in entries.items():
            if e["kind"] == "tensor":
                row = rows[e.pop("layout")]
                entries[key] = {"kind": "tensor", "dtype": e["dtype"], "shape": row["shape"],
                                **({"numpy": True} if e.get("numpy") else {}),
                                **{k: v for k, v in row.items() if k != "shape"}}
            elif e["kind"] == "per_rank":
                for sub in e["ranks"].values():
                    fix(sub["entries"])

    fix(doc["entries"])
    return doc


def as_v2(path: Path) -> dict[str, Any]:
    """The checkpoint's manifest rewritten in format version 2 (each tensor entry
    spelled out, each index's SHA-256 recorded), for the cases that damage a version-2
    manifest: every later version keeps reading version 2."""
    import hashlib

    doc = inline_layouts(manifest(path))
    doc.pop("seal", None)
    doc["version"] = 2
    for f in doc["files"].values():
        idx = f["index"]
        idx.pop("crc32", None)
        idx["sha256"] = hashlib.sha256((path / idx["name"]).read_bytes()).hexdigest()
    return doc


def with_layouts(doc: dict[str, Any], path: Path) -> dict[str, Any]:
    """A version-2 manifest document (perhaps damaged) made version 3: each tensor
    entry's shape and layout moved into a row of ``layouts`` (equal ones shared),
    the entry left with its kind, dtype, ``numpy`` and row, and each index's CRC-32
    recorded (``doc`` changed in place)."""
    import zlib

    rows: list[Any] = []
    seen: dict[str, int] = {}

    def fix(entries: dict[str, Any]) -> None:
        for key, e in entries.items():
            if isinstance(e, dict) and e.get("kind") == "tensor":
                row = {k: v for k, v in e.items() if k not in ("kind", "dtype", "numpy")}
                code = json.dumps(row, sort_keys=True)
                if code not in seen:
                    seen[code] = len(rows)
                    rows.append(row)
                entries[key] = {"kind": "tensor", "dtype": e.get("dtype"),
                                **({"numpy": e["numpy"]} if "numpy" in e else {}), "layout": seen[code]}
            elif isinstance(e, dict) and e.get("kind") == "per_rank" and isinstance(e.get("ranks"), dict):
                for sub in e["ranks"].values():
                    fix(sub["entries"])

    fix(doc["entries"])
    doc["layouts"] = rows
    doc["entries"] = doc.pop("entries")  # after the table, as a writer puts it
    doc["version"] = 3
    for f in doc["files"].values():
        idx = f.get("index")
        if isinstance(idx, dict) and "sha256" in idx:
            idx.pop("sha256")
            idx["crc32"] = zlib.crc32((path / idx["name"]).read_bytes())
    return doc


def as_v1(path: Path) -> dict[str, Any]:
    """The checkpoint's manifest rewritten in format version 1 (every chunk listed
    with its file, byte offset, length and CRCs, read from the version 2 indexes):
    the cases that damage chunk fields apply to it, and it exercises the version 1
    reader, which every later version keeps."""
    from shardpoint.load.locate import Locator, read_manifest
    from shardpoint.storage import storage_for

    doc = inline_layouts(manifest(path))
    if doc["version"] == 1:
        return doc
    st = storage_for(str(path))
    m = read_manifest(st)
    locator = Locator(st, m)

    def fix(entries: dict[str, Any], tree: Any, per_rank: bool) -> None:
        for key, e in entries.items():
            if e["kind"] == "tensor":
                spec = tree.tensors[key]
                located = [(c.box, locator.locate(spec, c, per_rank)) for c in spec.chunks()]
                for form in ("grid", "flat", "chunks"):
                    e.pop(form, None)
                e["chunks"] = [{"offsets": list(b.offsets), "sizes": list(b.sizes), "file": loc.file, "offset": loc.offset,
                                "length": loc.length, "crc32": loc.crc32} for b, loc in located]
            elif e["kind"] == "per_rank":
                for r, sub in e["ranks"].items():
                    fix(sub["entries"], tree.per_rank[key][int(r)], True)

    fix(doc["entries"], m.tree, False)
    doc.pop("seal", None)  # version 1 has no seal
    doc["version"] = 1
    for f in doc["files"].values():
        f.pop("index", None)
    return doc


def chunks(path: Path, key: str, rank: int | None = None) -> list[dict[str, Any]]:
    """The chunks of ``key`` (of rank ``rank``'s per-rank value), each with its file,
    byte offset, length and CRCs."""
    entries = as_v1(path)["entries"]
    if rank is None:
        return entries[key]["chunks"]
    top = next(k for k in entries if key == k or key.startswith(k + "/"))
    return entries[top]["ranks"][str(rank)]["entries"][key]["chunks"]


def files_with(path: Path) -> dict[str, list[str]]:
    """Data file -> the keys that have a chunk in it."""
    out: dict[str, set[str]] = {}
    for key, e in as_v1(path)["entries"].items():
        subs = [e] if e["kind"] == "tensor" else [s for sub in e.get("ranks", {}).values() for s in sub["entries"].values()]
        names = [key] if e["kind"] == "tensor" else [k for sub in e.get("ranks", {}).values() for k in sub["entries"]]
        for name, s in zip(names, subs, strict=True):
            for c in s.get("chunks", []):
                out.setdefault(c["file"], set()).add(name)
    return {f: sorted(k) for f, k in out.items()}


def flip_bit(file: Path, offset: int, bit: int = 3) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))
