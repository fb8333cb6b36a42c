"""Collective save: describe -> plan -> write -> commit.

Phase 1 (describe, plan): each rank walks its state and sends rank 0 (the
coordinator) the digest of its layout and its plain values, and the layout itself
(keys, dtypes, shapes, boxes) only when it changed since its last save. Rank 0
plans (:mod:`shardpoint._coordinator`) and sends each rank only its own assignment,
none when the rank already holds it from the previous save of the same layout.
Phase 2 (write): each rank streams its chunks into one safetensors file, fsyncs
it, writes the file's CRC index beside it, and sends rank 0 the index's digest and
the checksums of its replica rows.
Phase 3 (commit): rank 0 checks that replicas agree, writes the manifest last
(temporary name, rename, directory fsync) and tells everyone. A failure in any
phase raises on every rank and leaves no manifest.
"""

from __future__ import annotations

import contextvars
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _stage
from ._coordinator import Coordinator, layout_message, layout_of, make_plan, replica_digest, values_of  # noqa: F401 - make_plan: plan_bench
from ._incremental import check_refs
from .collective import Comm, coordinate
from .errors import ShardpointError
from .format.datafile import dtype_name, write_data_file
from .format.index import chunk_name, digest, index_bytes, index_name
from .format.manifest import MANIFEST_NAME, encode_value
from .layout import chunks_of
from .load.locate import committed, read_manifest
from .storage import Storage
from .tree import Walk, walk


@dataclass(slots=True)
class _Local:
    """One rank's description of its state (JSON ``meta``) plus the tensors behind it."""

    meta: dict[str, Any]
    views: list[torch.Tensor] = field(default_factory=list)  # one per chunk row, in meta order
    per_rank_views: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: An incremental session (:mod:`shardpoint._incremental`): chunks it finds unchanged are referenced, not written.
    incremental: Any = None


def _describe_tree(w: Walk, views: list[torch.Tensor], rows: dict[str, list]) -> dict[str, Any]:
    values, tensors = {}, {}
    for key, node in w.leaves.items():
        if node.kind == "value":
            try:
                values[key] = encode_value(node.obj)
            except TypeError:  # pragma: no cover - walk only lets plain values through
                raise ShardpointError(f"key {key!r}: cannot encode {type(node.obj).__name__}") from None
            continue
        lc = chunks_of(key, node.obj)
        if any(v.device.type == "meta" for v in lc.views):
            raise ShardpointError(f"key {key!r} is on the meta device and holds no data; materialise it before saving")
        tensors[key] = {"dtype": dtype_name(lc.dtype), "shape": list(lc.shape), "numpy": lc.numpy}
        for b, v in zip(lc.boxes, lc.views):
            rows["key"].append(key)
            rows["off"].append(list(b.offsets))
            rows["size"].append(list(b.sizes))
            views.append(v)
    return {"containers": w.containers, "values": values, "tensors": tensors}


def describe(state: Any, rank: int) -> _Local:
    """Phase 1 on one rank."""
    try:
        w = walk(state)
    except TypeError as e:
        raise ShardpointError(str(e)) from None
    local = _Local(meta={})
    rows: dict[str, list] = {"key": [], "off": [], "size": []}
    try:
        meta = _describe_tree(w, local.views, rows)
        meta["chunks"] = rows
        per_rank = {}
        for key, sub in w.per_rank.items():
            pviews: list[torch.Tensor] = []
            prows: dict[str, list] = {"key": [], "off": [], "size": []}
            d = _describe_tree(sub, pviews, prows)
            d["chunks"] = prows
            per_rank[key] = d
            local.per_rank_views[key] = pviews
    except ValueError as e:
        raise ShardpointError(str(e)) from None
    meta["per_rank"] = per_rank
    local.meta = meta
    local.incremental = incremental_hook.get()
    return local


