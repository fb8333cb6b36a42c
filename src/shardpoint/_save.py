"""Collective save: describe -> plan -> write -> commit.

Phase 1 (describe): each rank walks its state and sends what it holds (keys,
dtypes, shapes, boxes, plain values) to every rank; every rank then computes the
same plan (who writes which bytes) with the pure planner.
Phase 2 (write): each rank streams its chunks into one safetensors file, fsyncs
it, and reports where each chunk landed with its checksums.
Phase 3 (commit): rank 0 checks that replicas agree, writes the manifest last
(temporary name, rename, directory fsync) and tells everyone. A failure in any
phase raises on every rank and leaves no manifest.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch

from . import __version__
from .collective import Comm, agree
from .errors import ShardpointError
from .format.datafile import CRC_BLOCK, block_crcs, dtype_name, tensor_bytes, write_data_file
from .format.manifest import MANIFEST_NAME, Manifest, Tree, encode_value
from .layout import chunks_of
from .plan import ChunkTable, PlanError, plan_save
from .storage import Storage
from .tree import Walk, walk


@dataclass(slots=True)
class _Local:
    """One rank's description of its state (JSON ``meta``) plus the tensors behind it."""

    meta: dict[str, Any]
    views: list[torch.Tensor] = field(default_factory=list)  # one per chunk row, in meta order
    per_rank_views: dict[str, list[torch.Tensor]] = field(default_factory=dict)


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
    return local


@dataclass(slots=True)
class _Plan:
    keys: list[str]
    info: dict[str, dict[str, Any]]  # tensor key -> dtype/shape/numpy
    values: dict[str, Any]  # value key -> encoded
    containers: dict[str, str]
    row_start: list[int]  # first global row of each rank
    table: ChunkTable
    group: np.ndarray
    writer: np.ndarray
    replicated: np.ndarray


