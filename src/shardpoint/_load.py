"""Load: manifest -> read plan -> parallel verified reads -> place in place or
create -> report."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import CheckpointNotFoundError, CorruptCheckpointError, KeyMismatchError, ShardpointError
from .format.datafile import crc32, dtype_from_name
from .format.manifest import MANIFEST_NAME, Manifest, Tree, decode_value
from .layout import chunks_of
from .plan import Box, PlanError, box_runs, plan_reads, validate_partition
from .report import LoadReport
from .storage import Storage
from .tree import Node, PerRank, Walk, decode_key, encode_key, join, matches_prefix

#: Threads that read and verify chunks in parallel.
IO_THREADS = int(os.environ.get("SHARDPOINT_IO_THREADS", 4))


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest at ``storage``, or :class:`CheckpointNotFoundError`."""
    if not storage.exists(MANIFEST_NAME):
        raise CheckpointNotFoundError(
            f"no checkpoint at {storage.url}: it has no {MANIFEST_NAME}, so no save ever committed there "
            "(a save that failed or was killed leaves no manifest); check the path"
        )
    return Manifest.parse(bytes(storage.read(MANIFEST_NAME)), where=f"{storage.url}/{MANIFEST_NAME}")


@dataclass(slots=True)
class _Target:
    """A tensor to fill: its boxes and the views that hold them."""

    key: str
    entry: dict[str, Any]
    boxes: list[Box]
    views: list[torch.Tensor]


