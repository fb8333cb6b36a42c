"""save / load / load_full / metadata."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import torch

from ._gc import gc_paused
from ._load import (
    Reader,
    TreeLoad,
    _Selector,
    load_per_rank,
    materialise_tree,
    read_manifest,
    saved_chunks,
)
from ._save import _committed, _Local, after_commit_hook, describe, save_collective
from .adapters import LoadHooks
from .collective import Comm, agree
from .errors import CorruptCheckpointError, ShardpointError
from .format.datafile import dtype_from_name, itemsize_of
from .format.manifest import decode_value
from .report import LoadReport
from .storage import Storage, storage_for
from .tree import matches_prefix

PathLike = str | os.PathLike[str] | Storage
DEFAULT_TIMEOUT = timedelta(minutes=10)


@gc_paused()
def save(
    state: Any,
    path: PathLike,
    *,
    process_group: Any = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    overwrite: bool = False,
    blocking: bool = True,
    overlap: bool = False,
    storage_options: dict[str, Any] | None = None,
    tag: str | None = None,
) -> Any:
    """Save ``state`` to ``path``. Collective: every rank of ``process_group`` (default:
    the whole job; no group at all without torch.distributed) calls it with its own
    local state.

    ``state`` is a nested dict/list/tuple whose leaves are tensors, DTensors
    (Shard/Replicate), :class:`~shardpoint.layout.FlatShard` partitions, numpy
    arrays, plain values, Stateful objects (``state_dict``/``load_state_dict``) and
    :class:`PerRank` values. Anything not wrapped in :class:`PerRank` is replicated
    among the ranks that hold it, and must be identical on all of them.

    The checkpoint exists once its manifest is written, which happens last, after
    every rank's data is durable. A failure on any rank raises on every rank and
    leaves no checkpoint; an existing checkpoint at ``path`` is kept unless
    ``overwrite=True``, which replaces it atomically.

    Args:
        timeout: how long ranks wait for each other to arrive (not how long the save
            may take). Absent ranks are named in a :class:`CollectiveMismatchError`.
        blocking: with False, return a handle as soon as the state is staged (what
            this rank writes copied to host memory); the write and commit continue
            in the background (``handle.wait()``).
        overlap: with ``blocking=False``, return before the copy too: it runs in
            the background while your next forward and backward run. Each
            optimizer in ``state`` waits for it at its next ``step()``; anything
            else that changes a saved tensor in place must wait for
            ``handle.wait_staged()`` first, or the save fails naming the key and
            commits nothing (docs/async.md).
        tag: the same string on every rank (a trainer's global step): the ranks then
            meet by path and tag rather than by call order, so a save that some
            ranks skip never meets another save; it is abandoned naming them.
    """
    comm = Comm(process_group, timeout, arrival_tag=tag)
    storage = storage_for(path, storage_options)
    after_commit = after_commit_hook.get()
    if overlap and blocking:
        raise ValueError("overlap=True needs blocking=False: a blocking save has already copied and written the state")
    if not blocking:
        from .asyncsave import save_async

        return save_async(comm, storage, state, overwrite, after_commit, overlap=overlap)
    from .asyncsave import wait_in_flight

    wait_in_flight()  # one save at a time: an earlier async save commits (or raises) first
    comm.arrive("save", storage.url)
    local: _Local | None = None
    err: BaseException | None = None
    try:
        local = describe(state, comm.rank)
    except Exception as e:  # noqa: BLE001 - fanned out to every rank
        err = e
    save_collective(comm, storage, local, err, overwrite, after_commit)
    return None


@gc_paused()
def load(
    state: Any,
    path: PathLike,
    *,
    strict: bool = True,
    only: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    create: bool = True,
    process_group: Any = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Load the checkpoint at ``path`` into ``state``, in place. Collective.

    Tensors are filled in place (same objects, same storage), resharded from
    whatever layout saved them; Stateful objects get ``load_state_dict`` with their
    filled state dict; plain values are replaced in their containers. A checkpoint
    key that no rank of this job holds (lazily created state) is created, under the
    nearest existing container, unless ``create=False``. Checksums are verified
    unless ``verify=False``.

    Args:
        strict: raise :class:`KeyMismatchError` when the local state has keys the
            checkpoint lacks (``report.missing``).
        only / exclude: key prefixes, matched on whole ``/`` segments, to load or to
            leave out (``only=["model"]`` never matches ``model_ema``).

    Returns:
        A :class:`LoadReport` saying what this rank loaded, created, skipped, and
        what is missing or unexpected.
    """
    comm = Comm(process_group, timeout)
    storage = storage_for(path, storage_options)
    comm.arrive("load", storage.url)
    select = _Selector(only, exclude)
    report = LoadReport()
    hooks = LoadHooks()
    # 1. every rank: read the manifest, let the owners prepare, check the keys (nothing modified yet)
    err: BaseException | None = None
    top: TreeLoad | None = None
    manifest = None
    try:
        manifest = read_manifest(storage)
        report.world_size = manifest.world_size
        top = _prepare(state, manifest, select, report, strict, comm.rank, hooks)
    except Exception as e:  # noqa: BLE001 - fanned out to every rank
        err = e
    agree(comm, None, err)
    assert top is not None and manifest is not None
    # 2. which checkpoint keys some rank of this job holds (the rest may be created)
    held = _held_anywhere(comm, top, manifest)
    # 3. every rank: read its share, fill in place, let the owners settle
    try:
        _read_and_fill(top, manifest, storage, select, report, strict, create, verify, held, comm.rank)
        hooks.after_load(report, comm.rank)
        err = None
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, None, err)
    # 4. only once every rank succeeded: the owners' collective follow-up (DeepSpeed's weight refresh)
    hooks.loaded()
    return report.sort()


