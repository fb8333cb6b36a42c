"""The one owner of a load: every step of a collective load runs from
:func:`load_state` (and of a one-process read from :func:`read_whole`), in order:

1. locate (:mod:`.locate`): read the manifest; let the state's owners prepare; walk
   the local state and check its keys against the checkpoint (:mod:`.place`;
   nothing is modified yet); agree, telling with the verdict which checkpoint keys
   this rank holds (those no rank holds may be created).
2. read plan (:func:`.read.plan_jobs`, over :mod:`shardpoint.plan.read`): the byte
   ranges this rank reads for its own tensors, planned before the verdict (planning
   changes nothing; its error is raised once the ranks agreed), then for what it creates.
3. read (:class:`.read.Reader`): in parallel, verified; place (:mod:`.place`): every
   value in place, create what is missing, call ``load_state_dict``, report; agree.
4. the owners' collective follow-up, once every rank succeeded.
"""

from __future__ import annotations

import difflib
import functools
import logging
import time
from collections.abc import Collection
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from .._gc import gc_paused
from ..adapters import LoadHooks
from ..collective import Comm, agree
from ..errors import (
    CheckpointReplacedError,
    CorruptCheckpointError,
    KeyMismatchError,
    UnsupportedTypeError,
    UsageError,
)
from ..format.manifest import Manifest
from ..report import LoadReport, LoadStats, human
from ..storage import Storage
from ..tree import Selection
from .locate import Locator, committed, read_manifest
from .place import Collect, KeyCheck, TreeLoad, build, fill_all, load_per_rank, materialise_tree
from .read import FileRange, Reader, ReadJob, plan_jobs, read_ranges


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """What a caller of :func:`shardpoint.load` chose (see its docstring)."""

    strict: bool = True
    only: list[str] | str | None = None
    exclude: list[str] | str | None = None
    create: bool = True
    verify: bool = True


_LOG = logging.getLogger("shardpoint.load")


@gc_paused()
def load_state(comm: Comm, storage: Storage, state: Any, options: LoadOptions, fetch: Fetch | None = None) -> LoadReport:
    """Load the checkpoint at ``storage`` into ``state`` on every rank of ``comm``.

    ``fetch`` (the memory tier's restore): called on every rank, once every read is
    planned and before any is made, with the byte ranges this rank will read (or the
    error its planning raised); collective, it brings those ranges to where
    ``storage`` reads them, and raises on every rank when any rank failed."""
    t0 = time.perf_counter()
    comm.arrive("load", storage.url)
    select = Selection(options.only, options.exclude)
    report = LoadReport()
    hooks = LoadHooks()
    # 1. every rank: read the manifest, let the owners prepare, check the keys (nothing modified yet);
    # 2. with the verdict, which checkpoint keys this rank holds (the ones no rank holds may be created)
    err: BaseException | None = None
    top: TreeLoad | None = None
    found: KeyCheck | None = None
    manifest: Manifest | None = None
    holds: object = None
    try:
        manifest = read_manifest(storage)
        report.world_size = manifest.world_size
        top = _prepare(state, manifest, select, report, comm.rank, hooks)
        found = _check(top, options.strict, report)
        holds = _holds(top, manifest)
    except Exception as e:  # noqa: BLE001 - fanned out to every rank
        err = e
    # plan the reads of this rank's own tensors (that changes nothing; an error is raised after the
    # verdict), then agree: an exchange on a thread beside the planning got the GIL back only at the
    # interpreter's switch interval (5 ms) after each of its steps, and on a busy machine shared a
    # core with it; it was never faster (benchmarks/README.md, "Agreeing after planning")
    ahead = None
    if err is None and top is not None and found is not None and manifest is not None:
        ahead = _plan_ahead(top, found, manifest, storage)
    # (both agreements of a load carry their payloads in the gather and the scatter: no commit follows them)
    merged = agree(comm, holds, err, functools.partial(_held_anywhere, storage=storage), rendezvous=False)
    assert top is not None and manifest is not None and ahead is not None
    held = _keys_of(merged, manifest)
    t1 = time.perf_counter()
    # 3. every rank: plan the rest of its reads; (a restore from the memory tier) get
    # the byte ranges it will read to its host; read its share, fill in place, let the owners settle
    planned: _Planned | None = None
    err = None
    try:
        planned = _plan_rest(top, manifest, select, report, options, held, comm.rank, ahead)
    except Exception as e:  # noqa: BLE001
        err = e
    if fetch is not None:
        ranges = None if planned is None else read_ranges(planned.jobs, manifest.crc_block, options.verify)
        fetch(ranges, err)  # collective: raises on every rank when a rank failed, this one's error first
    try:
        if err is not None:
            raise err
        assert planned is not None
        report.bytes_read = _read(planned.reads, planned.jobs, options.verify)
        fill_all(top, planned.per_rank)
        hooks.after_load(report, comm.rank)
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, None, err, rendezvous=False)
    t2 = time.perf_counter()
    # 4. only once every rank succeeded: the owners' collective follow-up (DeepSpeed's weight refresh)
    hooks.loaded()
    t3 = time.perf_counter()
    report.stats = LoadStats(path=storage.url, step=None, rank=comm.rank, bytes_read=report.bytes_read, wall_s=t3 - t0,
                             phases={"locate": t1 - t0, "read": t2 - t1, "finish": t3 - t2})
    _log_load(report.stats)
    return report.sort()


