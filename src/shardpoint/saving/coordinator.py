"""Rank 0's side of a save: merge what every rank holds into one plan, give each
rank only its own assignment, check replicas, build the manifest.

No I/O and no torch.distributed: the messages are JSON-shaped dicts, so the scale
benchmark drives a :class:`Coordinator` for thousands of simulated ranks in one
process. The plan of the previous save of a process group is cached: a save whose
layout digests all equal the previous ones reuses it, and a rank that already holds
its assignment is sent none.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
import zlib
from dataclasses import dataclass, field
from itertools import chain

import msgspec
import numpy as np

from .._gc import gc_paused
from .._version import __version__
from ..errors import InternalError, RankMismatchError, UsageError
from ..format import layouts
from ..format.datafile import CRC_BLOCK, itemsize_of
from ..format.layouts import Layout
from ..format.manifest import Manifest, RowsMemo, Tree
from ..format.model import DataFile, Grid, IndexFile, PerRankEntry, RankStep, TensorEntry, TreeDoc, ValueEntry
from ..plan import ChunkTable, Placement, PlanError, choose_writers, nonempty_rows
from ..runtime import PROCESS
from .records import Encoded, RankLayout, RankValues, TensorMeta, TreeLayout, Wire, WriteStatus


def layout_digest(layout: object) -> str:
    """A digest that is equal exactly when two layouts (or structures) are: BLAKE2b of
    their JSON as msgspec encodes it (in C, several times faster than ``json.dumps``,
    and BLAKE2b than SHA-256 without SHA instructions; only digests made by the same
    code are compared: every rank's, every save's of one process)."""
    return hashlib.blake2b(msgspec.json.encode(layout), digest_size=32).hexdigest()


def layout_message(layout: RankLayout, reference: str | None) -> tuple[str, Wire]:
    """Split a rank's layout into its structure (containers, tensor dtypes and global
    shapes, the order of its chunk keys, per-rank values: the same on most ranks) and
    its boxes (where its chunks lie: its own). Returns the layout's digest and the
    message that carries it, which leaves the structure out when its digest equals
    ``reference`` (rank 0's, which the coordinator holds)."""
    structure = {"containers": layout["containers"], "tensors": layout["tensors"], "keys": layout["chunks"]["key"],
                 "per_rank": layout["per_rank"]}
    # the boxes as packed little-endian integers (base64): the coordinator decodes a
    # rank's boxes in one call instead of parsing and converting millions of JSON ints
    boxes = {name: _pack(np.fromiter(chain.from_iterable(layout["chunks"][name]), dtype=np.int64))
             for name in ("off", "size")}
    sd = layout_digest(structure)
    digest = layout_digest({"structure": sd, "boxes": boxes})
    return digest, {"s": None if sd == reference else structure, "sd": sd, "b": boxes}


def _pack(a: np.ndarray) -> str:
    """Integers as ``"<width>:<base64 of zlib of little-endian ints>"`` (width 4 when
    they fit; the boxes of regular layouts compress several times over)."""
    width = 4 if a.size == 0 or (a.min() >= -(1 << 31) and a.max() < 1 << 31) else 8
    return f"{width}:" + base64.b64encode(zlib.compress(a.astype(f"<i{width}").tobytes(), 1)).decode()


def _unpack(s: str, what: str) -> np.ndarray:
    """The inverse of :func:`_pack`, in the width the integers travelled in (the chunk
    table widens them as it copies them); a malformed message is a :class:`ShardpointError`."""
    try:
        width, data = s.split(":", 1)
        raw = zlib.decompress(base64.b64decode(data, validate=True))
        return np.frombuffer(raw, dtype=f"<i{int(width)}")
    except (ValueError, TypeError, zlib.error) as e:
        raise RankMismatchError(f"malformed chunk boxes in {what}'s layout message ({e}); "
                              "every rank must run the same shardpoint version") from None


def _full_layout(structure: Wire, boxes: Wire, rank: int) -> RankLayout:
    return {"containers": structure["containers"], "tensors": structure["tensors"], "per_rank": structure["per_rank"],
            "chunks": {"key": structure["keys"], "off_flat": _unpack(boxes["off"], f"rank {rank}"),
                       "size_flat": _unpack(boxes["size"], f"rank {rank}")}}


def _flat_boxes(m: TreeLayout, name: str) -> np.ndarray:
    """A rank's ``off`` or ``size`` values, chunk after chunk: flat as they arrive in a
    message, or flattened from the nested lists of a full description."""
    c = m["chunks"]
    flat = c.get(name + "_flat")
    return flat if flat is not None else np.fromiter(chain.from_iterable(c[name]), dtype=np.int64)


@dataclass(slots=True)
class Plan:
    """Who writes which bytes, for every rank: the chunk table of all ranks' rows
    (rank by rank, in each rank's own order) and, per row, whether it writes and
    whether it is a replica whose checksums are compared."""

    keys: list[str]
    info: dict[str, TensorMeta]  # tensor key -> dtype/shape/numpy
    containers: dict[str, str]
    per_rank: list[dict[str, TreeLayout]]  # per rank: per-rank key -> its layout
    row_start: np.ndarray  # (world + 1,) first global row of each rank
    table: ChunkTable
    shapes: np.ndarray  # (keys, table dims) global shape of each key, padded with 1
    group: np.ndarray
    writer: np.ndarray  # bool: this row's bytes go to this rank's file (never an empty box)
    check: np.ndarray  # bool: this row is a replica (non-empty): its checksums are compared
    placement: Placement  # each non-empty box's writer, as the manifest lists them


def merge_structure(layouts_: list[RankLayout]) -> tuple[dict[str, TensorMeta], dict[str, str]]:
    """Every tensor's dtype and global shape, and every container's type, checked to
    agree between ranks. Raises naming the key and ranks."""
    info: dict[str, TensorMeta] = {}
    first_holder: dict[str, int] = {}
    containers: dict[str, str] = {}
    seen: list[dict[str, TensorMeta]] = []  # distinct per-rank tensor descriptions already merged
    for r, m in enumerate(layouts_):
        if m["containers"] != containers:
            for k, t in m["containers"].items():
                if containers.setdefault(k, t) != t:
                    raise RankMismatchError(
                        f"key {k!r} is a {containers[k]} on some ranks and a {t} on rank {r}; the state's structure "
                        "must agree between ranks")
        tensors = m["tensors"]
        if any(tensors is d or tensors == d for d in seen[-2:]):  # the common case: the same as a rank before
            continue
        seen.append(tensors)
        for k, meta in tensors.items():
            prev = info.setdefault(k, meta)
            first_holder.setdefault(k, r)
            if prev is not meta and (prev["dtype"] != meta["dtype"] or prev["shape"] != meta["shape"]):
                raise RankMismatchError(
                    f"key {k!r} is a {prev['dtype']} tensor of global shape {prev['shape']} on rank {first_holder[k]} "
                    f"but a {meta['dtype']} of shape {meta['shape']} on rank {r}; every rank must describe the same "
                    "global tensor"
                )
    return info, containers


def chunk_table(layouts_: list[RankLayout], keys: list[str], info: dict[str, TensorMeta]) -> tuple[ChunkTable, np.ndarray]:
    """All ranks' chunk rows as arrays (vectorised: ranks that list the same keys in
    the same order are looked up and copied together). Returns the table and each
    rank's first row."""
    nds = np.array([len(info[k]["shape"]) for k in keys], dtype=np.int64)
    ndim = int(max(nds.max(initial=0), 1))
    itemsizes = np.array([itemsize_of(info[k]["dtype"]) for k in keys], dtype=np.int64)
    counts = np.array([len(m["chunks"]["key"]) for m in layouts_], dtype=np.int64)
    row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    ids = _key_ids(layouts_, {k: i for i, k in enumerate(keys)})
    key_col = np.concatenate(ids) if ids else np.zeros(0, dtype=_narrowest(len(keys)))
    boxes = {name: _box_column(layouts_, ids, nds, ndim, name, pad, row_start) for name, pad in (("off", 0), ("size", 1))}
    table = ChunkTable(key=key_col, rank=np.repeat(np.arange(len(layouts_), dtype=_narrowest(len(layouts_))), counts),
                       offsets=boxes["off"], sizes=boxes["size"], itemsize=itemsizes.astype(np.int8)[key_col])
    return table, row_start


def _narrowest(n: int) -> type[np.signedinteger]:
    """The narrowest signed integer type that holds 0..n (the key and rank columns)."""
    return np.int16 if n < 1 << 15 else np.int32 if n < 1 << 31 else np.int64


def _key_ids(layouts_: list[RankLayout], kid: dict[str, int]) -> list[np.ndarray]:
    """Each rank's chunk keys as key ids; consecutive ranks that list the same keys
    share one array (so :func:`_box_column` copies their boxes together)."""
    ids: list[np.ndarray] = []
    prev_keys: list[str] | None = None
    dtype = _narrowest(len(kid))
    cur = np.zeros(0, dtype=dtype)
    for m in layouts_:
        ks = m["chunks"]["key"]
        if ks is not prev_keys and ks != prev_keys:
            cur = np.fromiter((kid[k] for k in ks), dtype=dtype, count=len(ks))
            prev_keys = ks
        ids.append(cur)
    return ids


def _box_column(layouts_: list[RankLayout], ids: list[np.ndarray], nds: np.ndarray, ndim: int, name: str, pad: int,
                row_start: np.ndarray) -> np.ndarray:
    """All ranks' ``off`` or ``size`` boxes as one (rows, ndim) int64 array, the
    trailing dims of lower-rank tensors padded with ``pad``. The ranks that share a key
    list are copied together: straight into place when none is padded, else a block of
    ranks at a time by one ``take`` from their values and a pad column (a scatter by
    fancy index is several times slower; small blocks keep the copies in cache)."""
    out = np.empty((int(row_start[-1]), ndim), dtype=np.int64)
    r = 0
    while r < len(layouts_):
        e = r + 1
        while e < len(layouts_) and ids[e] is ids[r]:
            e += 1
        dims = nds[ids[r]]
        want = int(dims.sum())
        flats = [_flat_boxes(m, name) for m in layouts_[r:e]]
        bad = next((q for q, f in zip(range(r, e), flats) if f.size != want), None)
        if bad is not None:
            raise InternalError(
                f"rank {bad} described chunks whose number of dimensions differs from their tensor's shape; "
                "this is a bug in the layout of that rank's state (report it with the state's types)")
        block = out[row_start[r] : row_start[e]].reshape(e - r, -1)
        if len(dims) and (dims == ndim).all():
            np.concatenate(flats, out=block.reshape(-1))
        elif len(dims):
            real = np.arange(ndim) < dims[:, None]  # (rows, ndim): the slots a value fills
            src = np.full(real.shape, want, dtype=np.int64)  # column ``want``: the pad
            src[real] = np.arange(want)
            step = max(1, (1 << 18) // (want + 1))
            for a in range(0, e - r, step):
                part = np.empty((min(step, e - r - a), want + 1), dtype=np.int64)
                part[:, want] = pad
                part[:, :want] = np.concatenate(flats[a : a + step]).reshape(-1, want)
                np.take(part, src.reshape(-1), axis=1, out=block[a : a + step], mode="clip")  # "clip": unbuffered
        r = e
    return out


def make_plan(layouts_: list[RankLayout]) -> Plan:
    """Plan a save from every rank's layout (or full description): structure
    agreement, then the chunk table, then writers (:func:`choose_writers`)."""
    info, containers = merge_structure(layouts_)
    keys = sorted(info)
    table, row_start = chunk_table(layouts_, keys, info)
    shapes = np.ones((len(keys), table.offsets.shape[1]), dtype=np.int64)
    for i, k in enumerate(keys):
        shp = info[k]["shape"]
        shapes[i, : len(shp)] = shp
    try:
        sp = choose_writers(table, shapes, len(layouts_))
    except PlanError as e:
        detail = "; ".join(f"key {keys[k]!r}: {why}" for k, why in sorted(e.problems.items()))
        raise UsageError(f"the ranks' pieces do not form valid tensors: {detail}") from None
    nonempty = nonempty_rows(table.sizes)
    return Plan(keys, info, containers, [m["per_rank"] for m in layouts_], row_start, table, shapes, sp.group,
                sp.writer & nonempty, sp.replicated & nonempty, sp.placement)


def merge_values(plan: Plan, values: list[RankValues]) -> dict[str, Encoded]:
    """The replicated plain values, checked to agree between the ranks that hold them."""
    first = values[0]["values"] if values else {}
    if all(v["values"] == first for v in values[1:]):  # the common case: every rank holds the same values (in C)
        if not (plan.info.keys() & first.keys()):
            return dict(first)
    merged: dict[str, Encoded] = {}
    holders: dict[str, dict[str, list[int]]] = {}
    for r, v in enumerate(values):
        for k, x in v["values"].items():
            holders.setdefault(k, {}).setdefault(repr(x), []).append(r)
            merged.setdefault(k, x)
    both = set(plan.info) & set(merged)
    if both:
        k = sorted(both)[0]
        raise RankMismatchError(
            f"key {k!r} is a tensor on some ranks and a plain value on rank {holders[k][repr(merged[k])][0]}; "
            "every rank must hold the same kind of leaf at a key")
    for k, by_value in holders.items():
        if len(by_value) > 1:
            groups = sorted(by_value.values())
            raise RankMismatchError(
                f"key {k!r} differs between ranks ({'; '.join('ranks ' + str(g) for g in groups)} hold different values) "
                "but is saved as replicated; wrap per-rank values in shardpoint.PerRank(...), or make them agree"
            )
    return merged


def _ranges_by_rank(mask: np.ndarray, row_start: np.ndarray) -> list[list[list[int]]]:
    """Per rank, ``[[start, stop], ...]`` of the runs of True in its rows of ``mask``,
    in the rank's own row numbers. Ranks whose ranges are equal share one list (at
    8,192 ranks a few hundred lists instead of millions: fewer objects to build, and
    for the collector to scan after planning); the replies are serialised, never
    edited. When every rank holds as many rows, equal rows are found first (by their
    packed bytes) and only the distinct ones are scanned."""
    world = len(row_start) - 1
    rows = np.diff(row_start)
    if world > 1 and rows[0] and (rows == rows[0]).all():
        by_rank = mask.reshape(world, -1)
        distinct: dict[bytes, int] = {}
        which = [distinct.setdefault(row.tobytes(), len(distinct)) for row in np.packbits(by_rank, axis=1)]
        first = np.zeros(len(distinct), dtype=np.int64)
        first[np.asarray(which)[::-1]] = np.arange(world - 1, -1, -1)  # each distinct row's first rank
        ranges = _runs_by_rank(by_rank[first].reshape(-1), row_start[: len(first) + 1])
        return [ranges[i] for i in which]
    return _runs_by_rank(mask, row_start)


def _runs_by_rank(mask: np.ndarray, row_start: np.ndarray) -> list[list[list[int]]]:
    """:func:`_ranges_by_rank` for any table: one pass over all its rows."""
    world = len(row_start) - 1
    begin, end = mask.copy(), mask.copy()
    begin[1:] &= ~mask[:-1]
    end[:-1] &= ~mask[1:]
    inner = row_start[1:-1][(row_start[1:-1] > 0) & (row_start[1:-1] < len(mask))]
    begin[inner] = mask[inner]  # a run does not cross from one rank's rows into the next's
    end[inner - 1] = mask[inner - 1]
    starts = np.flatnonzero(begin)
    owner = np.searchsorted(row_start, starts, side="right") - 1
    local = np.empty((len(starts), 2), dtype=np.int64)
    local[:, 0] = starts
    local[:, 1] = np.flatnonzero(end) + 1
    local -= row_start[owner][:, None]
    cut = np.searchsorted(owner, np.arange(world + 1)).tolist()
    seen: dict[bytes, list[list[int]]] = {}
    out = []
    for r in range(world):
        part = local[cut[r] : cut[r + 1]]
        key = part.tobytes()
        ranges = seen.get(key)
        if ranges is None:
            ranges = seen[key] = part.tolist()
        out.append(ranges)
    return out


def assignments(plan: Plan) -> list[Wire]:
    """What each rank does with its own chunk rows: ``write`` (its bytes go to its
    file) and ``check`` (report its checksums: a replica), as row ranges in the
    rank's own row numbers."""
    write = _ranges_by_rank(plan.writer, plan.row_start)
    check = _ranges_by_rank(plan.check, plan.row_start)
    return [{"write": w, "check": c} for w, c in zip(write, check)]


def replica_digest(crcs: list[int]) -> int:
    """One 63-bit number for a chunk's block checksums: equal replicas give equal
    numbers (what a rank reports for each replica row it checks)."""
    data = b"".join(int(c).to_bytes(4, "little") for c in crcs)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def check_replicas(plan: Plan, statuses: list[WriteStatus]) -> None:
    """Raise naming key and ranks when replicated bytes differ between ranks.
    Each status lists its replica rows (in the rank's own order) and the
    :func:`replica_digest` of each; each digest is compared with one of its group's
    (a scatter and a gather, no sort)."""
    lens = np.array([len(st.replica_rows) for st in statuses], dtype=np.int64)
    n = int(lens.sum())
    if not n:
        return
    rows = np.fromiter(chain.from_iterable(st.replica_rows for st in statuses), dtype=np.int64, count=n)
    g_all = plan.group[rows + np.repeat(plan.row_start[: len(statuses)], lens)]
    d_all = np.fromiter(chain.from_iterable(st.replica_digests for st in statuses), dtype=np.int64, count=n)
    last = np.empty(int(g_all.max()) + 1, dtype=_narrowest(n))  # each group's last entry (a narrow table: less to fault in)
    last[g_all] = np.arange(n, dtype=last.dtype)
    differs = d_all != d_all[last[g_all]]
    if not differs.any():
        return
    first = int(g_all[differs].min())
    rk = np.repeat(np.arange(len(statuses), dtype=np.int64), lens)
    by: dict[int, list[int]] = {}
    for i in np.nonzero(g_all == first)[0]:
        by.setdefault(int(d_all[i]), []).append(int(rk[i]))
    row = int(np.nonzero(plan.group == first)[0][0])
    key = plan.keys[int(plan.table.key[row])]
    holders = "; ".join(f"ranks {sorted(v)}" for v in sorted(by.values()))
    raise RankMismatchError(
        f"key {key!r} is replicated but its bytes differ between ranks ({holders} hold different data). "
        "Replicas that disagree mean the training state has diverged; if the value is meant to differ "
        "per rank, wrap it in shardpoint.PerRank(...)"
    )


def _tree(containers: dict[str, str], values: dict[str, Encoded], tensors: dict[str, TensorEntry]) -> Tree:
    """One (sub)tree of the manifest: containers, values, tensors with their layout
    (:func:`_tensor_entries`; the same for the top level and for each rank's per-rank value)."""
    tree = Tree(containers=dict(sorted(containers.items())))
    for k, v in sorted(values.items()):
        tree.entries[k] = ValueEntry(list(v))
    tree.entries.update(tensors)
    return tree


def _tensor_entries(info: dict[str, TensorMeta], placed: dict[str, Layout]) -> dict[str, TensorEntry]:
    """The tensors' entries of a (sub)tree, by key: dtype, shape and layout."""
    out: dict[str, TensorEntry] = {}
    for k in sorted(info):
        t, lay = info[k], placed[k]
        out[k] = TensorEntry(t["dtype"], list(t["shape"]), bool(t.get("numpy")), lay.grid, lay.flat, lay.chunks)
    return out


def _per_rank_placed(d: TreeLayout, rank: int) -> dict[str, Layout]:
    c = d["chunks"]
    by_key: dict[str, list[int]] = {}
    for i, size in enumerate(c["size"]):
        if all(s > 0 for s in size):
            by_key.setdefault(c["key"][i], []).append(i)
    out = {}
    for k, t in d["tensors"].items():
        rows = by_key.get(k, [])
        nd = len(t["shape"])
        offs = np.array([c["off"][i] for i in rows], dtype=np.int64).reshape(len(rows), nd)
        sizes = np.array([c["size"][i] for i in rows], dtype=np.int64).reshape(len(rows), nd)
        out[k] = layouts.encode(tuple(t["shape"]), offs, sizes, np.full(len(rows), rank, dtype=np.int64))
    return out


def _row_split_grids(plan: Plan, bounds: np.ndarray) -> dict[str, Layout]:
    """The ``grid`` entries of the tensors split along dim 0 only (FSDP's ``Shard(0)``,
    the common case), for all of them at once: the same entries
    :func:`layouts.encode` makes, without a dozen array calls per tensor. The
    placement's rows are in (key, box) order (so by dim-0 offset within a key),
    ``bounds`` each key's first row. The plan validated that a key's boxes tile it, so
    boxes that span every other dimension are consecutive row ranges."""
    pl = plan.placement
    nkeys = len(plan.keys)
    if not len(pl.key) or nkeys == 0:
        return {}
    shapes = plan.shapes
    nds = np.array([len(plan.info[k]["shape"]) for k in plan.keys], dtype=np.int64)
    kw, off, size, rank = pl.key, pl.offsets, pl.sizes, pl.rank
    n = len(kw)
    spans = np.ones(n, dtype=bool)
    for d in range(1, off.shape[1]):
        spans &= (off[:, d] == 0) & (size[:, d] == shapes[kw, d])
    counts = np.diff(bounds)
    ok = (nds >= 1) & (counts > 0) & (np.bincount(kw, weights=~spans, minlength=nkeys) == 0)
    if not ok.any():
        return {}
    start = np.repeat(bounds[:-1], counts)  # each row's key's first row
    last = np.repeat(bounds[1:] - 1, counts)
    idx = np.arange(n)
    s0 = size[:, 0]
    c0 = s0[start]
    uneven = np.where(idx < last, s0 != c0, s0 > c0)  # every piece c0 but the last, which is at most c0
    step = np.zeros(n, dtype=np.int64)
    step[1:] = rank[1:] - rank[:-1]
    step0 = step[np.minimum(start + 1, last)]
    irregular = (idx > start) & (step != step0)  # ranks not first + i * step
    bad_cuts = np.bincount(kw, weights=uneven, minlength=nkeys) > 0
    bad_ranks = np.bincount(kw, weights=irregular, minlength=nkeys) > 0
    out: dict[str, Layout] = {}
    first_off, first_rank = off[bounds[:-1].clip(max=n - 1), 0], rank[bounds[:-1].clip(max=n - 1)]
    c0_key = s0[bounds[:-1].clip(max=n - 1)]
    step_key = step[np.minimum(bounds[:-1] + 1, bounds[1:] - 1).clip(max=n - 1)]
    for i in np.nonzero(ok)[0].tolist():
        a, b = int(bounds[i]), int(bounds[i + 1])
        if int(first_off[i]) != 0:  # pragma: no cover - a validated tiling starts at 0
            continue
        shp = plan.info[plan.keys[i]]["shape"]
        dim0: int | list[int] = int(c0_key[i]) if not bad_cuts[i] else off[a:b, 0].tolist() + [int(shp[0])]
        ranks: list[int] | RankStep
        if b - a == 1:
            ranks = [int(first_rank[i])]
        elif not bad_ranks[i]:
            ranks = RankStep(int(first_rank[i]), int(step_key[i]))
        else:
            ranks = rank[a:b].tolist()
        out[plan.keys[i]] = Layout(grid=Grid([dim0, *shp[1:]], ranks))
    return out


def tensor_entries(plan: Plan) -> dict[str, TensorEntry]:
    """The manifest's entries of the plan's tensors (top level), by key."""
    return _tensor_entries(plan.info, placed_layouts(plan))


def placed_layouts(plan: Plan) -> dict[str, Layout]:
    """Each tensor's layout entry (:func:`layouts.encode` of its non-empty boxes and
    their writers), from the plan's placement. A key that shares another's boxes and
    writers (one pattern of a grid of ranks) shares that key's entry object: the
    manifest is serialised, never edited (copying thousands of rank lists cost seconds)."""
    pl = plan.placement
    bounds = np.searchsorted(pl.key, np.arange(len(plan.keys) + 1))
    placed = _row_split_grids(plan, bounds)
    alias = pl.same_as != np.arange(len(plan.keys))
    for i, k in enumerate(plan.keys):
        if k not in placed and not alias[i]:
            a, b = bounds[i], bounds[i + 1]
            placed[k] = layouts.encode(tuple(plan.info[k]["shape"]), pl.offsets[a:b], pl.sizes[a:b], pl.rank[a:b])
    for i in np.flatnonzero(alias).tolist():
        j, shape = int(pl.same_as[i]), tuple(plan.info[plan.keys[i]]["shape"])
        if len(shape) == len(plan.info[plan.keys[j]]["shape"]):
            placed[plan.keys[i]] = placed[plan.keys[j]]
        else:  # the same padded boxes, another number of dimensions (a 0-d tensor and a 1-element one)
            a, b = bounds[j], bounds[j + 1]
            placed[plan.keys[i]] = layouts.encode(shape, pl.offsets[a:b], pl.sizes[a:b], pl.rank[a:b])
    return placed


def build_manifest(plan: Plan, values: list[RankValues], statuses: list[WriteStatus], save_id: str, *,
                   merged: dict[str, Encoded] | None = None, tensors: dict[str, TensorEntry] | None = None) -> Manifest:
    """The manifest from the plan, the ranks' values and what each rank wrote (its
    file, and the non-finite values it found): each tensor described by its layout
    (:mod:`shardpoint.format.layouts`). ``merged``: :func:`merge_values` of ``values``,
    ``tensors``: :func:`tensor_entries` of ``plan``, where the caller has them."""
    tree = _tree(plan.containers, merge_values(plan, values) if merged is None else merged,
                 tensor_entries(plan) if tensors is None else tensors)
    for pkey in sorted({k for pr in plan.per_rank for k in pr}):
        ranks: dict[str, TreeDoc] = {}
        for r, pr in enumerate(plan.per_rank):
            d = pr.get(pkey)
            if d is not None:
                sub = _tree(d["containers"], values[r]["per_rank"].get(pkey, {}),
                            _tensor_entries(d["tensors"], _per_rank_placed(d, r)))
                ranks[str(r)] = sub.doc()
        tree.entries[pkey] = PerRankEntry(ranks)
    files = {st.file: DataFile(st.size, r, IndexFile.of(st.index.name, st.index.size, st.index.digest))
             for r, st in enumerate(statuses) if st.file is not None and st.index is not None}
    return Manifest(world_size=len(statuses), created=time.time(), save_id=save_id, tree=tree, files=files,
                    crc_block=CRC_BLOCK, library_version=__version__,
                    # health: what any rank found non-finite, and what each key is (shardpoint.health)
                    nonfinite=sorted({k for st in statuses for k in st.nonfinite}),
                    nan=sorted({k for st in statuses for k in st.nan}),
                    roles={k: v for st in statuses for k, v in (st.roles or {}).items()})


@dataclass(slots=True)
class CachedPlan:
    """The last plan of a process group, kept on its coordinator (rank 0)."""

    combined: str
    digests: list[str]
    layouts: list[RankLayout]
    structures: dict[str, Wire]
    plan: Plan
    #: :func:`tensor_entries` of ``plan``, made by the first manifest built from it (a
    #: manifest is serialised, never edited: later saves of the layout share them).
    tensors: dict[str, TensorEntry] | None = None
    #: Their rows of the manifest's layouts table, made by the first manifest that wrote them.
    rows: RowsMemo = field(default_factory=RowsMemo)


def _combined(digests: list[str]) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:32]


@dataclass(slots=True)
class Coordinator:
    """Rank 0's state during one save of a process group."""

    tag: str
    world: int
    layouts: list[RankLayout | None] = field(default_factory=list)
    digests: list[str | None] = field(default_factory=list)
    values: list[RankValues] = field(default_factory=list)
    structures: dict[str, Wire] = field(default_factory=dict)  # structure digest -> structure
    plan: Plan | None = None
    save_id: str = ""
    reused: bool = False  # whether the plan came from the cache
    merged: dict[str, Encoded] | None = None  # the replicated values, merged by the plan round

    def __post_init__(self) -> None:
        self.layouts = [None] * self.world
        self.digests = [None] * self.world

    def plan_round(self, msgs: list[Wire]) -> list[Wire]:
        with gc_paused():
            return self._plan_round(msgs)

    def _plan_round(self, msgs: list[Wire]) -> list[Wire]:
        """Take the ranks' messages (``digest``; ``layout``: None or a
        :func:`layout_message`; ``plan``: the id of the plan the rank holds an
        assignment of; ``values``) and answer each rank with its assignment (None
        when it holds it already), or with ``resend`` when some layouts or
        structures are not known here (then every rank sends its whole layout)."""
        cached = PROCESS.plans.get(self.tag)
        if not isinstance(cached, CachedPlan) or len(cached.digests) != self.world:
            cached = None
        if cached is not None:
            self.structures.update(cached.structures)
        for m in msgs:
            lay = m.get("layout")
            if lay is not None and lay["s"] is not None:
                self.structures[lay["sd"]] = lay["s"]
        missing = []
        for r, m in enumerate(msgs):
            if "values" in m:
                if len(self.values) < self.world:
                    self.values.append(m["values"])
                self.digests[r] = m["digest"]
            lay = m.get("layout")
            if lay is not None and lay["sd"] in self.structures:
                self.layouts[r] = _full_layout(self.structures[lay["sd"]], lay["b"], r)
            elif self.layouts[r] is None:
                if lay is None and cached is not None and cached.digests[r] == self.digests[r]:
                    self.layouts[r] = cached.layouts[r]
                else:
                    missing.append(r)
        if missing:
            gone = set(missing)
            return [{"resend": r in gone} for r in range(self.world)]
        digests = [d for d in self.digests if d is not None]
        combined = _combined(digests)
        if cached is not None and cached.combined == combined:
            self.plan, self.reused = cached.plan, True
        else:
            known = [lay for lay in self.layouts if lay is not None]  # all of them: none is missing
            self.plan = make_plan(known)
            PROCESS.plans[self.tag] = CachedPlan(combined, digests, known, self.structures, self.plan)
        self.merged = merge_values(self.plan, self.values)  # disagreeing values fail before anything is written
        self.save_id = uuid.uuid4().hex[:12]
        held = [m.get("plan") == combined for m in msgs]
        assign = assignments(self.plan) if not all(held) else [None] * self.world
        return [{"save_id": self.save_id, "plan_id": combined, "assign": None if h else a}
                for h, a in zip(held, assign)]

    def manifest(self, statuses: list[WriteStatus]) -> Manifest:
        """Check replicas and build the manifest from the ranks' write statuses."""
        assert self.plan is not None
        with gc_paused():
            check_replicas(self.plan, statuses)
            cached = PROCESS.plans.get(self.tag)
            tensors = None
            rows = None
            if isinstance(cached, CachedPlan) and cached.plan is self.plan:
                if cached.tensors is None:
                    cached.tensors = tensor_entries(self.plan)
                tensors, rows = cached.tensors, cached.rows
            m = build_manifest(self.plan, self.values, statuses, self.save_id, merged=self.merged, tensors=tensors)
            m.rows_memo = rows
            return m