def make_plan(metas: list[dict[str, Any]]) -> _Plan:
    """Phase 1 on every rank, from everyone's metadata: deterministic, so every rank
    reaches the same plan or raises the same error.

    Vectorised: per-rank descriptions that equal the first one are compared in C, and
    the chunk rows of all ranks become arrays in a few passes, so planning for 1,024
    ranks x 2,000 tensors takes a couple of seconds."""
    info: dict[str, dict[str, Any]] = {}
    first_holder: dict[str, int] = {}
    values: dict[str, Any] = {}
    value_holders: dict[str, dict[str, list[int]]] = {}
    containers: dict[str, str] = {}
    seen_tensors: list[dict[str, Any]] = []  # distinct per-rank tensor descriptions already merged
    for r, m in enumerate(metas):
        if m["containers"] != containers:
            for k, t in m["containers"].items():
                if containers.setdefault(k, t) != t:
                    raise ShardpointError(f"key {k!r} is a {containers[k]} on some ranks and a {t} on rank {r}; the state's structure must agree")
        tensors = m["tensors"]
        if not any(tensors == d for d in seen_tensors[-2:]):  # the common case: the same as a rank before
            seen_tensors.append(tensors)
            for k, t in tensors.items():
                prev = info.setdefault(k, t)
                first_holder.setdefault(k, r)
                if prev is not t and (prev["dtype"] != t["dtype"] or prev["shape"] != t["shape"]):
                    raise ShardpointError(
                        f"key {k!r} is a {prev['dtype']} tensor of global shape {prev['shape']} on rank {first_holder[k]} but a "
                        f"{t['dtype']} of shape {t['shape']} on rank {r}; every rank must describe the same global tensor"
                    )
        for k, v in m["values"].items():
            value_holders.setdefault(k, {}).setdefault(repr(v), []).append(r)
            values.setdefault(k, v)
    both = set(info) & set(values)
    if both:
        k = sorted(both)[0]
        raise ShardpointError(f"key {k!r} is a tensor on some ranks and a plain value on others")
    for k, by_value in value_holders.items():
        if len(by_value) > 1:
            groups = sorted(by_value.values())
            raise ShardpointError(
                f"key {k!r} differs between ranks ({'; '.join('ranks ' + str(g) for g in groups)} hold different values) "
                "but is saved as replicated; wrap per-rank values in shardpoint.PerRank(...), or make them agree"
            )
    keys = sorted(info)
    kid = {k: i for i, k in enumerate(keys)}
    nds = np.array([len(info[k]["shape"]) for k in keys], dtype=np.int64)
    ndim = int(max(nds.max(initial=0), 1))
    sizes_of_key = np.array([_itemsize(info[k]["dtype"]) for k in keys], dtype=np.int64)
    counts = [len(m["chunks"]["key"]) for m in metas]
    row_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist() if counts else []
    n = int(sum(counts))
    ids: list[np.ndarray] = []
    prev_keys: list[str] | None = None
    for m in metas:  # ranks usually list the same keys in the same order: look them up once
        ks = m["chunks"]["key"]
        if ks != prev_keys:
            cur = np.fromiter((kid[k] for k in ks), dtype=np.int64, count=len(ks))
            prev_keys = ks
        ids.append(cur)
    key_col = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    lens = nds[key_col]
    total = int(lens.sum())
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    offsets = np.zeros((n, ndim), dtype=np.int64)
    sizes = np.ones((n, ndim), dtype=np.int64)
    for name, out in (("off", offsets), ("size", sizes)):
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(m["chunks"][name] for m in metas)), dtype=np.int64)
        if flat.size != total:
            raise ShardpointError("a rank described chunks whose rank does not match their tensor's shape")
        out[rows, cols] = flat
    shapes = np.ones((len(keys), ndim), dtype=np.int64)
    for i, k in enumerate(keys):
        shp = info[k]["shape"]
        shapes[i, : len(shp)] = shp
    table = ChunkTable(
        key=key_col, rank=np.repeat(np.arange(len(metas), dtype=np.int64), counts), offsets=offsets, sizes=sizes,
        itemsize=sizes_of_key[key_col] if n else np.zeros(0, dtype=np.int64),
    )
    try:
        sp = plan_save(table, shapes, len(metas))
    except PlanError as e:
        detail = "; ".join(f"key {keys[k]!r}: {why}" for k, why in sorted(e.problems.items()))
        raise ShardpointError(f"the ranks' pieces do not form valid tensors: {detail}") from None
    return _Plan(keys, info, values, containers, row_start, table, sp.group, sp.writer, sp.replicated)


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _cpu(v: torch.Tensor) -> torch.Tensor:
    v = v.detach()
    if v.device.type != "cpu":
        v = v.cpu()
    return v.contiguous()


def _tname(key: str, off: list[int]) -> str:
    """The safetensors name of a chunk: unique in its file (the offsets after the
    last '@' name the box; a key never starts with '/')."""
    return f"{key}@{','.join(map(str, off))}"


