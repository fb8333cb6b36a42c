"""Verify a checkpoint without loading it: re-read every chunk of every entry
(per-rank values too), check its block CRC-32s against the manifest, and check the
manifest against itself and against the files that are there.

Damage is reported, never raised: a checkpoint that cannot be trusted is exactly
what this is for. Memory stays bounded by one read piece per I/O thread, whatever
sizes a damaged manifest claims. The ``shardpoint verify PATH`` command calls
:func:`main`.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.datafile import crc32, itemsize_of
from .format.digest import ALGORITHM
from .format.manifest import MANIFEST_NAME, Manifest, read_manifest
from .format.refs import with_refs
from .load.place import IO_THREADS, Reader, _validate_saved, saved_chunks
from .plan import Box
from .storage import Storage, storage_for

__all__ = ["Problem", "VerifyResult", "verify", "main"]

#: Largest single read while checksumming (a block is read in pieces of this size).
_PIECE = 8 << 20
#: safetensors refuses headers above 100 MB; so do we.
_MAX_HEADER = 100 << 20


@dataclass(kw_only=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint."""

    file: str | None
    """The file it concerns, relative to the checkpoint (``manifest.json`` for the manifest)."""
    key: str | None
    """The key whose bytes are affected, or None when the damage is not tied to one key."""
    reason: str
    """What is wrong, in words."""
    rank: int | None = None
    """For a per-rank value: the rank whose saved value is affected."""

    def __str__(self) -> str:
        where = []
        if self.key is not None:
            where.append(f"key {self.key!r}" + (f" (rank {self.rank})" if self.rank is not None else ""))
        if self.file is not None:
            where.append(f"file {self.file}")
        return f"{', '.join(where) or 'checkpoint'}: {self.reason}"


@dataclass(kw_only=True, slots=True)
class VerifyResult:
    """What :func:`verify` found."""

    path: str
    """The checkpoint's location."""
    problems: list[Problem] = field(default_factory=list)
    """Everything found wrong, sorted by file and key; empty when the checkpoint is sound."""
    tensors: int = 0
    """Tensor entries checked (each rank's entries of a per-rank value count separately)."""
    checked_bytes: int = 0
    """Tensor bytes re-read and found to match their checksums."""
    unlisted: list[str] = field(default_factory=list)
    """Files in the checkpoint that the manifest does not name (leftovers; not damage)."""
    seal: str | None = None
    """The manifest's seal: ``"verified"`` (its SHA-256 matched), ``"absent"`` (a
    version-1 manifest has none, so damage to it cannot be detected), or None when
    the manifest could not be read (``problems`` says why)."""

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    @property
    def damaged_files(self) -> list[str]:
        return sorted({p.file for p in self.problems if p.file is not None})

    @property
    def damaged_keys(self) -> list[str]:
        return sorted({p.key for p in self.problems if p.key is not None})

    def summary(self) -> str:
        """The text ``shardpoint verify`` prints."""
        if self.ok:
            lines = [f"OK: {self.tensors} tensors, {self.checked_bytes} bytes verified in {self.path}"]
        else:
            lines = [f"DAMAGED: {self.path}: {len(self.problems)} problem(s)"]
            lines += [f"  {p}" for p in self.problems]
            lines.append(f"damaged files: {', '.join(self.damaged_files) or '-'}")
            lines.append(f"damaged keys: {', '.join(self.damaged_keys) or '-'}")
        if self.seal == "verified":
            lines.append(f"manifest seal: verified ({ALGORITHM})")
        elif self.seal == "absent":
            lines.append("manifest seal: absent (format version 1 has none: damage to the manifest itself cannot be "
                         "detected; load it and save it again for a sealed copy)")
        if self.unlisted:
            lines.append(f"note: {len(self.unlisted)} file(s) not named by the manifest (ignored): {', '.join(self.unlisted[:10])}")
        return "\n".join(lines)


