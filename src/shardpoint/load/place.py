"""Place, create, report: check the local state's keys against the checkpoint,
collect the tensors to read (:class:`Collect`), create what no rank holds, then
(after the reads) put every value in place, call ``load_state_dict`` and fill the
report.

Created values are the keys a lazily built state lacks (an optimizer's state
before its first step) and whole saved (sub)trees (``load_full``, a per-rank value
no rank has): containers take the types they were saved with, empty ones
included; a created tensor is allocated here (:class:`Fresh`), read by the read
stage like any target, and the values built (:func:`build`) once it is."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ..errors import AllocationError, CorruptCheckpointError, KeyMismatchError
from ..format.chunks import TensorSpec
from ..format.manifest import Manifest, Tree
from ..format.model import PerRankEntry, TensorEntry, ValueEntry, kind_of
from ..layout.local import Describe, whole_box
from ..report import LoadReport
from ..tree import Node, PerRank, Selection, Walk, decode_key, join
from .locate import Locator
from .read import Target


@dataclass(slots=True)
class Collect:
    """What a load will read: its targets, with the manifest and locator that
    describe and check them."""

    manifest: Manifest
    locator: Locator
    targets: list[Target] = field(default_factory=list)

    def create(self, spec: TensorSpec, per_rank: bool) -> Fresh:
        """Create ``spec``'s tensor whole (allocated here, once its files are seen to
        hold its bytes where it is large) and read it."""
        fresh = Fresh(spec, _allocate(spec, self.locator))
        self.targets.append(Target(spec, [whole_box(spec.shape)], [fresh.tensor], per_rank,
                                   True))  # a CPU tensor of the saved dtype
        return fresh


@dataclass(frozen=True, slots=True)
class Fresh:
    """A tensor the load creates (no local object holds the key), filled by the reads."""

    spec: TensorSpec
    tensor: torch.Tensor


#: Tensors at least this large are allocated only after their files are seen to hold their bytes.
_CHECK_BEFORE_ALLOC = 64 << 20


def _allocate(spec: TensorSpec, locator: Locator) -> torch.Tensor:
    """An empty CPU tensor for a created key; a large one only once its files are
    seen to hold its bytes (a manifest's shape is only a claim: a damaged or hostile
    one must not make a load ask for a petabyte)."""
    nbytes = spec.nbytes
    if nbytes >= _CHECK_BEFORE_ALLOC:
        locator.check_holds(spec)
    try:
        return torch.empty(spec.shape, dtype=spec.dtype)
    except (RuntimeError, MemoryError) as err:
        raise AllocationError(
            f"key {spec.key!r}: cannot allocate a {spec.dtype_name} tensor of shape {list(spec.shape)} ({nbytes} bytes) to "
            f"load it into ({err}); load fewer keys at once (keys=[...]) or on a machine with more memory"
        ) from None


@dataclass(frozen=True, slots=True)
class KeyCheck:
    """What the key check of one tree found (nothing is recorded in the report yet)."""

    skipped: list[str]
    """Keys left out by ``only``/``exclude``: local ones, and the checkpoint's that no local leaf holds."""
    missing: list[str]
    """Local keys the checkpoint lacks."""
    values: list[str] = field(default_factory=list)
    """Local plain values the checkpoint holds (to assign; the tensors to read are
    :attr:`TreeLoad.targets`)."""

    def record(self, report: LoadReport) -> None:
        report.skipped += self.skipped
        report.missing += self.missing