def _prepare(state: Any, manifest: Any, select: _Selector, report: LoadReport, strict: bool, rank: int,
             hooks: LoadHooks) -> TreeLoad:
    """The owners' prepare hooks, the walk of the local state and the key check."""
    try:
        w = hooks.prepare(state, manifest.tree.entries, select)
    except TypeError as e:  # the walk names the key that cannot be saved
        raise ShardpointError(str(e)) from None
    top = TreeLoad(w, manifest.tree, select, report, rank=rank)
    top.check(strict)
    return top


def _held_anywhere(comm: Comm, top: TreeLoad, manifest: Any) -> set[str]:
    """The checkpoint keys that some rank's local state holds (collective)."""
    names = sorted(manifest.tree.entries)
    local = set(top.walk.leaves) | set(top.walk.per_rank)
    flags = comm.any_true(torch.tensor([1 if k in local else 0 for k in names], dtype=torch.uint8))
    return {k for k, f in zip(names, flags.tolist()) if f}


def _read_and_fill(top: TreeLoad, manifest: Any, storage: Storage, select: _Selector, report: LoadReport,
                   strict: bool, create: bool, verify: bool, held: set[str], rank: int) -> None:
    """Plan this rank's reads (its tree and its per-rank values), read them verified,
    and place every value; Stateful objects get ``load_state_dict``."""
    reader = Reader(storage, manifest, verify)
    top.plan(reader, held.__contains__, create)
    loads = [top]
    for key, entry in manifest.tree.entries.items():
        if entry["kind"] == "per_rank" and select(key) and key in top.walk.per_rank:
            loads += load_per_rank(key, top.walk.per_rank[key], entry, rank, select, reader, report, strict, create)
    _run_reads(reader, storage, manifest)
    report.bytes_read = reader.bytes_read
    for tl in loads[1:]:  # per-rank values first: a parent's load_state_dict sees them filled
        _fill_per_rank(top.walk, tl)
    top.fill(top.walk.root, "")


def _run_reads(reader: Reader, storage: Storage, manifest: Any) -> None:
    """Run the reads; a checksum failure on a checkpoint that is no longer the one
    this load opened (replaced or removed meanwhile) is reported as that."""
    try:
        reader.run()
    except CorruptCheckpointError:
        if not _committed(storage, manifest.save_id):
            raise ShardpointError(
                f"the checkpoint at {storage.url} was replaced or removed while this load read it (a save "
                "with overwrite=True, or retention, deleted the files this load was reading); nothing is "
                "damaged. Load again (the targets may be partly filled)"
            ) from None
        raise