def data_file(rank: int, save_id: str) -> str:
    """The data file rank ``rank`` writes in save ``save_id``."""
    return f"r{rank:05d}-{save_id}.safetensors"


def _mask(ranges: list[list[int]], n: int) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    for a, b in ranges:
        m[a:b] = True
    return m


def only_checked(local: _Local, assign: dict[str, Any]) -> list[int]:
    """The replica rows this rank checksums but another rank writes."""
    n = len(local.views)
    return np.nonzero(_mask(assign["check"], n) & ~_mask(assign["write"], n))[0].tolist()


def to_write(local: _Local, assign: dict[str, Any]) -> tuple[list[int], list[str], list[torch.Tensor]]:
    """The rows ``assign`` gives this rank to write and its per-rank values' chunks,
    in file order: (rows, chunk names, views); per-rank chunks have no row."""
    rows = local.meta["chunks"]
    mine = np.nonzero(_mask(assign["write"], len(local.views)))[0].tolist()
    names = [chunk_name(rows["key"][i], rows["off"][i]) for i in mine]
    views = [local.views[i] for i in mine]
    for pkey, pviews in local.per_rank_views.items():
        prow = local.meta["per_rank"][pkey]["chunks"]
        for i, v in enumerate(pviews):
            if v.numel():
                names.append(chunk_name(prow["key"][i], prow["off"][i], per_rank=True))
                views.append(v)
    return mine, names, views