@dataclass(slots=True)
class TreeLoad:
    """Loading one tree (the top level, or one rank's per-rank value) into one walk."""

    walk: Walk
    tree: Tree
    select: Selection
    report: LoadReport
    values: dict[str, object] = field(default_factory=dict)  # key -> decoded value to assign
    pending: dict[str, list[tuple[str | int, object]]] = field(default_factory=dict)  # container key -> [(seg, value)]
    touched: set[str] = field(default_factory=set)  # keys created, and loaded where the walk met a Stateful object (fill)
    rank: int = 0
    per_rank: bool = False  # a per-rank value's tree (its chunks are named apart in the data files)
    targets: list[Target] = field(default_factory=list)  # this rank's tensors the checkpoint holds: what it reads
    cast: list[str] = field(default_factory=list)  # the keys of those whose dtype is not the saved one
    shape: Shape | None = None  # the saved containers, for what is created; made on first use

    def check(self, strict: bool) -> KeyCheck:
        """Keys and shapes, before anything is modified; returns what it found left
        out or missing (recorded in the report by the caller). The local tensors the
        checkpoint holds become :attr:`targets` (what :meth:`plan_local` reads)."""
        tensors, entries, select, per_rank = self.tree.tensors, self.tree.entries, self.select, self.per_rank
        skipped: list[str] = []
        missing: list[str] = []
        found_values: list[str] = []
        self.targets, self.cast = [], []
        add, cast = self.targets.append, self.cast
        everything = select.everything
        describe = Describe(detach=False).__call__  # reads detach where they must (a bound method: called faster)
        for key, node in self.walk.leaves.items():
            if not everything and not select(key):
                skipped.append(key)
                continue
            e = entries.get(key)
            if e is None:
                missing.append(key)
                continue
            if node.kind == "tensor":
                if type(e) is not TensorEntry:
                    raise KeyMismatchError(f"key {key!r} is a tensor in the local state but a {kind_of(e)} in the checkpoint")
                lc = describe(key, node.obj)
                spec = tensors[key]
                if lc.shape != spec.shape:
                    raise KeyMismatchError(
                        f"key {key!r}: the checkpoint holds shape {spec.shape}, the local tensor has global shape "
                        f"{tuple(lc.shape)}; load into a tensor of the saved shape (or leave the key out with exclude=)"
                    )
                views = lc.views  # most tensors have one view: no generator for it (a load checks every tensor)
                # a view on the CPU (most are) is not on the meta device: only the others are asked
                cpu = views[0].is_cpu if len(views) == 1 else all(v.is_cpu for v in views)
                if not cpu and any(v.is_meta for v in views):
                    raise KeyMismatchError(
                        f"key {key!r} is on the meta device, so there is no memory to load into; materialise it "
                        "first (module.to_empty(device=...)) and then load"
                    )
                same = lc.dtype is spec.torch_dtype  # torch's dtypes are one object each
                if not same:
                    cast.append(key)
                add(Target(spec, lc.boxes, views, per_rank, cpu and same))
            elif type(e) is not ValueEntry:
                raise KeyMismatchError(f"key {key!r} is a plain value in the local state but a {kind_of(e)} in the checkpoint")
            else:
                found_values.append(key)
        for key in self.walk.per_rank:
            if not select.everything and not select(key):
                skipped.append(key)
                continue
            e = entries.get(key)
            if e is None:
                missing.append(key)
            elif type(e) is not PerRankEntry:
                raise KeyMismatchError(
                    f"key {key!r} is a PerRank value in the local state but a {kind_of(e)} in the checkpoint; "
                    "wrap it (or not) in shardpoint.PerRank the way it was saved, or leave it out with exclude="
                )
        if not select.everything:
            skipped += [key for key in entries if not select(key) and key not in self.walk.leaves]
        if strict and missing:
            raise KeyMismatchError(
                f"{len(missing)} key(s) of the local state are not in the checkpoint: {sorted(missing)[:20]}; "
                "pass strict=False to leave them as they are, or exclude=[...] to skip them"
            )
        return KeyCheck(skipped, missing, found_values)

    def plan(self, reads: Collect, found: KeyCheck, held: Callable[[str], bool], create: bool) -> None:
        """Collect the reads of local tensors; decide what to create."""
        self.plan_local(reads, found)
        self.plan_created(reads, held, create)

    def plan_local(self, reads: Collect, found: KeyCheck) -> None:
        """Collect the reads of the local tensors the key check ``found`` to load (its
        :attr:`targets`) and the values to assign (changes nothing in the state)."""
        r, values = self.report, self.tree.values
        reads.targets += self.targets
        r.cast += self.cast
        self.values.update((key, values.get(key)) for key in found.values)
        loaded = [t.spec.key for t in self.targets]
        r.loaded += loaded
        r.loaded += found.values
        if self.walk.stateful:  # only a Stateful object's fill asks what was touched below it
            self.touched.update(loaded, found.values)

    def plan_created(self, reads: Collect, held: Callable[[str], bool], create: bool) -> None:
        """Decide what to create: the checkpoint's keys that no rank holds (``held``)
        and that lie below a local container."""
        r = self.report
        entries = self.tree.entries
        leaves = self.walk.leaves
        # in C, and no set made when the state holds every key (most loads)
        absent = () if entries.keys() <= leaves.keys() else entries.keys() - leaves.keys() - self.walk.per_rank.keys()
        for key, e in entries.items() if absent else ():
            if key not in absent or not self.select(key) or held(key):
                continue
            anchor = self._anchor(key)
            if not create or anchor is None:
                r.unexpected.append(key)
                continue
            if type(e) is PerRankEntry:
                sub = self.tree.per_rank[key].get(self.rank)
                r.per_rank[key] = "restored" if sub is not None else "kept"
                if sub is None:
                    continue
                value: object = _Wrap(_built_per_rank, materialise_tree(sub, key, reads, per_rank=True))
            else:
                value = leaf_value(key, self.tree, reads, self.per_rank)
            self._insert(anchor, key, value)
            r.created.append(key)
            self.touched.add(key)

    def _anchor(self, key: str) -> str | None:
        """The deepest local container above ``key``, unless a local leaf is in the way.
        (An encoded key's parents are its prefixes up to a ``/``: no segment holds one.)"""
        if key == "":
            return None
        i = len(key)
        while i > 0:
            i = max(key.rfind("/", 0, i), 0)
            k = key[:i]
            if k in self.walk.leaves or k in self.walk.per_rank:
                return None
            if k in self.walk.containers:
                return k
        return None

    def _insert(self, anchor: str, key: str, value: object) -> None:
        """Record ``value`` to be placed at ``key``, below the local container
        ``anchor``, creating containers of the saved types on the way."""
        if self.shape is None:
            self.shape = Shape(self.tree, self.select, extra=self.walk.containers)
        base, path = self.shape.path[anchor], self.shape.path[key]
        rel = path[len(base):]
        head = rel[0]
        lst = self.pending.setdefault(anchor, [])
        if len(rel) == 1:
            lst.append((head, value))
            return
        for seg, sub in lst:
            if seg == head and isinstance(sub, Pending):
                sub.put(rel[1:], value)
                return
        p = Pending(base + rel[:1], self.shape)
        p.put(rel[1:], value)
        lst.append((head, p))

    def fill(self, node: Node, key: str, dirty: set[str] | None = None) -> object:
        """Place values and created keys, call load_state_dict; returns the node's new
        value. ``dirty``: the containers below which something changes
        (:meth:`_dirty`); the others, and tensors (read in place), are left as they are."""
        if dirty is None:
            dirty = self._dirty()
        k = node.kind
        if k in _CONTAINERS:
            obj = node.obj
            items: list[object] = []  # a tuple's new items (a dict or list is changed in place)
            tup = k == "tuple"
            values = self.values
            for seg, child in node.children.items():
                ck = child.kind
                if ck == "tensor" or (ck in _CONTAINERS and child.key not in dirty):
                    if tup:
                        items.append(child.obj)  # nothing below it changes
                    continue
                # a plain value (a param group's), without a call: its loaded value or its own
                v = values.get(child.key, child.obj) if ck == "value" else self.fill(child, child.key, dirty)
                if tup:
                    items.append(v)
                elif obj[seg] is not v:
                    obj[seg] = v
            n = len(node.children)  # a list's or tuple's items so far
            for seg, v in sorted(self.pending.get(key, ()), key=lambda sv: (isinstance(sv[0], str), sv[0])):
                v = build(v)
                if k == "dict":
                    obj[seg] = v
                elif seg == n:
                    n += 1
                    if tup:
                        items.append(v)
                    else:
                        obj.append(v)
                else:
                    self.report.created.remove(join(key, seg)) if join(key, seg) in self.report.created else None
                    self.report.unexpected.append(join(key, seg))
            return tuple(items) if tup else obj
        if k == "stateful":
            assert node.inner is not None
            sd = self.fill(node.inner, key, dirty)
            if any(t == key or t.startswith(key + "/") or key == "" for t in self.touched):
                node.obj.load_state_dict(sd)
            return node.obj
        if k == "per_rank":
            return node.obj  # filled by its own TreeLoad
        if k == "tensor":
            return node.obj
        return self.values.get(key, node.obj)

    def _dirty(self) -> set[str]:
        """The keys of the containers a :meth:`fill` must visit: those above a value to
        assign, a created key or a Stateful object (tensors load in place)."""
        out = {""}
        for k in [*self.values, *self.pending, *(k for k, _obj in self.walk.stateful)]:
            while k not in out:  # a key in ``out`` has its parents there already
                out.add(k)
                k = k[: max(k.rfind("/"), 0)]
        return out


