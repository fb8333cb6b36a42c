"""Place: walk the local state against the checkpoint's keys, collect the tensors
to read (:class:`~shardpoint.load.read.Target`), create what no rank holds, then
put every value in place, call ``load_state_dict`` and fill the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpointError, KeyMismatchError, ShardpointError
from ..format.boxes import Box
from ..format.chunks import TensorSpec
from ..format.manifest import Manifest, Tree
from ..layout import chunks_of
from ..layout.local import LocalChunks
from ..report import LoadReport
from ..tree import Node, PerRank, Walk, decode_key, encode_key, join, matches_prefix
from .locate import Locator
from .read import Target


@dataclass(slots=True)
class Collect:
    """What a load will read: its targets, with the manifest and locator that
    describe and check them."""

    manifest: Manifest
    locator: Locator
    targets: list[Target] = field(default_factory=list)

    def add(self, spec: TensorSpec, boxes: list[Box], views: list[torch.Tensor], per_rank: bool) -> None:
        self.targets.append(Target(spec, boxes, views, per_rank))


class _Selector:
    def __init__(self, only: list[str] | str | None, exclude: list[str] | str | None) -> None:
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
    local: dict[str, LocalChunks] = field(default_factory=dict)  # key -> what this rank holds of the tensor
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
                lc = self.local[key] = chunks_of(key, node.obj)
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

    def plan(self, reads: Collect, held: Callable[[str], bool], create: bool) -> None:
        """Collect the reads of local tensors; decide what to create."""
        r = self.report
        skip = set(r.skipped) | set(r.missing)
        for key, node in self.walk.leaves.items():
            if key in skip:
                continue
            e = self.tree.entries[key]
            self.touched.add(key)
            r.loaded.append(key)
            if node.kind == "tensor":
                spec = self.tree.tensors[key]
                lc = self.local[key]
                if lc.dtype != spec.dtype:
                    r.cast.append(key)
                reads.add(spec, lc.boxes, lc.views, self.per_rank)
            else:
                self.values[key] = self.tree.values.get(key)
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
                sub = self.tree.per_rank[key].get(self.rank)
                r.per_rank[key] = "restored" if sub is not None else "kept"
                if sub is None:
                    continue
                value: Any = PerRank(materialise_tree(sub, key, reads, per_rank=True))
            else:
                value = leaf_value(key, self.tree, reads, self.per_rank)
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
        self.key, self.types = key, types
        self.items: dict[Any, Any] = {}
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


def materialise_tree(tree: Tree, key: str, reads: Collect, per_rank: bool = False,
                     select: Callable[[str], bool] | None = None) -> Any:
    """Build the value of a whole saved (sub)tree rooted at ``key`` (tensors are
    allocated and collected in ``reads``; a per-rank value becomes ``{rank: value}``).
    ``select`` limits it to some keys."""
    if key in tree.entries and (select is None or select(key)):
        return _entry_value(key, tree, reads, per_rank)
    root = _Pending(key, tree.containers, hollow_containers(tree, select))
    base = len(decode_key(key))
    for k in tree.entries:
        if select is None or select(k):
            root.put(decode_key(k)[base:], _entry_value(k, tree, reads, per_rank))
    return root.build()


def _entry_value(key: str, tree: Tree, reads: Collect, per_rank: bool) -> Any:
    if key in tree.per_rank and not per_rank:
        return {r: materialise_tree(sub, key, reads, per_rank=True) for r, sub in tree.per_rank[key].items()}
    return leaf_value(key, tree, reads, per_rank)


def leaf_value(key: str, tree: Tree, reads: Collect, per_rank: bool = False) -> Any:
    """A new value for the saved leaf ``key`` of ``tree`` (CPU tensor, numpy array or plain value)."""
    if key in tree.values:
        return tree.values[key]
    spec = tree.tensors.get(key)
    if spec is None:
        raise CorruptCheckpointError(f"entry {key!r}: a per-rank entry cannot appear inside a per-rank value")
    t = _allocate(spec, reads.locator)
    reads.add(spec, [Box((0,) * len(spec.shape), spec.shape)], [t], per_rank)
    return t.numpy() if spec.numpy else t


#: Tensors at least this large are allocated only after their files are seen to hold their bytes.
_CHECK_BEFORE_ALLOC = 64 << 20


def _allocate(spec: TensorSpec, locator: Locator) -> torch.Tensor:
    """An empty tensor for a saved leaf. A manifest's shape is only a claim: for a
    large tensor, first check that its files really hold its bytes, so a damaged or
    hostile manifest cannot ask for a petabyte."""
    nbytes = torch.Size(spec.shape).numel() * spec.itemsize
    if nbytes >= _CHECK_BEFORE_ALLOC:
        locator.check_holds(spec)
    try:
        return torch.empty(spec.shape, dtype=spec.dtype)
    except (RuntimeError, MemoryError) as err:
        raise ShardpointError(
            f"key {spec.key!r}: cannot allocate a {spec.dtype_name} tensor of shape {list(spec.shape)} ({nbytes} bytes) to "
            f"load it into ({err}); load fewer keys at once (keys=[...]) or on a machine with more memory"
        ) from None


def load_per_rank(key: str, node_walk: Walk, saved: dict[int, Tree], rank: int,
                  select: _Selector, reads: Collect, report: LoadReport, strict: bool, create: bool) -> list[TreeLoad]:
    """Collect the load of one per-rank value (``saved``: its sub-tree of each saving rank) on this rank."""
    tree = saved.get(rank)
    if tree is None:
        report.per_rank[key] = "kept"
        return []
    report.per_rank[key] = "restored"
    tl = TreeLoad(node_walk, tree, select, report, rank=rank, per_rank=True)
    tl.check(strict)
    tl.plan(reads, lambda k: False, create)
    return [tl]


def fill_all(top: TreeLoad, per_rank: list[TreeLoad]) -> None:
    """Place every value: the per-rank values first (a parent's ``load_state_dict``
    sees them filled), then the top-level tree."""
    for tl in per_rank:
        key = next(k for k, sub in top.walk.per_rank.items() if sub is tl.walk)
        _set_per_rank_value(top.walk.root, tl.walk, tl.fill(tl.walk.root, key))
    top.fill(top.walk.root, "")


def _set_per_rank_value(node: Node, sub: Walk, value: Any) -> bool:
    """Put ``value`` into the PerRank object whose walk is ``sub`` (reachable from the
    parent walk's per-rank node)."""
    if node.kind == "per_rank" and node.inner is sub.root:
        node.obj.value = value
        return True
    for child in node.children.values():
        if _set_per_rank_value(child, sub, value):
            return True
    return node.inner is not None and node.kind == "stateful" and _set_per_rank_value(node.inner, sub, value)