def write_rank(storage: Storage, fname: str, local: _Local, plan: _Plan | None, rank: int) -> dict[str, Any]:
    """Phase 2 on one rank: write this rank's chunks, return where they landed."""
    rows = local.meta["chunks"]
    to_write: list[tuple[str, torch.Tensor]] = []
    mine: list[int] = []
    replica_crcs: list[list[Any]] = []
    if plan is not None:
        start = plan.row_start[rank]
        for i, v in enumerate(local.views):
            g = start + i
            if plan.writer[g]:
                mine.append(i)
                to_write.append((_tname(rows["key"][i], rows["off"][i]), _cpu(v)))
            elif plan.replicated[g]:
                replica_crcs.append([i, block_crcs(tensor_bytes(_cpu(v)))])
    per_rank_idx: list[tuple[str, int]] = []
    for pkey, views in local.per_rank_views.items():
        prow = local.meta["per_rank"][pkey]["chunks"]
        for i, v in enumerate(views):
            per_rank_idx.append((pkey, i))
            # a leading '/' never starts a key, so this cannot collide with a top-level key "per_rank/..."
            to_write.append((f"/per_rank/{_tname(prow['key'][i], prow['off'][i])}", _cpu(v)))
    if not to_write:
        return {"file": None, "size": 0, "rows": [], "replica_crcs": replica_crcs, "per_rank": {}}
    written = write_data_file(storage, fname, to_write)
    out_rows = [[i, w.offset, w.length, w.crc32] for i, w in zip(mine, written[: len(mine)])]
    per_rank: dict[str, list] = {}
    for (pkey, i), w in zip(per_rank_idx, written[len(mine) :]):
        per_rank.setdefault(pkey, []).append([i, w.offset, w.length, w.crc32])
    for i, w in zip(mine, written[: len(mine)]):
        g = plan.row_start[rank] + i  # type: ignore[union-attr]
        if plan.replicated[g]:  # type: ignore[union-attr]
            replica_crcs.append([i, w.crc32])
    size = storage.size(fname)
    return {"file": fname, "size": size, "rows": out_rows, "replica_crcs": replica_crcs, "per_rank": per_rank}


def check_replicas(plan: _Plan, statuses: list[dict[str, Any]]) -> None:
    """Raise naming key and ranks when replicated bytes differ between ranks."""
    seen: dict[int, dict[str, list[int]]] = {}
    for r, st in enumerate(statuses):
        for i, crcs in st["replica_crcs"]:
            g = int(plan.group[plan.row_start[r] + i])
            seen.setdefault(g, {}).setdefault(repr(crcs), []).append(r)
    for g, by in sorted(seen.items()):
        if len(by) > 1:
            row = int(np.nonzero(plan.group == g)[0][0])
            key = plan.keys[int(plan.table.key[row])]
            groups = "; ".join(f"ranks {v}" for v in sorted(by.values()))
            raise ShardpointError(
                f"key {key!r} is replicated but its bytes differ between ranks ({groups} hold different data). "
                "Replicas that disagree mean the training state has diverged; if the value is meant to differ "
                "per rank, wrap it in shardpoint.PerRank(...)"
            )


def build_manifest(plan: _Plan, metas: list[dict[str, Any]], statuses: list[dict[str, Any]], save_id: str) -> Manifest:
    """Phase 3 on rank 0: the manifest from the plan and where every chunk landed."""
    tree = Tree(containers=dict(sorted(plan.containers.items())))
    for k, v in sorted(plan.values.items()):
        tree.entries[k] = {"kind": "value", "value": v}
    chunks: dict[str, list[dict[str, Any]]] = {k: [] for k in plan.keys}
    files: dict[str, dict[str, int]] = {}
    for r, st in enumerate(statuses):
        if st["file"]:
            files[st["file"]] = {"size": st["size"], "rank": r}
        c = metas[r]["chunks"]
        for i, off, length, crcs in st["rows"]:
            chunks[c["key"][i]].append(
                {"offsets": c["off"][i], "sizes": c["size"][i], "file": st["file"], "offset": off, "length": length, "crc32": crcs}
            )
    for k in plan.keys:
        t = plan.info[k]
        e: dict[str, Any] = {"kind": "tensor", "dtype": t["dtype"], "shape": t["shape"]}
        if t.get("numpy"):
            e["numpy"] = True
        e["chunks"] = sorted(chunks[k], key=lambda c: c["offsets"])
        tree.entries[k] = e
    per_rank_keys = sorted({k for m in metas for k in m["per_rank"]})
    for pkey in per_rank_keys:
        ranks: dict[str, Any] = {}
        for r, m in enumerate(metas):
            d = m["per_rank"].get(pkey)
            if d is None:
                continue
            sub = Tree(containers=d["containers"])
            for k, v in d["values"].items():
                sub.entries[k] = {"kind": "value", "value": v}
            for k, t in d["tensors"].items():
                sub.entries[k] = {"kind": "tensor", "dtype": t["dtype"], "shape": t["shape"], "chunks": []}
                if t.get("numpy"):
                    sub.entries[k]["numpy"] = True
            c = d["chunks"]
            for i, off, length, crcs in statuses[r]["per_rank"].get(pkey, []):
                sub.entries[c["key"][i]]["chunks"].append(
                    {"offsets": c["off"][i], "sizes": c["size"][i], "file": statuses[r]["file"], "offset": off, "length": length, "crc32": crcs}
                )
            ranks[str(r)] = sub.to_json()
        tree.entries[pkey] = {"kind": "per_rank", "ranks": ranks}
    return Manifest(
        world_size=len(metas), created=time.time(), save_id=save_id, tree=tree, files=files,
        crc_block=CRC_BLOCK, library_version=__version__,
    )


