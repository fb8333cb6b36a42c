"""save / load / load_full / metadata."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import torch

from .collective import Comm
from .errors import UsageError
from .format.manifest import PlainValue
from .format.model import TensorEntry, ValueEntry
from .load.locate import read_manifest
from .load.pipeline import LoadOptions, load_state, read_whole
from .report import LoadReport, SaveStats
from .saving.handle import SaveHandle
from .saving.pipeline import SaveOptions, save_state
from .storage import Storage, storage_for
from .tree import matches_prefix

if TYPE_CHECKING:  # types only
    from torch.distributed import ProcessGroup

PathLike = str | os.PathLike[str] | Storage
DEFAULT_TIMEOUT = timedelta(minutes=10)


def save(
    state: object,
    path: PathLike,
    *,
    process_group: ProcessGroup | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    overwrite: bool = False,
    blocking: bool = True,
    overlap: bool = False,
    storage_options: dict[str, Any] | None = None,
    tag: str | None = None,
    on_stats: Callable[[SaveStats], None] | None = None,
) -> SaveHandle | None:
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
        on_stats: called on every rank once the save committed, with what it cost
            there (:class:`~shardpoint.report.SaveStats`: bytes, seconds per stage,
            the caller's stall); also on ``handle.stats`` with ``blocking=False``.
    """
    if overlap and blocking:
        raise UsageError("overlap=True needs blocking=False: a blocking save has already copied and written the state")
    return save_state(Comm(process_group, timeout, arrival_tag=tag), storage_for(path, storage_options), state,
                      SaveOptions(overwrite=overwrite, on_stats=on_stats), blocking=blocking, overlap=overlap)


def load(
    state: object,
    path: PathLike,
    *,
    strict: bool = True,
    only: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    create: bool = True,
    process_group: ProcessGroup | None = None,
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
            checkpoint lacks (``report.missing``), or the checkpoint has keys with no
            place in a model or optimizer the state holds (a larger model), as
            ``load_state_dict(strict=True)`` does; parts the state does not hold at all
            (no optimizer given) are left out either way.
        only / exclude: key prefixes, matched on whole ``/`` segments, to load or to
            leave out (``only=["model"]`` never matches ``model_ema``); a prefix that
            matches no key is refused (:class:`UsageError`, naming the closest).

    Returns:
        A :class:`LoadReport` saying what this rank loaded, created, skipped, and
        what is missing or unexpected.
    """
    if state is None:
        raise UsageError("load(state, path) fills state in place: give the object to fill (a TrainState, a module's "
                         "state_dict(), a nested dict); shardpoint.load_full(path) returns a new one instead")
    options = LoadOptions(strict=strict, only=only, exclude=exclude, create=create, verify=verify)
    return load_state(Comm(process_group, timeout), storage_for(path, storage_options), state, options)


def load_full(path: PathLike, keys: list[str] | str | None = None, *, verify: bool = True, storage_options: dict[str, Any] | None = None) -> Any:
    """Read a checkpoint in one process, no process group needed: the nested state
    with full CPU tensors (numpy arrays where numpy arrays were saved). A per-rank
    value comes back as ``{rank: value}``. ``keys`` limits it to key prefixes."""
    return read_whole(storage_for(path, storage_options), keys, verify)


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
    nonfinite: list[str] | None = None  # keys whose tensors held NaN or infinity when saved (None: not recorded)
    metrics: dict[str, float] = field(default_factory=dict)  # the saving job's numbers for this step


def metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> Metadata:
    """Keys, shapes, dtypes, how each tensor was sharded, the world size and time at
    save: everything but the tensor data, read from the manifest alone."""
    storage = storage_for(path, storage_options)
    m = read_manifest(storage)
    tensors: dict[str, TensorInfo] = {}
    values: dict[str, PlainValue] = {}
    per_rank: dict[str, list[int]] = {}
    for k, e in sorted(m.tree.entries.items()):
        if isinstance(e, TensorEntry):
            spec = m.tree.tensors[k]
            tensors[k] = TensorInfo(spec.shape, spec.dtype, tuple((c.box.offsets, c.box.sizes) for c in spec.chunks()),
                                    spec.nbytes)
        elif isinstance(e, ValueEntry):
            values[k] = m.tree.values[k]
        else:
            per_rank[k] = sorted(m.tree.per_rank[k])
    return Metadata(
        world_size=m.world_size, created=datetime.fromtimestamp(m.created, tz=timezone.utc), version=m.version,
        tensors=tensors, values=values, per_rank=per_rank, nbytes=m.own_bytes(), referenced=m.referenced_bytes(),
        nonfinite=m.nonfinite, metrics=dict(m.metrics),
    )


def save_offline(rank_states: Iterable[tuple[int, object]], path: PathLike, *, world_size: int, overwrite: bool = False,
                 storage_options: dict[str, Any] | None = None) -> None:
    """Write a checkpoint as if ``world_size`` ranks had saved it, from one process,
    holding one rank's state at a time (converters). Replicated chunks are written
    by the first rank that has them and checked against the others."""
    from .saving.offline import save_ranks

    save_ranks(rank_states, storage_for(path, storage_options), world_size=world_size, overwrite=overwrite)


__all__ = ["save", "load", "load_full", "metadata", "save_offline", "Metadata", "TensorInfo", "matches_prefix"]