def _log_load(stats: LoadStats) -> None:
    """One INFO line per load (rank 0's figures), a DEBUG line per rank; their figures
    are formatted only when a handler would take the line."""
    if stats.rank == 0 and _LOG.isEnabledFor(logging.INFO):
        _LOG.info("loaded %s: %s read by rank 0 in %.3fs (%s/s)", stats.path, human(stats.bytes_read), stats.wall_s,
                  human(stats.throughput))
    if _LOG.isEnabledFor(logging.DEBUG):
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in stats.phases.items())
        _LOG.debug("load of %s, rank %d: %s read; %s", stats.path, stats.rank, human(stats.bytes_read), phases)


@gc_paused()
def read_whole(storage: Storage, keys: list[str] | str | None, verify: bool) -> Any:
    """The nested state of a checkpoint with full CPU tensors, in one process."""
    manifest = read_manifest(storage)
    reads = Collect(manifest, Locator(storage, manifest))
    value = materialise_tree(manifest.tree, "", reads, select=Selection(keys, None))
    _read(reads, plan_jobs(reads.targets, reads.locator), verify)
    return build(value)


def _prepare(state: Any, manifest: Manifest, select: Selection, report: LoadReport, rank: int,
             hooks: LoadHooks) -> TreeLoad:
    """The owners' prepare hooks and the walk of the local state."""
    try:
        w = hooks.prepare(state, manifest.tree.entries, select)
    except TypeError as e:  # the walk names the key that cannot be saved
        raise UnsupportedTypeError(str(e)) from None
    _check_patterns(select, manifest.tree.entries.keys() | w.leaves.keys() | w.per_rank.keys())
    return TreeLoad(w, manifest.tree, select, report, rank=rank)


def _check(top: TreeLoad, strict: bool, report: LoadReport) -> KeyCheck:
    """The key check (keys and shapes; nothing is modified), its findings reported."""
    found = top.check(strict)
    found.record(report)
    return found


