"""Small helpers to find and damage the bytes of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, doc: Any, *, raw: bytes | None = None) -> None:
    (path / "manifest.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())


def chunks(path: Path, key: str, rank: int | None = None) -> list[dict[str, Any]]:
    """The manifest's chunks of ``key`` (of rank ``rank``'s per-rank value)."""
    entries = manifest(path)["entries"]
    if rank is None:
        return entries[key]["chunks"]
    top = next(k for k in entries if key == k or key.startswith(k + "/"))
    return entries[top]["ranks"][str(rank)]["entries"][key]["chunks"]


def files_with(path: Path) -> dict[str, list[str]]:
    """Data file -> the keys that have a chunk in it."""
    out: dict[str, set[str]] = {}
    for key, e in manifest(path)["entries"].items():
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