_CONTAINERS = ("dict", "list", "tuple")


def load_per_rank(key: str, node_walk: Walk, saved: dict[int, Tree], rank: int,
                  select: Selection, reads: Collect, report: LoadReport, strict: bool, create: bool) -> list[TreeLoad]:
    """Collect the load of one per-rank value (``saved``: its sub-tree of each saving rank) on this rank."""
    tree = saved.get(rank)
    if tree is None:
        report.per_rank[key] = "kept"
        return []
    report.per_rank[key] = "restored"
    tl = TreeLoad(node_walk, tree, select, report, rank=rank, per_rank=True)
    found = tl.check(strict)
    found.record(report)
    tl.plan(reads, found, lambda k: False, create)
    return [tl]


def fill_all(top: TreeLoad, per_rank: list[TreeLoad]) -> None:
    """Place every value: the per-rank values first (a parent's ``load_state_dict``
    sees them filled), then the top-level tree."""
    for tl in per_rank:
        key = next(k for k, sub in top.walk.per_rank.items() if sub is tl.walk)
        _set_per_rank_value(top.walk.root, tl.walk, tl.fill(tl.walk.root, key))
    top.fill(top.walk.root, "")


def _set_per_rank_value(node: Node, sub: Walk, value: object) -> bool:
    """Put ``value`` into the PerRank object whose walk is ``sub`` (reachable from the
    parent walk's per-rank node)."""
    if node.kind == "per_rank" and node.inner is sub.root:
        node.obj.value = value
        return True
    for child in node.children.values():
        if _set_per_rank_value(child, sub, value):
            return True
    return node.inner is not None and node.kind == "stateful" and _set_per_rank_value(node.inner, sub, value)