def write_rank(storage: Storage, fname: str, local: _Local, assign: dict[str, Any],
               checked: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """Phase 2 on one rank: write the chunk rows ``assign`` gives this rank and all of
    its per-rank values' chunks to ``fname`` with their index object beside it;
    return the file's size, the index's record, and the checksums of the replica rows
    ``assign`` asks to check (``checked``: those another rank writes, already taken).

    Only what this rank writes is staged (:mod:`shardpoint._stage`): CPU tensors are
    written from their own memory, device tensors through a fixed pool of host slots
    (copy of the next piece overlapping the write of this one). Replica rows another
    rank writes are checksummed in place, or streamed through the same pool.
    With an incremental session, a chunk it finds unchanged is not written: the index
    refers to where an earlier save wrote it."""
    n = len(local.views)
    check = _mask(assign["check"], n)
    pool = _stage.pool()
    if checked is None:
        others = only_checked(local, assign)
        checked = dict(zip(others, _stage.block_crcs_of([local.views[i] for i in others], pool)))
    replica_crcs: list[list[Any]] = [[i, replica_digest(c)] for i, c in checked.items()]
    mine, names, views = to_write(local, assign)
    rows_of: list[int | None] = [*mine, *[None] * (len(names) - len(mine))]  # per-rank chunks have no row
    inc = local.incremental
    refs: list[tuple[str, Any, str]] = []
    if inc is not None:
        kept: list[tuple[int | None, str, torch.Tensor]] = []
        for row, name, v in zip(rows_of, names, views):
            loc = inc.decide(name, v, _host(v))
            if loc is None:
                kept.append((row, name, v))
                continue
            refs.append((name, loc, loc.ref))
            if row is not None and check[row]:
                replica_crcs.append([row, replica_digest(loc.crc32)])
        rows_of, names, views = [k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept]
    if not names and not refs:
        return {"file": None, "replicas": _replicas(replica_crcs)}
    srcs = _stage.sources(views, pool)
    written = write_data_file(storage, fname, list(zip(names, srcs)))
    replica_crcs += [[i, replica_digest(w.crc32)] for i, w in zip(rows_of, written) if i is not None and check[i]]
    chunks = list(zip(names, written))
    idx = index_bytes(fname, chunks, refs)
    iname = index_name(fname)
    storage.write_file(iname, [idx])
    size = storage.size(fname)
    status = {"file": fname, "size": size, "replicas": _replicas(replica_crcs),
              "index": {"name": iname, "size": len(idx), "sha256": digest(idx)}}
    if inc is not None:
        inc.wrote(fname, size, chunks)
        if inc.refs:
            status["refs"] = inc.refs
    return status


def _host(v: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU view of a chunk, for the incremental comparison (a copy only for
    device or strided tensors)."""
    v = v.detach()
    return v if v.device.type == "cpu" and v.is_contiguous() else v.to("cpu").contiguous()


def _replicas(pairs: list[list[Any]]) -> list[list[int]]:
    return [[i for i, _ in pairs], [d for _, d in pairs]]


#: Per process group (the Comm's tag): the layout digest this rank last saved, the id
#: of the plan that answered it and this rank's assignment in that plan.
_assignments: dict[str, tuple[str, str, dict[str, Any]]] = {}


def _plan_phase(comm: Comm, storage: Storage, local: _Local | None, error: BaseException | None,
                overwrite: bool, coord: Coordinator | None, existed: list[bool]) -> tuple[str, dict[str, Any]]:
    """Phase 1: send rank 0 this rank's layout digest and values (the layout itself
    only when it changed since this rank's last save), get back this rank's assignment
    (none when the cached plan still holds it) and the save id."""
    layout = layout_of(local.meta) if local is not None else None
    digest_, whole = layout_message(layout, None) if layout is not None else ("", None)
    # rank 0's structure digest: a rank whose structure is the same (the usual case) leaves its own out
    reference = comm.broadcast_json(whole["sd"] if whole is not None and comm.rank == 0 else None)
    msg = None
    if whole is not None:
        lay = dict(whole, s=None) if comm.rank != 0 and whole["sd"] == reference else whole
        held = _assignments.get(comm.tag)
        same = held is not None and held[0] == digest_
        msg = {"digest": digest_, "plan": held[1] if same else None, "layout": None if same else lay,
               "values": values_of(local.meta)}  # type: ignore[union-attr]

    def decide(msgs: list[Any]) -> list[Any]:
        assert coord is not None
        if storage.exists(MANIFEST_NAME):
            if not overwrite:
                raise ShardpointError(
                    f"a checkpoint already exists at {storage.url}; pass overwrite=True to replace it, or save to a new path"
                )
            existed[0] = True
        return coord.plan_round(msgs)

    reply = coordinate(comm, msg, error, decide)
    if "resend" in reply:  # rank 0 does not know some layouts (its cache was dropped): those ranks send them
        reply = coordinate(comm, {"layout": whole if reply["resend"] else None}, None,
                           lambda msgs: coord.plan_round(msgs))  # type: ignore[union-attr]
    assign = reply["assign"]
    if assign is None:
        held = _assignments.get(comm.tag)
        if held is None or held[1] != reply["plan_id"]:  # pragma: no cover - the coordinator only omits what it sent
            raise ShardpointError(f"rank {comm.rank}: the coordinator reused a plan this rank does not hold; save again")
        assign = held[2]
    _assignments[comm.tag] = (digest_, reply["plan_id"], assign)
    return reply["save_id"], assign


@dataclass(slots=True)
class Planned:
    """What phase 1 left for phases 2 and 3 on this rank."""

    coord: Coordinator | None
    existed: list[bool]
    save_id: str
    assign: dict[str, Any]


def plan_save(comm: Comm, storage: Storage, local: _Local | None, error: BaseException | None,
              overwrite: bool) -> Planned:
    """Phase 1 (collective): this rank's assignment. Raises on every rank when any
    rank failed to describe its state or the plan is refused."""
    coord = Coordinator(comm.tag, comm.world) if comm.rank == 0 else None
    existed = [False]
    save_id, assign = _plan_phase(comm, storage, local, error, overwrite, coord, existed)
    return Planned(coord, existed, save_id, assign)


def save_collective(comm: Comm, storage: Storage, local: _Local | None, error: BaseException | None, overwrite: bool,
                    after_commit: Any = None) -> None:
    """Phases 1-3 given this rank's described state (or the error describing it).

    Every message goes to rank 0 or comes from it: a rank other than 0 sends its
    description and its write status and receives only its own assignment and the
    outcome, whatever the world size. ``after_commit`` runs on rank 0 right after
    the manifest is written (before any rank returns); if it returns a callable, that
    runs on rank 0 after every rank has returned from the commit (retention)."""
    finish_save(comm, storage, plan_save(comm, storage, local, error, overwrite), local, None, after_commit)


def finish_save(comm: Comm, storage: Storage, planned: Planned, local: _Local | None, error: BaseException | None,
                after_commit: Any = None, stage: Any = None) -> None:
    """Phases 2 and 3 (collective) after :func:`plan_save`. ``stage``, if given, runs
    first (the overlapped copy): it returns the checksums of the replica rows another
    rank writes; its error, like ``error`` or any write error, fails the save on
    every rank before anything is committed."""
    coord, existed, save_id, assign = planned.coord, planned.existed, planned.save_id, planned.assign
    status, err = None, error
    checked = None
    if err is None and stage is not None:
        try:
            checked = stage()
        except Exception as e:  # noqa: BLE001 - fanned out to every rank below
            err = e
    _fire("planned")
    fname = data_file(comm.rank, save_id)
    if err is None:
        try:
            status = write_rank(storage, fname, local, assign, checked)  # type: ignore[arg-type]
            _fire("written")
        except Exception as e:  # noqa: BLE001 - fanned out to every rank below
            err = e
    later: list[Any] = []

    def commit(statuses: list[Any]) -> list[None]:
        assert coord is not None
        old: list[str] = []
        if existed[0]:
            try:
                old = read_manifest(storage).stored_files()
            except ShardpointError:
                old = []
        manifest = coord.manifest(statuses)
        for st in statuses:
            for ref, info in (st.get("refs") or {}).items():
                r = manifest.refs.setdefault(ref, {"size": info["size"], "bytes": 0})
                r["bytes"] += info["bytes"]
        check_refs(storage, manifest.refs)
        _fire("before_commit")
        storage.write_atomic(MANIFEST_NAME, manifest.to_bytes())
        _fire("committed")
        keep = set(manifest.stored_files())
        for f in old:
            if f not in keep:
                try:
                    storage.remove(f)
                except Exception:  # noqa: BLE001 - the new checkpoint is committed; a leftover is harmless
                    pass
        if after_commit is not None:
            later.append(after_commit())
        return [None] * comm.world

    try:
        coordinate(comm, status, err, commit)
    except BaseException:
        # a failure after the manifest was written (in a hook) leaves a committed
        # checkpoint: its data must stay
        if not committed(storage, save_id):
            storage.remove(fname)
            storage.remove(index_name(fname))
        raise
    for fn in later:
        if callable(fn):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; retention may try again next save
                warnings.warn(f"shardpoint: cleaning up old checkpoints after the save failed: {e}", stacklevel=2)


#: Called with the name of each phase boundary of a save ("planned", "written",
#: "before_commit", "committed"); the failure tests set it to kill a rank there.
phase_hook: Any = None

#: Set by CheckpointManager around a save: rank 0 runs it after the manifest is
#: written and before the other ranks return (it points ``latest``); what it returns,
#: if callable, runs on rank 0 after every rank has returned from the commit
#: (retention, out of the commit window).
after_commit_hook: contextvars.ContextVar[Any] = contextvars.ContextVar("after_commit_hook", default=None)


#: Set by CheckpointManager(incremental=True) around a save: this rank's
#: :class:`~shardpoint._incremental.Session`, taken by :func:`describe`.
incremental_hook: contextvars.ContextVar[Any] = contextvars.ContextVar("incremental_hook", default=None)


def _fire(phase: str) -> None:
    if phase_hook is not None:
        phase_hook(phase)