def verify(path: str | Any, *, storage_options: dict[str, Any] | None = None) -> VerifyResult:
    """Re-read every chunk of the checkpoint at ``path`` and check it.

    Checks: the manifest's seal (its SHA-256; ``result.seal``), that it parses and is self-consistent (chunks tile each tensor,
    byte lengths match shapes and dtypes); every listed file is present with the
    size the manifest records and a sound safetensors header whose tensors are
    the manifest's chunks; every block of every chunk matches its CRC-32.

    One process, no process group. Never raises for damage: everything wrong is
    in ``result.problems``.

    Raises:
        CheckpointNotFoundError: there is no manifest at ``path`` (nothing was
            ever committed there).
    """
    storage = storage_for(path, storage_options)
    res = VerifyResult(path=storage.url)
    try:
        manifest = read_manifest(storage)
    except CheckpointNotFoundError:
        raise
    except (CorruptCheckpointError, OSError) as e:
        res.problems.append(Problem(file=MANIFEST_NAME, key=None, reason=str(e)))
        return res
    res.seal = "verified" if manifest.sealed else "absent"
    storage = with_refs(storage, manifest)  # referenced chunks are checked in their sibling checkpoint's file
    resolved = _resolve(storage, manifest, res)
    sizes = _check_files(storage, manifest, res, resolved)
    jobs: list[Callable[[], tuple[int, Problem | None]]] = []
    for key, rank, entry, chunks in resolved:
        res.tensors += 1
        if chunks is not None:
            jobs += _check_tensor(storage, manifest.crc_block, key, rank, entry, chunks, sizes, res)
    if jobs:
        with ThreadPoolExecutor(max_workers=max(1, min(IO_THREADS, len(jobs)))) as ex:
            for nbytes, problem in ex.map(lambda j: j(), jobs):
                res.checked_bytes += nbytes
                if problem is not None:
                    res.problems.append(problem)
    try:
        listed = set(manifest.stored_files()) | {MANIFEST_NAME}
        res.unlisted = [n for n in storage.list() if n not in listed and not n.startswith(f".{MANIFEST_NAME}.tmp-")]
    except OSError:
        pass
    res.problems.sort(key=lambda p: (p.file or "", p.key or "", p.rank if p.rank is not None else -1, p.reason))
    return res


Resolved = list[tuple[str, "int | None", dict[str, Any], "list[dict[str, Any]] | None"]]


def _resolve(storage: Storage, m: Manifest, res: VerifyResult) -> Resolved:
    """Every tensor entry with its chunks (file, offset, length, CRCs): listed in a
    version 1 manifest, from the data files' indexes in version 2. An index that is
    missing or differs from its digest is a problem of every key it serves (their
    chunks are then None)."""
    reader = Reader(storage, m, verify=True)
    out: Resolved = []
    for key, rank, e in _tensor_entries(m):
        try:
            chunks = [reader.locate(key, c, rank is not None) for c in saved_chunks(m, e, tuple(e["shape"]))]
        except CorruptCheckpointError as err:
            index = next((f["index"]["name"] for f in m.files.values() if f.get("index", {}).get("name", "") in str(err)),
                         MANIFEST_NAME)
            res.problems.append(Problem(file=index, key=key, rank=rank, reason=str(err)))
            chunks = None
        out.append((key, rank, e, chunks))
    return out


def _tensor_entries(m: Manifest) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
    for key, e in m.tree.entries.items():
        if e["kind"] == "tensor":
            yield key, None, e
        elif e["kind"] == "per_rank":
            for r, sub in sorted(e["ranks"].items(), key=lambda rs: int(rs[0])):
                for k, se in sub["entries"].items():
                    if se["kind"] == "tensor":
                        yield k, int(r), se


def _check_files(storage: Storage, m: Manifest, res: VerifyResult, resolved: Resolved) -> dict[str, int | None]:
    """Size and safetensors header of every listed file; returns the real size of
    each (None when it cannot be read at all)."""
    sizes: dict[str, int | None] = {}
    spans = _chunk_spans(resolved)
    for name, info in sorted([*m.files.items(), *m.refs.items()]):
        want = info["size"]
        try:
            size: int | None = storage.size(name)
        except FileNotFoundError:
            res.problems.append(Problem(file=name, key=None, reason="the file is missing"))
            sizes[name] = None
            continue
        except (OSError, CorruptCheckpointError) as e:
            res.problems.append(Problem(file=name, key=None, reason=f"cannot be read: {e}"))
            sizes[name] = None
            continue
        sizes[name] = size
        if size != want:
            what = "truncated" if size is not None and size < want else "longer than written"
            res.problems.append(Problem(file=name, key=None, reason=f"{what}: it has {size} bytes, the manifest says {want}"))
        reason = _check_header(storage, name, size or 0, spans.get(name, []))
        if reason:
            res.problems.append(Problem(file=name, key=None, reason=reason))
    return sizes


def _chunk_spans(resolved: Resolved) -> dict[str, list[tuple[int, int, str, int | None]]]:
    out: dict[str, list[tuple[int, int, str, int | None]]] = {}
    for key, rank, _e, chunks in resolved:
        for c in chunks or []:
            out.setdefault(c["file"], []).append((c["offset"], c["offset"] + c["length"], key, rank))
    return out