Path = tuple[str | int, ...]


class Shape:
    """The saved containers of one tree by decoded path: the types and the empty
    containers that building created values needs. Every key is decoded once, here."""

    def __init__(self, tree: Tree, select: Callable[[str], bool] | None, extra: Iterable[str] = ()) -> None:
        keys = [*tree.containers, *tree.entries, *extra]
        self.path: dict[str, Path] = dict(zip(keys, map(decode_key, keys)))
        self.types: dict[Path, str] = {self.path[c]: t for c, t in tree.containers.items()}
        filled: set[Path] = {()}
        for k in tree.entries:
            p = self.path[k]
            filled.update(p[:n] for n in range(len(p) + 1))
        #: The saved containers with no entry beneath them (``{}``, ``[]``, ``[{}]``) by their parent's
        #: path: building a container brings these back, or an optimizer saved before its first step
        #: loses its empty ``state`` dict.
        self.hollow: dict[Path, list[Path]] = {}
        for c in tree.containers:
            p = self.path[c]
            if p not in filled and (select is None or select(c)):
                self.hollow.setdefault(p[:-1], []).append(p)


class Pending:
    """A container created on load, built (:meth:`build`) once its values are read."""

    def __init__(self, path: Path, shape: Shape) -> None:
        self.path, self.shape = path, shape
        self.items: dict[str | int, object] = {}

    def put(self, rel: Path, value: object) -> None:
        """Put ``value`` at ``rel`` below this container, creating containers on the way."""
        if len(rel) == 1:
            self.items[rel[0]] = value
            return
        sub = self.items.get(rel[0])
        if not isinstance(sub, Pending):
            sub = self.items[rel[0]] = Pending(self.path + rel[:1], self.shape)
        sub.put(rel[1:], value)

    def build(self) -> object:
        kind = self.shape.types.get(self.path, "dict")
        for p in self.shape.hollow.get(self.path, ()):
            if p[-1] not in self.items:
                self.items[p[-1]] = Pending(p, self.shape)
        vals = {k: build(v) for k, v in self.items.items()}
        if kind in ("list", "tuple"):
            seq = [vals[i] for i in sorted(k for k in vals if isinstance(k, int))]
            return seq if kind == "list" else tuple(seq)
        return vals