@dataclass(slots=True)
class Reader:
    """Executes reads for many targets in parallel, verifying block checksums."""

    storage: Storage
    crc_block: int
    verify: bool = True
    bytes_read: int = 0
    targets: list[_Target] = field(default_factory=list)

    def add(self, key: str, entry: dict[str, Any], boxes: list[Box], views: list[torch.Tensor]) -> None:
        self.targets.append(_Target(key, entry, boxes, views))

    def run(self) -> None:
        jobs: list[Callable[[], int]] = []
        for t in self.targets:
            dtype = dtype_from_name(t.entry["dtype"])
            itemsize = torch.empty(0, dtype=dtype).element_size()
            saved = [Box(tuple(c["offsets"]), tuple(c["sizes"])) for c in t.entry["chunks"]]
            shape = tuple(t.entry["shape"])
            if len(saved) > 1:
                _validate_saved(t.key, saved, shape)
            for c, b in zip(t.entry["chunks"], saved):
                if c["length"] != b.numel * itemsize:
                    raise CorruptCheckpointError(
                        f"key {t.key!r}: a chunk in {c['file']} is {c['length']} bytes but its box holds "
                        f"{b.numel} x {itemsize} bytes; the manifest is damaged"
                    )
            try:
                ops = plan_reads(saved, t.boxes)
            except ValueError:
                raise CorruptCheckpointError(f"key {t.key!r}: the checkpoint's chunks do not cover the tensor") from None
            for op in ops:
                jobs.append(self._job(t, op, saved[op.source], t.entry["chunks"][op.source], dtype, itemsize))
        if not jobs:
            return
        if len(jobs) == 1 or IO_THREADS <= 1:
            self.bytes_read += sum(j() for j in jobs)
            return
        with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(jobs))) as ex:
            self.bytes_read += sum(ex.map(lambda j: j(), jobs))

    def _job(self, t: _Target, op: Any, sbox: Box, chunk: dict[str, Any], dtype: torch.dtype, itemsize: int) -> Callable[[], int]:
        def run() -> int:
            tbox = t.boxes[op.target]
            dst = t.views[op.target].detach()  # a parameter may require grad; we write its data
            if tbox.sizes:
                dst = dst[tuple(slice(r - o, r - o + n) for r, o, n in zip(op.region.offsets, tbox.offsets, op.region.sizes))]
            if dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous() and dst.numel():
                if box_runs(op.region, sbox)[3] == 1:  # one contiguous byte range on both sides
                    return self._read_range_into(t.key, chunk, op.first * itemsize, op.last * itemsize, dst)
            lo, hi = op.first * itemsize, op.last * itemsize
            if self.verify:
                blk = self.crc_block
                lo, hi = (lo // blk) * blk, min(-(-hi // blk) * blk, chunk["length"])
            try:
                data = self.storage.read(chunk["file"], chunk["offset"] + lo, hi - lo)
            except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
                raise CorruptCheckpointError(f"key {t.key!r}: {e}") from None
            if not isinstance(data, bytearray):
                data = bytearray(data)
            if len(data) != hi - lo:
                raise CorruptCheckpointError(f"key {t.key!r}: short read from {chunk['file']}; the file is truncated")
            if self.verify:
                blk = self.crc_block
                mv = memoryview(data)
                for j, i in enumerate(range(0, max(len(data), 1), blk)):
                    want = chunk["crc32"][lo // blk + j]
                    if crc32(mv[i : i + blk]) != want:
                        raise CorruptCheckpointError(
                            f"checksum mismatch in {chunk['file']} (bytes {chunk['offset'] + lo + i}..{chunk['offset'] + lo + i + len(mv[i : i + blk])}) "
                            f"for key {t.key!r}: the file is damaged. Restore it from a copy, or load another checkpoint"
                        )
            if op.region.numel == 0:
                return len(data)
            src = torch.frombuffer(data, dtype=torch.uint8).view(dtype) if len(data) else torch.empty(0, dtype=dtype)
            # the region inside the saved chunk, as a strided view of the bytes read
            strides = [1] * len(sbox.sizes)
            for d in range(len(sbox.sizes) - 2, -1, -1):
                strides[d] = strides[d + 1] * sbox.sizes[d + 1]
            base = op.first - lo // itemsize
            region = src.as_strided(op.region.sizes, strides, base) if sbox.sizes else src[base : base + 1].reshape(())
            dst.copy_(region)
            return len(data)

        return run

    def _read_range_into(self, key: str, chunk: dict[str, Any], lo: int, hi: int, dst: torch.Tensor) -> int:
        """Bytes ``[lo, hi)`` of a saved chunk straight into a contiguous CPU target of
        the same dtype, with no staging copy. To verify, the partial CRC blocks at the
        two ends are completed with small reads of their outer bytes (CRC-32 chains);
        returns the bytes read."""
        view = memoryview(dst.reshape(-1).view(torch.uint8).numpy()).cast("B")
        base = chunk["offset"]
        try:
            self.storage.read_into(chunk["file"], base + lo, view)
            if not self.verify:
                return len(view)
            blk, length = self.crc_block, chunk["length"]
            a, b = (lo // blk) * blk, min(-(-hi // blk) * blk, length)
            head = self.storage.read(chunk["file"], base + a, lo - a) if lo > a else b""
            tail = self.storage.read(chunk["file"], base + hi, b - hi) if b > hi else b""
        except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {key!r}: {e}") from None
        for j in range(a // blk, -(-b // blk)):
            s, e = j * blk, min((j + 1) * blk, length)
            crc = crc32(head[s - a :]) if s < lo else 0
            crc = crc32(view[max(s, lo) - lo : min(e, hi) - lo], crc)
            if e > hi:
                crc = crc32(tail[: e - hi], crc)
            if crc != chunk["crc32"][j]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {chunk['file']} (bytes {base + s}..{base + e}) for key {key!r}: the file is "
                    "damaged. Restore it from a copy, or load another checkpoint"
                )
        return len(view) + len(head) + len(tail)


def _validate_saved(key: str, boxes: list[Box], shape: tuple[int, ...]) -> None:
    nd = max(len(shape), 1)
    pad = lambda x, v: list(x) + [v] * (nd - len(x))  # noqa: E731
    try:
        validate_partition(
            np.zeros(len(boxes), dtype=np.int64),
            np.array([pad(b.offsets, 0) for b in boxes], dtype=np.int64),
            np.array([pad(b.sizes, 1) for b in boxes], dtype=np.int64),
            np.array([pad(shape, 1)], dtype=np.int64),
        )
    except PlanError as e:
        raise CorruptCheckpointError(f"key {key!r}: {e.problems[0]} in the manifest; the checkpoint is damaged") from None


class _Selector:
    def __init__(self, only: list[str] | None, exclude: list[str] | None) -> None:
        self.only = [only] if isinstance(only, str) else only
        self.exclude = [exclude] if isinstance(exclude, str) else exclude

    def __call__(self, key: str) -> bool:
        if self.only is not None and not matches_prefix(key, self.only):
            return False
        return not (self.exclude and matches_prefix(key, self.exclude))


@dataclass(slots=True)
class TreeLoad:
    """Loading one tree (the top level, or one rank's per-rank value) into one walk."""

    walk: Walk
    tree: Tree
    select: _Selector
    report: LoadReport
    values: dict[str, Any] = field(default_factory=dict)  # key -> decoded value to assign
    pending: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)  # container key -> [(seg, value)]
    touched: set[str] = field(default_factory=set)
    rank: int = 0
    hollow: dict[str, list[tuple[Any, str]]] | None = None  # see hollow_containers; computed on first use

    def check(self, strict: bool) -> None:
        """Keys and shapes, before anything is modified."""
        r = self.report
        for key, node in self.walk.leaves.items():
            if not self.select(key):
                r.skipped.append(key)
                continue
            e = self.tree.entries.get(key)
            if e is None:
                r.missing.append(key)
                continue
            if node.kind == "tensor":
                if e["kind"] != "tensor":
                    raise KeyMismatchError(f"key {key!r} is a tensor in the local state but a {e['kind']} in the checkpoint")
                lc = chunks_of(key, node.obj)
                if tuple(lc.shape) != tuple(e["shape"]):
                    raise KeyMismatchError(
                        f"key {key!r}: the checkpoint holds shape {tuple(e['shape'])}, the local tensor has global shape "
                        f"{tuple(lc.shape)}; load into a tensor of the saved shape (or leave the key out with exclude=)"
                    )
                if any(v.device.type == "meta" for v in lc.views):
                    raise KeyMismatchError(
                        f"key {key!r} is on the meta device, so there is no memory to load into; materialise it "
                        "first (module.to_empty(device=...)) and then load"
                    )
        for key in self.walk.per_rank:
            if not self.select(key):
                r.skipped.append(key)
                continue
            e = self.tree.entries.get(key)
            if e is None:
                r.missing.append(key)
            elif e["kind"] != "per_rank":
                raise KeyMismatchError(
                    f"key {key!r} is a PerRank value in the local state but a {e['kind']} in the checkpoint; "
                    "wrap it (or not) in shardpoint.PerRank the way it was saved, or leave it out with exclude="
                )
        for key in self.tree.entries:
            if not self.select(key) and key not in self.walk.leaves:
                r.skipped.append(key)
        if strict and r.missing:
            raise KeyMismatchError(
                f"{len(r.missing)} key(s) of the local state are not in the checkpoint: {sorted(r.missing)[:20]}; "
                "pass strict=False to leave them as they are, or exclude=[...] to skip them"
            )

    def plan(self, reader: Reader, held: Callable[[str], bool], create: bool) -> None:
        """Schedule reads for local tensors; decide what to create."""
        r = self.report
        for key, node in self.walk.leaves.items():
            if key in r.skipped or key in r.missing:
                continue
            e = self.tree.entries[key]
            self.touched.add(key)
            r.loaded.append(key)
            if node.kind == "tensor":
                lc = chunks_of(key, node.obj)
                if lc.dtype != dtype_from_name(e["dtype"]):
                    r.cast.append(key)
                reader.add(key, e, lc.boxes, lc.views)
            else:
                self.values[key] = decode_value(e["value"], where=f"entry {key!r}") if e["kind"] == "value" else None
                if e["kind"] != "value":
                    raise KeyMismatchError(f"key {key!r} is a plain value in the local state but a {e['kind']} in the checkpoint")
        for key, e in self.tree.entries.items():
            if key in self.walk.leaves or key in self.walk.per_rank or not self.select(key) or held(key):
                continue
            anchor = self._anchor(key)
            if not create or anchor is None:
                r.unexpected.append(key)
                continue
            if e["kind"] == "per_rank":
                sub = e["ranks"].get(str(self.rank))
                r.per_rank[key] = "restored" if sub else "kept"
                if sub is None:
                    continue
                value: Any = PerRank(materialise_tree(Tree(sub["containers"], sub["entries"]), key, reader))
            else:
                value = leaf_value(key, e, reader)
            path = decode_key(key)
            anc_path = decode_key(anchor)
            self._insert(anchor, path[len(anc_path) :], value)
            r.created.append(key)
            self.touched.add(key)

    def _anchor(self, key: str) -> str | None:
        """The deepest local container above ``key``, unless a local leaf is in the way."""
        path = decode_key(key)
        for n in range(len(path) - 1, -1, -1):
            k = encode_key(path[:n])
            if k in self.walk.leaves or k in self.walk.per_rank:
                return None
            if k in self.walk.containers:
                return k
        return None

    def _insert(self, anchor: str, rel: tuple[Any, ...], value: Any) -> None:
        """Record ``value`` to be placed at ``anchor``/rel, creating containers of the
        saved types on the way (built as dicts now, typed in :meth:`_typed`)."""
        head = rel[0]
        lst = self.pending.setdefault(anchor, [])
        if len(rel) == 1:
            lst.append((head, value))
            return
        for seg, sub in lst:
            if seg == head and isinstance(sub, _Pending):
                sub.put(rel[1:], value)
                return
        if self.hollow is None:
            self.hollow = hollow_containers(self.tree, self.select)
        p = _Pending(join(anchor, head), self.tree.containers, self.hollow)
        p.put(rel[1:], value)
        lst.append((head, p))

    def fill(self, node: Node, key: str) -> Any:
        """Place values and created keys, call load_state_dict; returns the node's new value."""
        k = node.kind
        if k in ("dict", "list", "tuple"):
            obj = node.obj
            items = []
            for seg, child in node.children.items():
                v = self.fill(child, join(key, seg))
                items.append(v)
                if k != "tuple" and obj[seg] is not v:
                    obj[seg] = v
            for seg, v in sorted(self.pending.get(key, []), key=lambda sv: (isinstance(sv[0], str), sv[0])):
                v = v.build() if isinstance(v, _Pending) else v
                if k == "dict":
                    obj[seg] = v
                elif seg == len(items):
                    items.append(v)
                    if k == "list":
                        obj.append(v)
                else:
                    self.report.created.remove(join(key, seg)) if join(key, seg) in self.report.created else None
                    self.report.unexpected.append(join(key, seg))
            return tuple(items) if k == "tuple" else obj
        if k == "stateful":
            assert node.inner is not None
            sd = self.fill(node.inner, key)
            if any(t == key or t.startswith(key + "/") or key == "" for t in self.touched):
                node.obj.load_state_dict(sd)
            return node.obj
        if k == "per_rank":
            return node.obj  # filled by its own TreeLoad
        if k == "tensor":
            return node.obj
        return self.values.get(key, node.obj)


def hollow_containers(tree: Tree, select: Callable[[str], bool] | None = None) -> dict[str, list[tuple[Any, str]]]:
    """The saved containers with no entry beneath them (``{}``, ``[]``, ``[{}]``), by
    parent key, as ``(segment, key)``: building a container must bring these back,
    or an optimizer saved before its first step loses its empty ``state`` dict."""
    filled = {""}
    for k in tree.entries:
        i = k.find("/")
        while i != -1:
            filled.add(k[:i])
            i = k.find("/", i + 1)
        filled.add(k)
    out: dict[str, list[tuple[Any, str]]] = {}
    for c in tree.containers:
        if c in filled or (select is not None and not select(c)):
            continue
        parent = c.rsplit("/", 1)[0] if "/" in c else ""
        out.setdefault(parent, []).append((decode_key(c)[-1], c))
    return out


class _Pending:
    """A container created on load, built from the saved container types.

    ``hollow`` (from :func:`hollow_containers`) adds the saved empty containers."""

    def __init__(self, key: str, types: dict[str, str], hollow: dict[str, list[tuple[Any, str]]] | None = None) -> None:
        self.key, self.types, self.items = key, types, {}
        self.hollow = hollow or {}

    def put(self, rel: tuple[Any, ...], value: Any) -> None:
        if len(rel) == 1:
            self.items[rel[0]] = value
            return
        sub = self.items.get(rel[0])
        if not isinstance(sub, _Pending):
            sub = self.items[rel[0]] = _Pending(join(self.key, rel[0]), self.types, self.hollow)
        sub.put(rel[1:], value)

    def build(self) -> Any:
        kind = self.types.get(self.key, "dict")
        for seg, ckey in self.hollow.get(self.key, ()):
            if seg not in self.items:
                self.items[seg] = _Pending(ckey, self.types, self.hollow)
        vals = {k: (v.build() if isinstance(v, _Pending) else v) for k, v in self.items.items()}
        if kind in ("list", "tuple"):
            seq = [vals[i] for i in sorted(k for k in vals if isinstance(k, int))]
            return seq if kind == "list" else tuple(seq)
        return vals


def materialise_tree(tree: Tree, key: str, reader: Reader) -> Any:
    """Build the value of a whole saved (sub)tree rooted at ``key`` (tensors are
    allocated and scheduled on ``reader``)."""
    if key in tree.entries:
        return leaf_value(key, tree.entries[key], reader)
    root = _Pending(key, tree.containers, hollow_containers(tree))
    base = len(decode_key(key))
    for k, e in tree.entries.items():
        root.put(decode_key(k)[base:], leaf_value(k, e, reader))
    return root.build()


def leaf_value(key: str, e: dict[str, Any], reader: Reader) -> Any:
    """A new value for one saved leaf (CPU tensor, numpy array or plain value)."""
    if e["kind"] == "value":
        return decode_value(e["value"], where=f"entry {key!r}")
    if e["kind"] != "tensor":
        raise CorruptCheckpointError(f"entry {key!r}: a {e['kind']!r} entry cannot appear here")
    shape = tuple(e["shape"])
    t = _allocate(key, e, shape, reader.storage)
    reader.add(key, e, [Box((0,) * len(shape), shape)], [t])
    return t.numpy() if e.get("numpy") else t


#: Tensors at least this large are allocated only after their files are seen to hold their bytes.
_CHECK_BEFORE_ALLOC = 64 << 20


def _allocate(key: str, e: dict[str, Any], shape: tuple[int, ...], storage: Storage) -> torch.Tensor:
    """An empty tensor for a saved leaf. A manifest's shape is only a claim: for a
    large tensor, first check that its files really hold its bytes, so a damaged or
    hostile manifest cannot ask for a petabyte."""
    dtype = dtype_from_name(e["dtype"])
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if nbytes >= _CHECK_BEFORE_ALLOC:
        for c in e["chunks"]:
            try:
                size = storage.size(c["file"])
            except (OSError, CorruptCheckpointError) as err:
                raise CorruptCheckpointError(f"key {key!r}: data file {c['file']} cannot be read ({err})") from None
            if c["offset"] + c["length"] > size:
                raise CorruptCheckpointError(
                    f"key {key!r}: the manifest places its bytes up to byte {c['offset'] + c['length']} of {c['file']}, "
                    f"which has {size}; the file is truncated or the manifest is damaged"
                )
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as err:
        raise ShardpointError(
            f"key {key!r}: cannot allocate a {e['dtype']} tensor of shape {list(shape)} ({nbytes} bytes) to load it into "
            f"({err}); load fewer keys at once (keys=[...]) or on a machine with more memory"
        ) from None


def load_per_rank(key: str, node_walk: Walk, entry: dict[str, Any], rank: int,
                  select: _Selector, reader: Reader, report: LoadReport, strict: bool, create: bool) -> list[TreeLoad]:
    """Schedule the load of one per-rank value on this rank."""
    sub = entry.get("ranks", {}).get(str(rank))
    if sub is None:
        report.per_rank[key] = "kept"
        return []
    tree = Tree(containers=sub["containers"], entries=sub["entries"])
    report.per_rank[key] = "restored"
    tl = TreeLoad(node_walk, tree, select, report, rank=rank)
    tl.check(strict)
    tl.plan(reader, lambda k: False, create)
    return [tl]
