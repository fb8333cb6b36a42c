"""Verify a checkpoint without loading it: re-read every chunk of every entry
(per-rank values too), check its block CRC-32s against the manifest, and check the
manifest against itself and against the files that are there.

Damage is reported, never raised: a checkpoint that cannot be trusted is exactly
what this is for. Memory stays bounded by one read piece per I/O thread, whatever
sizes a damaged manifest claims. ``python -m shardpoint.verify PATH`` runs
:func:`main`; the ``shardpoint verify`` command (shardpoint.cli) calls :func:`verify`
too, and adds folders of checkpoints, JSON and a progress bar.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol

from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.chunks import ChunkLoc, TensorSpec
from .format.datafile import header_length, parse_header
from .format.manifest import MANIFEST_NAME, Manifest
from .format.model import PerRankEntry, TensorEntry
from .health import HealthRule
from .load.locate import Locator, read_manifest
from .load.read import io_threads, read_verified
from .plan.read import tiling_problem
from .storage import Storage, storage_for

__all__ = ["Problem", "VerifyResult", "Meter", "verify", "main"]


class Meter(Protocol):
    """Where :func:`verify` reports its progress (the command line's progress bar)."""

    def start(self, total: int) -> None:
        """The bytes there are to check, once, before the first :meth:`advance`."""

    def advance(self, n: int) -> None:
        """``n`` more bytes checked (called from the reading threads)."""


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
    """The manifest's seal: ``"verified"`` (its digest matched), ``"absent"`` (a
    version-1 manifest has none, so damage to it cannot be detected), or None when
    the manifest could not be read (``problems`` says why)."""
    seal_algorithm: str | None = None
    """The seal's algorithm where ``seal`` is ``"verified"``: ``crc32`` (format version 3) or ``sha256`` (version 2)."""
    nonfinite: list[str] | None = None
    """Health, as recorded at save (docs/format.md, section 3.5): the keys whose tensors
    held a NaN or an infinity; None when not recorded (saved before shardpoint recorded
    health, or the manifest could not be read). Not damage: the bytes are as saved."""
    nan: list[str] | None = None
    """Of ``nonfinite``, the keys that held a NaN (None: not recorded)."""
    unfit: list[str] = field(default_factory=list)
    """Of ``nonfinite``, the keys that make it unfit to resume from under the default
    :class:`~shardpoint.health.HealthRule` (``CheckpointManager.restore`` passes over it)."""

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

    def health(self) -> str:
        """The health record in words ("" when the manifest could not be read)."""
        if self.seal is None:
            return ""
        if self.nonfinite is None:
            return "not recorded (saved before shardpoint recorded health)"
        if not self.nonfinite:
            return "finite (no NaN or infinity in any tensor)"
        found = _findings(self.nonfinite, self.nan)
        if self.unfit:
            return (f"UNFIT to resume from: {found}; CheckpointManager.restore passes over it "
                    "(restore(state, step=N) loads it as it is)")
        return f"fit to resume from: {found} (in buffers or extras: recorded only)"

    def summary(self) -> str:
        """The text ``shardpoint verify`` prints."""
        if self.ok:
            lines = [f"OK: {self.tensors} tensors, {self.checked_bytes} bytes verified in {self.path}"]
        else:
            lines = [f"DAMAGED: {self.path}: {len(self.problems)} problem(s)"]
            lines += [f"  {p}" for p in self.problems]
            lines.append(f"damaged files: {', '.join(self.damaged_files) or '-'}")
            lines.append(f"damaged keys: {', '.join(self.damaged_keys) or '-'}")
        health = self.health()
        if health:
            lines.append(f"health: {health}")
        if self.seal == "verified":
            lines.append(f"manifest seal: verified ({self.seal_algorithm})")
        elif self.seal == "absent":
            lines.append("manifest seal: absent (format version 1 has none: damage to the manifest itself cannot be "
                         "detected; load it and save it again for a sealed copy)")
        if self.unlisted:
            lines.append(f"note: {len(self.unlisted)} file(s) not named by the manifest (ignored): {', '.join(self.unlisted[:10])}")
        return "\n".join(lines)


def _findings(keys: list[str], nan: list[str] | None, shown: int = 5) -> str:
    """``NaN in 'model/w', inf in 'extra/best'`` for the first ``shown`` keys."""
    nans = None if nan is None else set(nan)
    words = [f"{'NaN or inf' if nans is None else 'NaN' if k in nans else 'inf'} in {k!r}" for k in keys[:shown]]
    more = f" and {len(keys) - shown} more key(s)" if len(keys) > shown else ""
    return ", ".join(words) + more


def verify(path: str | os.PathLike[str] | Storage, *, storage_options: dict[str, Any] | None = None,
           progress: Meter | None = None) -> VerifyResult:
    """Re-read every chunk of the checkpoint at ``path`` and check it.

    Checks: the manifest's seal (its CRC-32, or SHA-256 in version 2; ``result.seal``), that it parses and is self-consistent (chunks tile each tensor,
    byte lengths match shapes and dtypes); every listed file is present with the
    size the manifest records and a sound safetensors header whose tensors are
    the manifest's chunks; every block of every chunk matches its CRC-32.

    One process, no process group. Never raises for damage: everything wrong is
    in ``result.problems``. ``result.nonfinite`` and ``result.unfit`` carry the health
    the save recorded (a NaN is not damage). ``progress`` is told the bytes to check and
    each piece checked.

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
    res.seal_algorithm = manifest.seal_algorithm
    res.nonfinite = None if manifest.nonfinite is None else list(manifest.nonfinite)
    res.nan = None if manifest.nan is None else list(manifest.nan)
    res.unfit = list(HealthRule().unfit(manifest.nonfinite, manifest.nan, manifest.roles))
    locator = Locator(storage, manifest)
    storage = locator.storage  # referenced chunks are checked in their sibling checkpoint's file
    resolved = _resolve(locator, manifest, res)
    sizes = _check_files(storage, manifest, res, resolved)
    jobs: list[partial[tuple[int, Problem | None]]] = []
    for t in resolved:
        res.tensors += 1
        if t.locs is not None:
            jobs += _check_tensor(storage, manifest.crc_block, t, sizes, res)
    if jobs:
        if progress is not None:
            progress.start(sum(j.keywords["loc"].length for j in jobs))
        advance = progress.advance if progress is not None else None
        with ThreadPoolExecutor(max_workers=max(1, min(io_threads(storage), len(jobs)))) as ex:
            for nbytes, problem in ex.map(lambda j: j(advance=advance), jobs):
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


class _Tensor(NamedTuple):
    """A tensor entry to check: its spec, the rank of a per-rank value (else None),
    and its chunks' places (None when they cannot be found: an index is damaged)."""

    spec: TensorSpec
    rank: int | None
    locs: list[ChunkLoc] | None


def _resolve(locator: Locator, m: Manifest, res: VerifyResult) -> list[_Tensor]:
    """Every tensor entry with where its chunks lie (listed in the manifest, or in the
    data files' indexes). An index that is missing or differs from its digest is a
    problem of every key it serves (their places are then None)."""
    out: list[_Tensor] = []
    for rank, spec in _tensor_entries(m):
        key = spec.key
        locs: list[ChunkLoc] | None
        try:
            locs = [locator.locate(spec, c, rank is not None, check_length=False) for c in spec.chunks()]
        except CorruptCheckpointError as err:
            index = next((f.index.name for f in m.files.values() if f.index is not None and f.index.name in str(err)),
                         MANIFEST_NAME)
            res.problems.append(Problem(file=index, key=key, rank=rank, reason=str(err)))
            locs = None
        out.append(_Tensor(spec, rank, locs))
    return out


def _tensor_entries(m: Manifest) -> Iterator[tuple[int | None, TensorSpec]]:
    """Every tensor entry, top-level (rank None) and of each rank's per-rank values, in the manifest's order."""
    for key, e in m.tree.entries.items():
        if isinstance(e, TensorEntry):
            yield None, m.tree.tensors[key]
        elif isinstance(e, PerRankEntry):
            for r, sub in sorted(m.tree.per_rank[key].items()):
                for spec in sub.tensors.values():
                    yield r, spec


def _check_files(storage: Storage, m: Manifest, res: VerifyResult, resolved: list[_Tensor]) -> dict[str, int | None]:
    """Size and safetensors header of every listed file; returns the real size of
    each (None when it cannot be read at all)."""
    sizes: dict[str, int | None] = {}
    spans: dict[str, list[tuple[int, int, str, int | None]]] = {}
    for t in resolved:
        for loc in t.locs or []:
            spans.setdefault(loc.file, []).append((loc.offset, loc.offset + loc.length, t.spec.key, t.rank))
    listed = [(n, f.size) for n, f in m.files.items()] + [(n, r["size"]) for n, r in m.refs.items()]
    for name, want in sorted(listed):
        try:
            size = storage.size(name)
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
            what = "truncated" if size < want else "longer than written"
            res.problems.append(Problem(file=name, key=None, reason=f"{what}: it has {size} bytes, the manifest says {want}"))
        reason = _check_header(storage, name, size, spans.get(name, []))
        if reason:
            res.problems.append(Problem(file=name, key=None, reason=reason))
    return sizes


def _check_header(storage: Storage, name: str, size: int, spans: list[tuple[int, int, str, int | None]]) -> str | None:
    """Whether ``name`` starts with a sound safetensors header that declares each
    of the manifest's chunks in the file; a reason when not."""
    try:
        n = header_length(bytes(storage.read(name, 0, 8)) if size >= 8 else b"", size, name)
        header = parse_header(bytes(storage.read(name, 8, n)), size, name)
    except CorruptCheckpointError as e:
        return str(e).removeprefix(f"{name}: ")
    except OSError as e:
        return f"cannot read its safetensors header: {e}"
    declared = {(h.begin, h.end) for h in header.values()}
    for lo, hi, key, rank in spans:
        if (lo, hi) not in declared:
            who = f" (rank {rank})" if rank is not None else ""
            return f"the manifest places key {key!r}{who} at bytes {lo}..{hi}, which its safetensors header does not declare"
    return None


def _check_tensor(storage: Storage, block: int, t: _Tensor, sizes: dict[str, int | None],
                  res: VerifyResult) -> list[partial[tuple[int, Problem | None]]]:
    """Structural checks now; one checksum job per readable chunk."""
    spec, rank = t.spec, t.rank

    def problem(reason: str, file: str | None = None) -> None:
        res.problems.append(Problem(file=file, key=spec.key, rank=rank, reason=reason))

    if spec.listed:
        why = tiling_problem([c.box for c in spec.chunks()], spec.shape)
        if why is not None:
            problem(f"the manifest's chunks do not tile the tensor: key {spec.key!r}: {why} in the manifest; the "
                    "checkpoint is damaged", MANIFEST_NAME)
    jobs: list[partial[tuple[int, Problem | None]]] = []
    for loc, c in zip(t.locs or [], spec.chunks(), strict=True):
        f, lo, n = loc.file, loc.offset, loc.length
        if n != c.box.numel * spec.itemsize:
            problem(f"a chunk is {n} bytes but its box holds {c.box.numel} x {spec.itemsize} bytes", f)
            continue
        size = sizes.get(f)
        if size is None:
            problem("its file is missing or unreadable", f)
            continue
        if lo + n > size:
            problem(f"bytes {lo}..{lo + n} lie beyond the end of the file ({size} bytes): truncated", f)
            continue
        jobs.append(partial(_crc_job, storage, block, spec.key, rank, loc=loc))
    return jobs


def _crc_job(storage: Storage, block: int, key: str, rank: int | None, *, loc: ChunkLoc,
             advance: Callable[[int], None] | None = None) -> tuple[int, Problem | None]:
    bad: list[int] = []
    try:
        for piece in read_verified(storage, loc, block, on_bad=bad.append):
            if advance is not None:
                advance(len(piece))
    except (OSError, CorruptCheckpointError) as err:
        return 0, Problem(file=loc.file, key=key, rank=rank, reason=f"cannot be read: {err}")
    if not bad:
        return loc.length, None
    j = bad[0]
    lo, hi = loc.offset + j * block, loc.offset + min((j + 1) * block, loc.length)
    more = f" and {len(bad) - 1} more block(s)" if len(bad) > 1 else ""
    return 0, Problem(file=loc.file, key=key, rank=rank, reason=f"checksum mismatch in bytes {lo}..{hi}{more}: the data is damaged")


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