def save_collective(comm: Comm, storage: Storage, local: _Local | None, error: BaseException | None, overwrite: bool,
                    after_commit: Any = None) -> None:
    """Phases 1-3 given this rank's described state (or the error describing it)."""
    meta = None
    if local is not None:
        meta = dict(local.meta)
        if comm.rank == 0:
            meta["exists"] = storage.exists(MANIFEST_NAME)
            meta["save_id"] = uuid.uuid4().hex[:12]
    metas = agree(comm, meta, error)
    if metas[0]["exists"] and not overwrite:
        raise ShardpointError(
            f"a checkpoint already exists at {storage.url}; pass overwrite=True to replace it, or save to a new path"
        )
    plan = make_plan(metas)
    _fire("planned")
    save_id = metas[0]["save_id"]
    fname = f"r{comm.rank:05d}-{save_id}.safetensors"
    status, err = None, None
    try:
        status = write_rank(storage, fname, local, plan, comm.rank)  # type: ignore[arg-type]
        _fire("written")
    except Exception as e:  # noqa: BLE001 - fanned out to every rank below
        err = e
    try:
        statuses = agree(comm, status, err)
        check_replicas(plan, statuses)
    except BaseException:
        storage.remove(fname)
        raise
    commit_err = None
    old_files: list[str] = []
    if comm.rank == 0:
        try:
            if metas[0]["exists"]:
                try:
                    old_files = list(Manifest.parse(storage.read(MANIFEST_NAME)).files)
                except ShardpointError:
                    old_files = []
            manifest = build_manifest(plan, metas, statuses, save_id)
            _fire("before_commit")
            storage.write_atomic(MANIFEST_NAME, manifest.to_bytes())
            _fire("committed")
            new_files = set(manifest.files)
            for f in old_files:
                if f not in new_files:
                    try:
                        storage.remove(f)
                    except Exception:  # noqa: BLE001 - the new checkpoint is committed; a leftover is harmless
                        pass
            if after_commit is not None:
                after_commit()
        except Exception as e:  # noqa: BLE001
            commit_err = e
    try:
        agree(comm, None, commit_err)
    except BaseException:
        # a failure after the manifest was written (in a hook) leaves a committed
        # checkpoint: its data must stay
        if not _committed(storage, save_id):
            storage.remove(fname)
        raise


def _committed(storage: Storage, save_id: str) -> bool:
    """Whether the manifest at ``storage`` is the one of save ``save_id``."""
    try:
        return Manifest.parse(bytes(storage.read(MANIFEST_NAME))).save_id == save_id
    except Exception:  # noqa: BLE001 - no (readable) manifest: not committed
        return False


#: Called with the name of each phase boundary of a save ("planned", "written",
#: "before_commit", "committed"); the failure tests set it to kill a rank there.
phase_hook: Any = None

#: Set by CheckpointManager around a save: rank 0 runs it after the manifest is
#: written and before the other ranks return (it points ``latest`` and retains).
after_commit_hook: contextvars.ContextVar[Any] = contextvars.ContextVar("after_commit_hook", default=None)


def _fire(phase: str) -> None:
    if phase_hook is not None:
        phase_hook(phase)
