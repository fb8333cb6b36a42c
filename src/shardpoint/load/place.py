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

from ..errors import CorruptCheckpointError, KeyMismatchError, ShardpointError
from ..format import layouts
from ..format.datafile import crc32, dtype_from_name, itemsize_of
from ..format.index import Located, chunk_name, parse_index
from ..format.manifest import Manifest, Tree, decode_value, read_manifest  # noqa: F401 - re-exported
from ..format.refs import with_refs
from ..layout import chunks_of
from ..plan import Box, PlanError, box_runs, plan_reads, validate_partition
from ..report import LoadReport
from ..storage import Storage
from ..tree import Node, PerRank, Walk, decode_key, encode_key, join, matches_prefix

#: Threads that read and verify chunks in parallel.
IO_THREADS = int(os.environ.get("SHARDPOINT_IO_THREADS", 4))


@dataclass(slots=True)
class _Target:
    """A tensor to fill: its boxes and the views that hold them."""

    key: str
    entry: dict[str, Any]
    boxes: list[Box]
    views: list[torch.Tensor]
    per_rank: bool = False


@dataclass(slots=True)
class Reader:
    """Executes reads for many targets in parallel, verifying block checksums.

    A version 2 manifest describes each tensor by its layout; where a chunk's bytes
    lie is in its data file's index, which this reads (once, verified against the
    manifest's digest) only for the files the targets need."""

    storage: Storage
    manifest: Manifest
    verify: bool = True
    bytes_read: int = 0
    targets: list[_Target] = field(default_factory=list)
    _indexes: dict[str, dict[str, Located]] = field(default_factory=dict)
    _devices: set[torch.device] = field(default_factory=set)  # CUDA devices with copies in flight

    def __post_init__(self) -> None:
        self.storage = with_refs(self.storage, self.manifest)  # a reference reads from its sibling folder

    @property
    def crc_block(self) -> int:
        return self.manifest.crc_block

    def add(self, key: str, entry: dict[str, Any], boxes: list[Box], views: list[torch.Tensor], per_rank: bool = False) -> None:
        self.targets.append(_Target(key, entry, boxes, views, per_rank))

    def run(self) -> None:
        jobs: list[Callable[[], int]] = []
        for t in self.targets:
            dtype = dtype_from_name(t.entry["dtype"])
            itemsize = itemsize_of(t.entry["dtype"])
            shape = tuple(t.entry["shape"])
            saved = saved_chunks(self.manifest, t.entry, shape)
            boxes = [Box(off, size) for off, size, _ in saved]
            if len(boxes) > 1 and (self.manifest.version < 2 or "chunks" in t.entry):
                _validate_saved(t.key, boxes, shape)
            try:
                ops = plan_reads(boxes, t.boxes)
            except ValueError:
                raise CorruptCheckpointError(f"key {t.key!r}: the checkpoint's chunks do not cover the tensor") from None
            located: dict[int, dict[str, Any]] = {}
            for op in ops:
                c = located.get(op.source)
                if c is None:
                    c = located[op.source] = self.locate(t.key, saved[op.source], t.per_rank)
                    if c["length"] != boxes[op.source].numel * itemsize:
                        raise CorruptCheckpointError(
                            f"key {t.key!r}: a chunk in {c['file']} is {c['length']} bytes but its box holds "
                            f"{boxes[op.source].numel} x {itemsize} bytes; the manifest is damaged"
                        )
                jobs.append(self._job(t, op, boxes[op.source], c, dtype, itemsize))
        if not jobs:
            return
        try:
            if len(jobs) == 1 or IO_THREADS <= 1:
                self.bytes_read += sum(j() for j in jobs)
                return
            with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(jobs))) as ex:
                self.bytes_read += sum(ex.map(lambda j: j(), jobs))
        finally:
            for d in self._devices:  # the targets hold their bytes when the load returns
                torch.cuda.synchronize(d)
            self._devices.clear()

    def _job(self, t: _Target, op: Any, sbox: Box, chunk: dict[str, Any], dtype: torch.dtype, itemsize: int) -> Callable[[], int]:
        def run() -> int:
            tbox = t.boxes[op.target]
            dst = t.views[op.target].detach()  # a parameter may require grad; we write its data
            if tbox.sizes:
                dst = dst[tuple(slice(r - o, r - o + n) for r, o, n in zip(op.region.offsets, tbox.offsets, op.region.sizes))]
            on_gpu = dst.device.type == "cuda"
            if dst.dtype == dtype and (on_gpu or dst.device.type == "cpu") and dst.is_contiguous() and dst.numel():
                if box_runs(op.region, sbox)[3] == 1:  # one contiguous byte range on both sides
                    if not on_gpu:
                        return self._read_range_into(t.key, chunk, op.first * itemsize, op.last * itemsize, dst)
                    # read into pinned host memory, copy to the device while the next reads run
                    host = torch.empty(dst.shape, dtype=dtype, pin_memory=True)
                    n = self._read_range_into(t.key, chunk, op.first * itemsize, op.last * itemsize, host)
                    self._to_device(dst, host)
                    return n
            lo, hi = op.first * itemsize, op.last * itemsize
            data, lo = self._read_staged(t.key, chunk, lo, hi)
            if op.region.numel == 0:
                return len(data)
            src = torch.frombuffer(data, dtype=torch.uint8).view(dtype) if len(data) else torch.empty(0, dtype=dtype)
            # the region inside the saved chunk, as a strided view of the bytes read
            strides = [1] * len(sbox.sizes)
            for d in range(len(sbox.sizes) - 2, -1, -1):
                strides[d] = strides[d + 1] * sbox.sizes[d + 1]
            base = op.first - lo // itemsize
            region = src.as_strided(op.region.sizes, strides, base) if sbox.sizes else src[base : base + 1].reshape(())
            if on_gpu:  # one host copy of the region, pinned, then asynchronously to the device
                host = torch.empty(region.shape, dtype=dtype, pin_memory=True)
                host.copy_(region)
                self._to_device(dst, host)
            else:
                dst.copy_(region)
            return len(data)

        return run

    def _to_device(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """An asynchronous copy from pinned ``host`` (kept by torch's caching host
        allocator until the copy ran); :meth:`run` waits for the device at its end."""
        self._devices.add(dst.device)
        dst.copy_(host, non_blocking=True)

    def locate(self, key: str, chunk: Any, per_rank: bool) -> dict[str, Any]:
        """A saved chunk with its file, byte offset, length and block CRCs (version 2:
        from its file's index)."""
        off, size, where = chunk
        if isinstance(where, dict):  # version 1: the manifest says it all
            return where
        fname = self.manifest.file_of_rank(where)
        if fname is None:
            raise CorruptCheckpointError(
                f"key {key!r}: the manifest places a chunk in the file of rank {where}, which it does not list; "
                "the manifest is damaged"
            )
        idx = self._indexes.get(fname)
        if idx is None:
            idx = self._indexes[fname] = read_index(self.storage, self.manifest, fname)
        name = chunk_name(key, off, per_rank)
        loc = idx.get(name)
        if loc is None:
            raise CorruptCheckpointError(
                f"key {key!r}: chunk {name!r} is not in the index of {fname}; the checkpoint is damaged"
            )
        return {"offsets": off, "sizes": size, "file": loc.ref or fname, "offset": loc.offset, "length": loc.length,
                "crc32": loc.crc32}

    def _read_staged(self, key: str, chunk: dict[str, Any], lo: int, hi: int) -> tuple[bytearray, int]:
        """Bytes ``[lo, hi)`` of a saved chunk (rounded out to whole checksum blocks
        when verifying) in a new buffer, verified; returns it and where it starts."""
        a, b = self._span(chunk, lo, hi)
        data = self._read(key, chunk, a, b - a)
        if self.verify:
            self._check(key, chunk, a, b, a, b, b"", memoryview(data), b"")
        return data, a

    def _read_range_into(self, key: str, chunk: dict[str, Any], lo: int, hi: int, dst: torch.Tensor) -> int:
        """Bytes ``[lo, hi)`` of a saved chunk straight into a contiguous CPU target of
        the same dtype, with no staging copy. To verify, the partial CRC blocks at the
        two ends are completed with small reads of their outer bytes (CRC-32 chains);
        returns the bytes read."""
        view = memoryview(dst.reshape(-1).view(torch.uint8).numpy()).cast("B")
        try:
            self.storage.read_into(chunk["file"], chunk["offset"] + lo, view)
        except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {key!r}: {e}") from None
        if not self.verify:
            return len(view)
        a, b = self._span(chunk, lo, hi)
        head = self._read(key, chunk, a, lo - a) if lo > a else b""
        tail = self._read(key, chunk, hi, b - hi) if b > hi else b""
        self._check(key, chunk, a, b, lo, hi, head, view, tail)
        return len(view) + len(head) + len(tail)

    def _span(self, chunk: dict[str, Any], lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` rounded out to whole checksum blocks (when verifying)."""
        if not self.verify:
            return lo, hi
        blk = self.crc_block
        return (lo // blk) * blk, min(-(-hi // blk) * blk, chunk["length"])

    def _read(self, key: str, chunk: dict[str, Any], at: int, n: int) -> bytearray:
        try:
            data = self.storage.read(chunk["file"], chunk["offset"] + at, n)
        except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {key!r}: {e}") from None
        if len(data) != n:
            raise CorruptCheckpointError(f"key {key!r}: short read from {chunk['file']}; the file is truncated")
        return data if isinstance(data, bytearray) else bytearray(data)

    def _check(self, key: str, chunk: dict[str, Any], a: int, b: int, lo: int, hi: int,
               head: Any, mid: Any, tail: Any) -> None:
        """Check blocks ``[a, b)`` of a chunk whose bytes are ``head`` (``[a, lo)``),
        ``mid`` (``[lo, hi)``) and ``tail`` (``[hi, b)``), chaining CRC-32 across them."""
        blk, length = self.crc_block, chunk["length"]
        for j in range(a // blk, max(-(-b // blk), a // blk + 1)):
            s, e = j * blk, min((j + 1) * blk, length)
            crc = crc32(head[s - a :]) if s < lo else 0
            crc = crc32(mid[max(s, lo) - lo : max(min(e, hi) - lo, 0)], crc)
            if e > hi:
                crc = crc32(tail[max(s, hi) - hi : e - hi], crc)
            if crc != chunk["crc32"][j]:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {chunk['file']} (bytes {chunk['offset'] + s}..{chunk['offset'] + e}) for key "
                    f"{key!r}: the file is damaged. Restore it from a copy, or load another checkpoint"
                )


def read_index(storage: Storage, manifest: Manifest, fname: str) -> dict[str, Located]:
    """The verified index of data file ``fname`` (its bytes must have the size and
    SHA-256 the manifest committed)."""
    rec = manifest.files[fname]["index"]
    where = f"{storage.url}/{rec['name']}"
    try:
        data = storage.read(rec["name"])
    except (CorruptCheckpointError, OSError) as e:
        raise CorruptCheckpointError(f"the index {where} of {fname} cannot be read ({e}); the checkpoint is damaged") from None
    return parse_index(data, data_file=fname, expect=rec, file_size=manifest.files[fname]["size"],
                       block=manifest.crc_block, where=where, refs=manifest.refs)


def saved_chunks(manifest: Manifest, entry: dict[str, Any], shape: tuple[int, ...]) -> list[tuple[Any, Any, Any]]:
    """``(offsets, sizes, where)`` of every saved chunk of a tensor entry: ``where`` is
    the version 1 chunk dict, or (version 2) the rank whose file holds it."""
    if manifest.version < 2:
        return [(tuple(c["offsets"]), tuple(c["sizes"]), c) for c in entry["chunks"]]
    return layouts.expand(entry, shape)  # type: ignore[return-value]


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
    per_rank: bool = False  # a per-rank value's tree (its chunks are named apart in the data files)
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
                reader.add(key, e, lc.boxes, lc.views, self.per_rank)
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
                value: Any = PerRank(materialise_tree(Tree(sub["containers"], sub["entries"]), key, reader, per_rank=True))
            else:
                value = leaf_value(key, e, reader, self.per_rank)
            path = decode_key(key)
            anc_path = decode_key(anchor)
            self._insert(anchor, path[len(anc_path) :], value)
            r.created.append(key)
            self.touched.add(key)

    def _anchor(self, key: str) -> str | None:
        """The deepest local container above ``key``, unless a local leaf is in the way."""
        path = decode_key(key)
        for n in range(len(path) - 1, -1, -1):
            k = "" if n == 0 else encode_key(path[:n])
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


def materialise_tree(tree: Tree, key: str, reader: Reader, per_rank: bool = False,
                     select: Callable[[str], bool] | None = None) -> Any:
    """Build the value of a whole saved (sub)tree rooted at ``key`` (tensors are
    allocated and scheduled on ``reader``; a per-rank value becomes ``{rank: value}``).
    ``select`` limits it to some keys."""
    if key in tree.entries and (select is None or select(key)):
        return _entry_value(key, tree.entries[key], reader, per_rank)
    root = _Pending(key, tree.containers, hollow_containers(tree, select))
    base = len(decode_key(key))
    for k, e in tree.entries.items():
        if select is None or select(k):
            root.put(decode_key(k)[base:], _entry_value(k, e, reader, per_rank))
    return root.build()


def _entry_value(key: str, e: dict[str, Any], reader: Reader, per_rank: bool) -> Any:
    if e["kind"] == "per_rank" and not per_rank:
        return {int(r): materialise_tree(Tree(s["containers"], s["entries"]), key, reader, per_rank=True)
                for r, s in e["ranks"].items()}
    return leaf_value(key, e, reader, per_rank)


def leaf_value(key: str, e: dict[str, Any], reader: Reader, per_rank: bool = False) -> Any:
    """A new value for one saved leaf (CPU tensor, numpy array or plain value)."""
    if e["kind"] == "value":
        return decode_value(e["value"], where=f"entry {key!r}")
    if e["kind"] != "tensor":
        raise CorruptCheckpointError(f"entry {key!r}: a {e['kind']!r} entry cannot appear here")
    shape = tuple(e["shape"])
    t = _allocate(key, e, shape, reader)
    reader.add(key, e, [Box((0,) * len(shape), shape)], [t], per_rank)
    return t.numpy() if e.get("numpy") else t


#: Tensors at least this large are allocated only after their files are seen to hold their bytes.
_CHECK_BEFORE_ALLOC = 64 << 20


def _allocate(key: str, e: dict[str, Any], shape: tuple[int, ...], reader: Reader) -> torch.Tensor:
    """An empty tensor for a saved leaf. A manifest's shape is only a claim: for a
    large tensor, first check that its files really hold its bytes, so a damaged or
    hostile manifest cannot ask for a petabyte."""
    dtype = dtype_from_name(e["dtype"])
    nbytes = torch.Size(shape).numel() * itemsize_of(e["dtype"])
    if nbytes >= _CHECK_BEFORE_ALLOC:
        m, storage = reader.manifest, reader.storage
        if m.version < 2:
            ends = [(c["file"], c["offset"] + c["length"]) for c in e["chunks"]]
        else:
            ends = []
            for r in sorted({r for _, _, r in saved_chunks(m, e, shape)}):
                f = m.file_of_rank(r)
                if f is None:
                    raise CorruptCheckpointError(f"key {key!r}: the manifest lists no data file of rank {r}; it is damaged")
                ends.append((f, m.files[f]["size"]))
        for fname, end in ends:
            try:
                size = storage.size(fname)
            except (OSError, CorruptCheckpointError) as err:
                raise CorruptCheckpointError(f"key {key!r}: data file {fname} cannot be read ({err})") from None
            if end > size:
                raise CorruptCheckpointError(
                    f"key {key!r}: the manifest places its bytes up to byte {end} of {fname}, "
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
    tl = TreeLoad(node_walk, tree, select, report, rank=rank, per_rank=True)
    tl.check(strict)
    tl.plan(reader, lambda k: False, create)
    return [tl]