def materialise_tree(tree: Tree, key: str, reads: Collect, per_rank: bool = False,
                     select: Callable[[str], bool] | None = None) -> object:
    """The value of a whole saved (sub)tree rooted at ``key``, to :func:`build` once
    its tensors (collected in ``reads``) are read. A per-rank value becomes
    ``{rank: value}``; ``per_rank``: the tree is one rank's value (its chunks are
    named apart). ``select`` limits it to some keys."""
    if key in tree.entries and (select is None or select(key)):
        return _entry_value(key, tree, reads, per_rank)
    shape = Shape(tree, select, extra=(key,))
    base = shape.path[key]
    value = Pending(base, shape)
    for k in tree.entries:
        if select is None or select(k):
            value.put(shape.path[k][len(base):], _entry_value(k, tree, reads, per_rank))
    return value


def build(value: object) -> object:
    """``value`` with everything created in it built (after the reads)."""
    if isinstance(value, Fresh):
        return value.tensor.numpy() if value.spec.numpy else value.tensor
    return value.build() if isinstance(value, (Pending, _Wrap)) else value


_V = TypeVar("_V")


class _Wrap(Generic[_V]):
    """A created value that ``make`` builds and wraps (a :class:`PerRank`, the ``{rank: value}`` of ``load_full``)."""

    def __init__(self, make: Callable[[_V], object], value: _V) -> None:
        self.make, self.value = make, value

    def build(self) -> object:
        return self.make(self.value)


def _built_per_rank(value: object) -> PerRank:
    return PerRank(build(value))


def _entry_value(key: str, tree: Tree, reads: Collect, per_rank: bool) -> object:
    if key in tree.per_rank and not per_rank:
        ranks = {r: materialise_tree(sub, key, reads, per_rank=True) for r, sub in tree.per_rank[key].items()}
        return _Wrap(lambda d: {r: build(v) for r, v in d.items()}, ranks)
    return leaf_value(key, tree, reads, per_rank)


def leaf_value(key: str, tree: Tree, reads: Collect, per_rank: bool = False) -> object:
    """A new value for the saved leaf ``key`` of ``tree`` (a plain value, or a tensor
    or numpy array to :func:`build` once read)."""
    if key in tree.values:
        return tree.values[key]
    spec = tree.tensors.get(key)
    if spec is None:
        raise CorruptCheckpointError(f"entry {key!r}: a per-rank entry cannot appear inside a per-rank value")
    return reads.create(spec, per_rank)
