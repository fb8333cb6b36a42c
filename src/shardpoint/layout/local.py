"""Local chunks of plain tensors, DTensors, flat partitions and numpy arrays."""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, cast

import msgspec
import numpy as np
import torch

from ..errors import UsageError
from ..plan.boxes import Box, flat_range_boxes
from ..runtime import PROCESS
from .flat import FlatShard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


class LocalChunks(msgspec.Struct, gc=False):
    """What this rank holds of one tensor.

    ``views[i]`` is a tensor of shape ``boxes[i].sizes`` that aliases the user's
    storage (so copying into it loads in place). A :class:`msgspec.Struct` (made in
    C): a save and a load make one per tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    boxes: list[Box]
    views: list[torch.Tensor]
    numpy: bool = False


#: What :func:`chunks_of` worked out of DTensors met before in one walk: by
#: ``(id(mesh), global shape, placements)`` (a ``Shard`` as its dim, a ``Replicate`` as
#: None), the mesh (kept, so its id stays its own), the global shape and this rank's box.
Seen = dict[object, tuple[object, tuple[int, ...], Box]]


def chunks_of(key: str, leaf: object, seen: Seen | None = None, *, detach: bool = True) -> LocalChunks:
    """Describe a tensor leaf. Raises ``ValueError`` naming ``key`` for layouts that
    are not boxes (``Partial``, strided shards). ``seen``: the boxes of DTensor
    layouts met before in this walk (a model's DTensors share a few: FSDP2's
    parameters of one shape and their optimizer states share one). ``detach``: the
    views of a tensor that requires grad are detached aliases (False: the tensor
    itself, for a caller that detaches only where it must; a load writes most
    tensors' memory directly)."""
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(leaf, dtensor):  # first: a model of DTensors has nothing else
        return _dtensor_chunks(key, cast("DTensor", leaf), seen, detach)
    if isinstance(leaf, FlatShard):
        stop = leaf.start + leaf.local.numel()
        boxes = flat_range_boxes(leaf.shape, leaf.start, stop)
        views, pos = [], 0
        for b in boxes:
            views.append(leaf.local[pos : pos + b.numel].view(b.sizes))
            pos += b.numel
        return LocalChunks(leaf.shape, leaf.local.dtype, boxes, views)
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.hasobject or leaf.dtype.kind in "USVMm":
            raise UsageError(f"key {key!r}: numpy arrays of dtype {leaf.dtype} cannot be saved; use a numeric dtype")
        t = torch.from_numpy(leaf) if all(s >= 0 for s in leaf.strides) else torch.from_numpy(leaf.copy())
        shape = tuple(t.shape)
        return LocalChunks(shape, t.dtype, [whole_box(shape)], [t], numpy=True)
    assert isinstance(leaf, torch.Tensor)
    t = leaf.detach() if detach and leaf.requires_grad else leaf
    shape = tuple(t.shape)
    return LocalChunks(shape, t.dtype, [whole_box(shape)], [t])


#: Most shapes :func:`whole_box` remembers.
WHOLE_MAX = 1 << 12


def whole_box(shape: tuple[int, ...]) -> Box:
    """The box of the whole of a tensor of ``shape``, made once per shape and kept in
    :attr:`~shardpoint.runtime.Process.whole_boxes` (a save and a load describe every
    tensor, a state's plain tensors have a few shapes, and a :class:`Box`'s
    constructor runs in Python)."""
    memo = PROCESS.whole_boxes
    box = memo.get(shape)
    if isinstance(box, Box):
        return box
    if len(memo) >= WHOLE_MAX:
        memo.clear()
    made = memo[shape] = Box((0,) * len(shape), shape)
    return made


class Describe:
    """:func:`chunks_of` over the leaves of one walk: DTensor's class looked up once,
    and the boxes of the DTensor layouts met kept, by their spec (FSDP2's parameters of
    one shape and their optimizer moments share a few spec objects) and by mesh,
    shape and placements (``seen``: ``DTensor.from_local`` gives each tensor a spec of
    its own), so a DTensor of a layout met before is described with no further call.
    ``detach``: as :func:`chunks_of`'s."""

    __slots__ = ("_by_spec", "_dtensor", "_replicate", "_shard", "detach", "seen")

    def __init__(self, *, detach: bool = True) -> None:
        self.seen: Seen = {}
        self.detach = detach
        self._by_spec: dict[int, tuple[object, tuple[int, ...], Box]] = {}  # id(spec) -> spec (kept), shape, box
        self._dtensor = _dtensor_class()
        self._shard: type | None = None
        self._replicate: type | None = None
        if self._dtensor is not None:
            self._shard, self._replicate = _box_placements()

    def __call__(self, key: str, leaf: object) -> LocalChunks:
        if type(leaf) is self._dtensor:  # DTensor itself (a subclass goes the general way)
            dt: Any = leaf  # Any: the slots of this torch's DTensor
            try:  # DTensor's own slots, read as attributes (faster than getattr with a default)
                spec, local = dt._spec, dt._local_tensor
            except AttributeError:  # not set, or another torch's DTensor: the general way
                return chunks_of(key, leaf, self.seen, detach=self.detach)
            got = self._by_spec.get(id(spec))
            if got is None or got[0] is not spec:
                got = self._layout(spec)
            if got is not None and type(local) is torch.Tensor:
                box = got[2]
                if local.shape == box.sizes:
                    if self.detach and local.requires_grad:
                        local = local.detach()
                    return LocalChunks(got[1], local.dtype, [box], [local])
        elif type(leaf) is torch.Tensor and not (self.detach and leaf.requires_grad):  # a plain tensor (a step count)
            shape = tuple(leaf.shape)
            return LocalChunks(shape, leaf.dtype, [whole_box(shape)], [leaf])
        return chunks_of(key, leaf, self.seen, detach=self.detach)

    def _layout(self, spec: Any) -> tuple[object, tuple[int, ...], Box] | None:
        """The global shape and this rank's box of a DTensor of ``spec`` on a 1-D mesh,
        when ``seen`` has its layout (None: :func:`chunks_of` works it out, and keeps
        it in ``seen``)."""
        placements: tuple[Any, ...] = getattr(spec, "placements", ())
        meta = getattr(spec, "tensor_meta", None)
        if len(placements) != 1 or meta is None:
            return None
        p = placements[0]
        kind = type(p)
        dim = p.dim if kind is self._shard else None
        if dim is None and kind is not self._replicate:
            return None
        mesh = spec.mesh
        found = self.seen.get((id(mesh), meta.shape, (dim,)))  # the key _layout_box files a box under
        if found is None or found[0] is not mesh:
            return None
        got = self._by_spec[id(spec)] = (spec, found[1], found[2])
        return got


def _dtensor_class() -> type | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported (no
    DTensor can exist then, and importing it costs): looked up at run time, the
    ``isinstance`` check with it is what makes a tensor a DTensor."""
    mod = sys.modules.get("torch.distributed.tensor")
    found = getattr(mod, "DTensor", None) if mod is not None else None
    return found if isinstance(found, type) else None


def _local_box(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's box of a DTensor of ``shape``. Cached on everything it depends
    on, this rank's mesh coordinate included: a model has few distinct (shape,
    mesh, placements), and DTensor's own function costs ~0.1 ms a call."""
    coord = mesh.get_coordinate()
    return _local_box_cached(shape, mesh, placements, None if coord is None else tuple(coord))


@functools.lru_cache(maxsize=4096)
def _local_box_cached(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...], coord: tuple[int, ...] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(s) for s in local_shape), tuple(int(o) for o in offset)