def _check_header(storage: Storage, name: str, size: int, spans: list[tuple[int, int, str, int | None]]) -> str | None:
    """Whether ``name`` starts with a sound safetensors header that declares each
    of the manifest's chunks in the file; a reason when not."""
    if size < 8:
        return "too short to hold a safetensors header"
    try:
        (n,) = struct.unpack("<Q", bytes(storage.read(name, 0, 8)))
        if n > _MAX_HEADER or 8 + n > size:
            return f"its safetensors header claims {n} bytes, more than the file ({size} bytes) can hold"
        header = json.loads(bytes(storage.read(name, 8, n)))
    except (OSError, CorruptCheckpointError) as e:
        return f"cannot read its safetensors header: {e}"
    except (ValueError, RecursionError):
        return "its safetensors header is not valid JSON"
    if not isinstance(header, dict):
        return "its safetensors header is not a JSON object"
    base = 8 + n
    declared: set[tuple[int, int]] = set()
    for tname, v in header.items():
        if tname == "__metadata__":
            continue
        off = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in off)
                and 0 <= off[0] <= off[1] and base + off[1] <= max(size, base)):
            return f"its safetensors header entry {str(tname)[:80]!r} has invalid data_offsets"
        declared.add((base + off[0], base + off[1]))
    for lo, hi, key, rank in spans:
        if (lo, hi) not in declared:
            who = f" (rank {rank})" if rank is not None else ""
            return f"the manifest places key {key!r}{who} at bytes {lo}..{hi}, which its safetensors header does not declare"
    return None


def _check_tensor(storage: Storage, block: int, key: str, rank: int | None, e: dict[str, Any], chunks: list[dict[str, Any]],
                  sizes: dict[str, int | None], res: VerifyResult) -> list[Callable[[], tuple[int, Problem | None]]]:
    """Structural checks now; one checksum job per readable chunk."""

    def problem(reason: str, file: str | None = None) -> None:
        res.problems.append(Problem(file=file, key=key, rank=rank, reason=reason))

    itemsize = itemsize_of(e["dtype"])

    boxes = [Box(tuple(c["offsets"]), tuple(c["sizes"])) for c in chunks]
    if len(boxes) > 1:
        try:
            _validate_saved(key, boxes, tuple(e["shape"]))
        except CorruptCheckpointError as err:
            problem(f"the manifest's chunks do not tile the tensor: {err}", MANIFEST_NAME)
    jobs = []
    for c, b in zip(chunks, boxes, strict=True):
        f, lo, n = c["file"], c["offset"], c["length"]
        if n != b.numel * itemsize:
            problem(f"a chunk is {n} bytes but its box holds {b.numel} x {itemsize} bytes", f)
            continue
        size = sizes.get(f)
        if size is None:
            problem("its file is missing or unreadable", f)
            continue
        if lo + n > size:
            problem(f"bytes {lo}..{lo + n} lie beyond the end of the file ({size} bytes): truncated", f)
            continue
        jobs.append(_crc_job(storage, block, key, rank, c))
    return jobs


def _crc_job(storage: Storage, block: int, key: str, rank: int | None, c: dict[str, Any]) -> Callable[[], tuple[int, Problem | None]]:
    def run() -> tuple[int, Problem | None]:
        f, base, n = c["file"], c["offset"], c["length"]
        bad: list[int] = []
        try:
            if n == 0:
                bad = [] if c["crc32"][0] == 0 else [0]
            for j, start in enumerate(range(0, n, block)):
                end = min(start + block, n)
                crc = 0
                for p in range(start, end, _PIECE):
                    q = min(p + _PIECE, end)
                    data = storage.read(f, base + p, q - p)
                    if len(data) != q - p:
                        raise CorruptCheckpointError(f"short read at byte {base + p}: the file is truncated")
                    crc = crc32(data, crc)
                if crc != c["crc32"][j]:
                    bad.append(j)
        except (OSError, CorruptCheckpointError) as err:
            return 0, Problem(file=f, key=key, rank=rank, reason=f"cannot be read: {err}")
        if not bad:
            return n, None
        j = bad[0]
        lo, hi = base + j * block, base + min((j + 1) * block, n)
        more = f" and {len(bad) - 1} more block(s)" if len(bad) > 1 else ""
        return 0, Problem(file=f, key=key, rank=rank, reason=f"checksum mismatch in bytes {lo}..{hi}{more}: the data is damaged")

    return run


def main(argv: list[str] | None = None) -> int:
    """``shardpoint verify PATH``: print ``OK: ...`` and return 0, or print the
    damaged keys and files and return 1; 2 when there is no checkpoint at PATH."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: shardpoint verify PATH", file=sys.stderr)
        return 2
    try:
        res = verify(args[0])
    except CheckpointNotFoundError as e:
        print(f"shardpoint verify: {e}", file=sys.stderr)
        return 2
    print(res.summary())
    return 0 if res.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