def _fill_per_rank(w: Any, tl: TreeLoad) -> None:
    root = tl.walk.root
    key = next(k for k, sub in w.per_rank.items() if sub is tl.walk)
    value = tl.fill(root, key)
    # the PerRank object itself is reachable from the parent walk's per_rank node
    _set_per_rank_value(w.root, key, tl.walk, value)


def _set_per_rank_value(node: Any, key: str, sub: Any, value: Any) -> bool:
    if node.kind == "per_rank" and node.inner is sub.root:
        node.obj.value = value
        return True
    for child in node.children.values():
        if _set_per_rank_value(child, key, sub, value):
            return True
    return node.inner is not None and node.kind == "stateful" and _set_per_rank_value(node.inner, key, sub, value)


@gc_paused()
def load_full(path: PathLike, keys: list[str] | str | None = None, *, verify: bool = True, storage_options: dict[str, Any] | None = None) -> Any:
    """Read a checkpoint in one process, no process group needed: the nested state
    with full CPU tensors (numpy arrays where numpy arrays were saved). A per-rank
    value comes back as ``{rank: value}``. ``keys`` limits it to key prefixes."""
    storage = storage_for(path, storage_options)
    manifest = read_manifest(storage)
    reader = Reader(storage, manifest, verify)
    value = materialise_tree(manifest.tree, "", reader, select=_Selector(keys, None))
    reader.run()
    return value


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """How one tensor was saved."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes) of each saved box
    nbytes: int


@dataclass(frozen=True, slots=True)
class Metadata:
    """What :func:`metadata` returns: the checkpoint without its tensor data."""

    world_size: int
    created: datetime
    version: int
    tensors: dict[str, TensorInfo]
    values: dict[str, Any]
    per_rank: dict[str, list[int]]  # key -> ranks that saved a value
    nbytes: int  # bytes of the checkpoint's own data files
    referenced: int = 0  # bytes of chunks stored by reference in earlier checkpoints' files (incremental saves)


def metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> Metadata:
    """Keys, shapes, dtypes, how each tensor was sharded, the world size and time at
    save: everything but the tensor data, read from the manifest alone."""
    storage = storage_for(path, storage_options)
    m = read_manifest(storage)
    tensors, values, per_rank = {}, {}, {}
    for k, e in sorted(m.tree.entries.items()):
        if e["kind"] == "tensor":
            shape = tuple(e["shape"])
            chunks = tuple((tuple(off), tuple(size)) for off, size, _ in saved_chunks(m, e, shape))
            tensors[k] = TensorInfo(
                shape, dtype_from_name(e["dtype"], key=k), chunks,
                sum(math.prod(size) for _, size in chunks) * itemsize_of(e["dtype"]),
            )
        elif e["kind"] == "value":
            values[k] = decode_value(e["value"], where=k)
        else:
            per_rank[k] = sorted(int(r) for r in e["ranks"])
    return Metadata(
        world_size=m.world_size, created=datetime.fromtimestamp(m.created, tz=timezone.utc), version=m.version,
        tensors=tensors, values=values, per_rank=per_rank, nbytes=m.own_bytes(), referenced=m.referenced_bytes(),
    )


def save_offline(rank_states: Iterable[tuple[int, Any]], path: PathLike, *, world_size: int, overwrite: bool = False,
                 storage_options: dict[str, Any] | None = None) -> None:
    """Write a checkpoint as if ``world_size`` ranks had saved it, from one process,
    holding one rank's state at a time (converters). Replicated chunks are written
    by the first rank that has them and checked against the others."""
    from ._offline import save_offline as _impl

    _impl(rank_states, storage_for(path, storage_options), world_size=world_size, overwrite=overwrite)


__all__ = ["save", "load", "load_full", "metadata", "save_offline", "Metadata", "TensorInfo", "matches_prefix"]