@functools.cache
def _box_placements() -> tuple[type, ...]:
    from torch.distributed.tensor import Replicate, Shard

    return Shard, Replicate


def _dtensor_chunks(key: str, dt: DTensor, seen: Seen | None, detach: bool = True) -> LocalChunks:
    got = _layout_box(key, dt, seen) if seen is not None else None
    if got is None:
        got = (None, *_dtensor_box(key, dt))
    _mesh, shape, box = got
    # DTensor's own attribute: to_local() is an autograd call (~10 us a tensor) for the same storage
    inner = getattr(dt, "_local_tensor", None)
    local = inner if isinstance(inner, torch.Tensor) else dt.to_local()
    if detach and local.requires_grad:  # the same storage either way: a plain alias is enough to copy into
        local = local.detach()
    if local.shape != box.sizes:  # a torch.Size is a tuple
        raise UsageError(
            f"key {key!r}: the DTensor's local shard has shape {tuple(local.shape)} but its placements "
            f"{tuple(dt.placements)} give {box.sizes}; the layout is not one box and cannot be saved"
        )
    return LocalChunks(shape, local.dtype, [box], [local])


def _layout_box(key: str, dt: DTensor, seen: Seen) -> tuple[object, tuple[int, ...], Box] | None:
    """A DTensor's global shape and this rank's box, found in ``seen`` by its mesh,
    global shape and placements, or worked out and kept there: a model's DTensors
    share a few (and ``DTensor.from_local`` gives each tensor a spec of its own, so a
    cache by spec would miss every time; DTensor's mesh arithmetic costs ~9 us a
    tensor). The key is exact: a ``Shard`` is its dim, a ``Replicate`` nothing; a
    tensor with any other placement (which :func:`_dtensor_box` refuses) is not
    keyed, nor one whose spec lacks these attributes: None, the caller works it out."""
    try:
        spec = dt._spec
        mesh, placements, shape = spec.mesh, spec.placements, spec.tensor_meta.shape  # type: ignore[union-attr]
    except AttributeError:  # a spec without its tensor's metadata, or of another torch version
        return None
    shard, replicate = _box_placements()
    kinds: list[int | None] = []
    for p in placements:
        kind = type(p)
        if kind is shard:
            kinds.append(p.dim)  # type: ignore[attr-defined]
        elif kind is replicate:
            kinds.append(None)
        else:
            return None
    ident = (id(mesh), shape, tuple(kinds))
    got = seen.get(ident)
    if got is not None and got[0] is mesh:  # the mesh kept in the value: its id is its own
        return got
    got = (mesh, *_dtensor_box(key, dt))
    seen[ident] = got
    return got


def _dtensor_box(key: str, dt: DTensor) -> tuple[tuple[int, ...], Box]:
    """A DTensor's global shape and this rank's box of it."""
    placements = tuple(dt.placements)
    for p in placements:
        if type(p) not in _box_placements():
            raise UsageError(
                f"key {key!r}: DTensor placement {p} is not supported; only Shard(d) and Replicate keep each "
                "rank's piece one box. Call .redistribute() to Shard/Replicate (or .full_tensor()) before saving"
            )
    shape = tuple(dt.shape)
    local_shape, offset = _local_box(shape, dt.device_mesh, placements)
    return shape, Box(offset, local_shape)