def _check_patterns(select: Selection, keys: Collection[str]) -> None:
    """``only=``/``exclude=`` prefixes that name no key of the checkpoint or of the state
    are refused when they look like a typo of one that does (``only="modle"`` would load
    nothing, ``exclude="optimiser"`` exclude nothing, silently), or when no ``only``
    prefix names anything (nothing would be loaded): a :class:`UsageError` naming the
    closest prefixes. A prefix for a part that may be absent (a trainer's
    ``only=[..., "grad_scaler"]`` without a grad scaler) is no error beside others that match."""
    if select.everything:
        return
    prefixes = {k[:i] for k in keys for i in [*(j for j, c in enumerate(k) if c == "/"), len(k)]}
    for arg, given in (("only", select.only), ("exclude", select.exclude)):
        given = [p.rstrip("/") for p in given or ()]
        unmatched = [p for p in given if p != "" and p not in prefixes]
        for p in unmatched:
            close = difflib.get_close_matches(p, sorted(prefixes), n=3, cutoff=0.75)
            if close or (arg == "only" and len(unmatched) == len(given)):
                near = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else \
                    f"; the top-level keys are {sorted({k.split('/', 1)[0] for k in keys})[:12]}"
                raise UsageError(f"{arg}={p!r} matches no key of the checkpoint or of the state{near} (prefixes match "
                                 "whole /-separated segments: 'model' matches 'model/w', never 'model_ema/w')")


def _refuse_strangers(top: TreeLoad, manifest: Manifest, select: Selection, held: AbstractSet[str]) -> None:
    """``strict``: checkpoint keys that no rank holds, inside a part of an owner the state
    holds (its model or optimizer: a model with fewer layers than the checkpoint's), are
    refused before anything is modified, as ``load_state_dict(strict=True)`` refuses
    them. Parts the state does not hold at all (no optimizer given) stay a selective load."""
    parts = []
    for key, obj in top.walk.stateful:
        transient = getattr(obj, "_transient", None)
        for part in (transient() if callable(transient) else ()):
            prefix = f"{key}/{part}" if key else part
            if prefix in top.walk.containers:
                # an optimizer's hyperparameters are set, not placed (a scheduler adds initial_lr): its state counts
                parts.append(prefix + ("/state/" if part == "optimizer" else "/"))
    if not parts:
        return
    strangers = sorted(k for k in manifest.tree.entries if k not in held and select(k) and k.startswith(tuple(parts)))
    if strangers:
        raise KeyMismatchError(
            f"{len(strangers)} key(s) of the checkpoint have no place in the state's model or optimizer: "
            f"{strangers[:20]}; the checkpoint's model is larger than this one (strict=True refuses that, as "
            "load_state_dict does). Load with strict=False to leave them out (they are reported unexpected), or "
            "exclude=[...] them")


def _holds(top: TreeLoad, manifest: Manifest) -> list[str]:
    """What this rank tells the others: the checkpoint it opened (its save id) and
    which of its keys this rank's state holds ("" for all of them, else a bitmap over
    the sorted keys, as hex)."""
    entries, leaves, per_rank = manifest.tree.entries, top.walk.leaves, top.walk.per_rank
    if entries.keys() <= leaves.keys() or all(k in leaves or k in per_rank for k in entries):  # no set made
        return [manifest.save_id, ""]
    names = sorted(entries)
    bits = bytearray((len(names) + 7) // 8)
    for i, k in enumerate(names):
        if k in leaves or k in per_rank:
            bits[i >> 3] |= 1 << (i & 7)
    return [manifest.save_id, bits.hex()]


def _held_anywhere(everyone: list[Any], storage: Storage) -> str:
    """Rank 0, from every rank's :func:`_holds`: the checkpoint keys that some rank's
    local state holds ("" for all of them, else the bitmaps OR-ed, as hex); every rank
    must have opened the same checkpoint. Every rank receives this one answer (its
    size depends on the keys, not on the world)."""
    ids = {sid for sid, _bits in everyone}
    if len(ids) > 1:
        raise CheckpointReplacedError(
            f"the ranks opened different checkpoints at {storage.url} (save ids {sorted(ids)}): a save with "
            "overwrite=True replaced it while this load began; nothing was loaded. Load again"
        )
    if any(bits == "" for _sid, bits in everyone):
        return ""
    held = bytearray(len(everyone[0][1]) // 2)
    for _sid, bits in everyone:
        for i, b in enumerate(bytes.fromhex(bits)):
            held[i] |= b
    return held.hex()


def _keys_of(held: str, manifest: Manifest) -> AbstractSet[str]:
    """The checkpoint keys a merged bitmap of :func:`_held_anywhere` names (all of
    them: the manifest's keys themselves, no set made)."""
    if held == "":
        return manifest.tree.entries.keys()
    names = sorted(manifest.tree.entries)
    bits = bytes.fromhex(held)
    return {k for i, k in enumerate(names) if bits[i >> 3] >> (i & 7) & 1}


@dataclass(slots=True)
class _Ahead:
    """The reads of this rank's own tensors, planned before the ranks agree on the key
    check (or the error planning them raised, raised once they agreed)."""

    reads: Collect
    jobs: list[ReadJob]
    error: BaseException | None = None


def _plan_ahead(top: TreeLoad, found: KeyCheck, manifest: Manifest, storage: Storage) -> _Ahead:
    reads = Collect(manifest, Locator(storage, manifest))
    try:
        top.plan_local(reads, found)
        return _Ahead(reads, plan_jobs(reads.targets, reads.locator))
    except Exception as e:  # noqa: BLE001 - raised after the verdict, then fanned out
        return _Ahead(reads, [], e)


class Fetch(Protocol):
    """Brings the byte ranges each rank will read to its storage before the reads
    (:func:`load_state`'s ``fetch``). Collective."""

    def __call__(self, ranges: tuple[list[FileRange], list[FileRange]] | None, error: BaseException | None) -> None:
        """``ranges``: the bytes this rank's jobs need and the bytes its reader reads
        (rounded to checksum blocks), by file (:func:`.read.read_ranges`); None with
        ``error``, what planning raised on this rank."""


@dataclass(slots=True)
class _Planned:
    """Every read of this rank, planned, and the per-rank values to place."""

    reads: Collect
    jobs: list[ReadJob]
    per_rank: list[TreeLoad]


def _plan_rest(top: TreeLoad, manifest: Manifest, select: Selection, report: LoadReport, options: LoadOptions,
               held: AbstractSet[str], rank: int, ahead: _Ahead) -> _Planned:
    """Add the created keys and per-rank values to this rank's planned reads (then
    read them verified and place every value; Stateful objects get ``load_state_dict``)."""
    if ahead.error is not None:
        raise ahead.error
    if options.strict:
        _refuse_strangers(top, manifest, select, held)
    reads = ahead.reads
    planned = len(reads.targets)
    top.plan_created(reads, held.__contains__, options.create)
    per_rank: list[TreeLoad] = []
    for key, saved in manifest.tree.per_rank.items():
        if select(key) and key in top.walk.per_rank:
            per_rank += load_per_rank(key, top.walk.per_rank[key], saved, rank, select, reads, report,
                                      options.strict, options.create)
    return _Planned(reads, ahead.jobs + plan_jobs(reads.targets[planned:], reads.locator), per_rank)


def _read(reads: Collect, jobs: list[ReadJob], verify: bool) -> int:
    """Run the reads; returns the bytes read. A checksum failure on a checkpoint that
    is no longer the one this load opened (replaced or removed meanwhile) is
    reported as that."""
    storage, manifest = reads.locator.storage, reads.manifest
    reader = Reader(storage, manifest.crc_block, verify)
    try:
        reader.run(jobs)
    except CorruptCheckpointError:
        if not committed(storage, manifest.save_id):
            raise CheckpointReplacedError(
                f"the checkpoint at {storage.url} was replaced or removed while this load read it (a save "
                "with overwrite=True, or retention, deleted the files this load was reading); nothing is "
                "damaged. Load again (the targets may be partly filled)"
            ) from None
        raise
    return reader.bytes_read
