"""PyTorch Distributed Checkpoint (DCP) directories in and out.

A DCP directory (``torch.distributed.checkpoint.save`` with its file system writer:
torchtitan, Lightning's FSDP / ModelParallel strategies, Accelerate's FSDP path) is
a pickled ``.metadata`` file and data files ``__<rank>_<i>.distcp``. The metadata
maps every flattened key to its global shape and the boxes (offsets, sizes) saved
of it, and every box to a byte range of a data file; each range is one
``torch.save`` blob (a tensor) or pickled bytes (a plain value).

Import (:func:`import_dcp`) reads ``.metadata`` with an allowlist unpickler that
admits DCP's metadata classes by name and refuses anything else *before* it is
imported or called, and reads the blobs with ``torch.load(weights_only=True)``.
Each DCP rank becomes the shardpoint rank of the same number, holding the boxes it
wrote (a row block of an FSDP2 shard is a :class:`~shardpoint.layout.FlatShard`),
so one old rank's data is in memory at a time and the checkpoint says it was saved
on the same number of ranks.

Export (:func:`export_dcp`) drives DCP's own writer from one process
(``dcp.save(..., no_dist=True)``) over a state whose tensors are placeholders on the
meta device; its planner reads each tensor from the shardpoint checkpoint only when
the writer asks for it, so one group of tensors is in memory at a time.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, cast

import torch

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ShardpointError,
    UnsupportedCheckpointError,
)
from ..layout import FlatShard
from ..tree import decode_key, encode_key
from ._progress import Progress

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        STATE_DICT_TYPE,
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import WriteItem

    from ..api import PathLike, TensorInfo

__all__ = ["import_dcp", "export_dcp", "read_metadata", "SAFE_CLASSES"]

METADATA = ".metadata"

#: Everything a DCP ``.metadata`` pickle may name (torch 2.5 - 2.13). The unpickler
#: imports nothing else; dtypes are looked up among torch's dtypes.
SAFE_CLASSES = frozenset({
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.serialization._get_layout",
    "torch.Size",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath",
    "collections.OrderedDict",
})


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> object:
        full = f"{module}.{name}"
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if full not in SAFE_CLASSES:
            raise UnsupportedCheckpointError(
                f"{self.where}: refusing to unpickle {full}: it is not one of the classes DCP puts in its "
                "metadata, and unpickling an unknown class can run arbitrary code. The file is not a DCP "
                "checkpoint's .metadata, or it was tampered with; do not load it with torch.distributed.checkpoint "
                "either unless you trust where it came from"
            )
        return super().find_class(module, name)


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the DCP directory at
    ``path``, unpickled with DCP's classes only (anything else raises
    :class:`~shardpoint.ShardpointError` naming the class, before it is imported)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401 - the classes the pickle names
    import torch.distributed.checkpoint.metadata  # noqa: F401

    f = os.path.join(os.fspath(path), METADATA)
    if not os.path.isfile(f):
        raise CheckpointNotFoundError(
            f"no DCP checkpoint at {path}: {METADATA} is missing (a DCP save that did not finish writes none)"
        )
    with open(f, "rb") as fh:
        try:
            return _MetadataUnpickler(fh, f).load()
        except ShardpointError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or garbled pickle
            raise CorruptCheckpointError(f"{f} cannot be read as DCP metadata: {e}") from None


# -- import -------------------------------------------------------------------------------------------
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _contiguous_start(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
    """Where a box starts in the row-major flattening of ``shape`` if the box is one
    contiguous run of it (a block of rows, as FSDP2 shards), else None: single
    entries along the dims before the first one it spans more of, whole dims after."""
    j = next((i for i, s in enumerate(sizes) if s != 1), len(sizes))
    if any(sizes[i] != shape[i] for i in range(j + 1, len(shape))):
        return None
    start, stride = 0, 1
    for i in range(len(shape) - 1, -1, -1):
        start += offsets[i] * stride
        stride *= shape[i]
    return start


def _blob(root: str, info: _StorageInfo, where: str) -> object:
    descriptors = getattr(info, "transform_descriptors", None)  # absent from older torch's _StorageInfo
    if descriptors:
        raise UnsupportedCheckpointError(
            f"{where} is stored with DCP transforms {list(descriptors)} (compression or encryption), "
            "which this importer does not read; load the checkpoint with torch.distributed.checkpoint and save it "
            "again without extensions"
        )
    with open(os.path.join(root, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    if len(data) != info.length:
        raise CorruptCheckpointError(f"{info.relative_path} is truncated: {where} needs bytes {info.offset}..{info.offset + info.length}")
    if not data.startswith(b"PK"):
        raise UnsupportedCheckpointError(
            f"{where} in {info.relative_path} is not a torch.save blob: the checkpoint was written with another DCP "
            "serialization format (e.g. safetensors), which this importer does not read"
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = ", ".join(re.findall(r"GLOBAL ([\w.]+)", str(e))) or "a class"
        raise UnsupportedCheckpointError(
            f"{where} in {info.relative_path} needs pickled code to load ({names}); only tensors and plain values "
            "are imported, since unpickling a class can run arbitrary code. Load the checkpoint with "
            "torch.distributed.checkpoint where you trust it and save that value as plain types"
        ) from None


def _paths(meta: Metadata) -> dict[str, tuple[str | int, ...]]:
    """Flattened DCP key -> the nested path it came from (planner data of the
    default planner; a key without one is kept as a single segment)."""
    pd = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn in meta.state_dict_metadata:
        p = pd.get(fqn)
        out[fqn] = tuple(p) if isinstance(p, (tuple, list)) and p else (fqn,)
    return out


def _put(root: dict[str | int, object], path: tuple[str | int, ...], value: object) -> None:
    node = root
    for seg in path[:-1]:
        node = cast("dict[str | int, object]", node.setdefault(seg, {}))  # only dicts are put on a path
    node[path[-1]] = value


def _lists(node: object) -> object:
    """DCP flattens a list into int path segments: a dict whose keys are exactly
    0..n-1 becomes the list it was (``optim/param_groups``)."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _rank_of(files: list[str]) -> dict[str, int]:
    if all(_RANK_FILE.match(f) for f in files):
        return {f: int(m.group(1)) for f in files if (m := _RANK_FILE.match(f))}  # every f matches
    return {f: i for i, f in enumerate(sorted(files))}


def _dcp_rank_states(root: str, meta: Metadata, bar: Progress) -> tuple[int, Iterator[tuple[int, object]]]:
    paths = _paths(meta)
    # (fqn, offsets) -> storage info
    where: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {}
    for idx, info in (meta.storage_data or {}).items():
        where[(idx.fqn, tuple(idx.offset) if idx.offset is not None else ())] = info
    files = sorted({info.relative_path for info in where.values()})
    rank_of = _rank_of(files)
    world = max(rank_of.values(), default=0) + 1
    # per rank: (fqn, kind, payload) items, kind "full" | "flat" | "gather" | "bytes" | "empty"
    # Any: the payload's shape is the kind's (unpacked by states() below)
    plan: list[list[tuple[str, str, Any]]] = [[] for _ in range(world)]
    for fqn, md in meta.state_dict_metadata.items():
        if not hasattr(md, "chunks"):  # BytesStorageMetadata
            info = where.get((fqn, ()))
            if info is None:
                raise CorruptCheckpointError(f"{root}/{METADATA} lists {fqn!r} but no file holds it")
            plan[rank_of[info.relative_path]].append((fqn, "bytes", info))
            continue
        md = cast("TensorStorageMetadata", md)  # it has chunks: not BytesStorageMetadata
        shape = tuple(int(s) for s in md.size)
        boxes: list[tuple[tuple[int, ...], tuple[int, ...], _StorageInfo]] = []
        for c in md.chunks:
            off, size = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            info = where.get((fqn, off))
            if info is None:
                raise CorruptCheckpointError(f"{root}/{METADATA}: no file holds the chunk of {fqn!r} at offsets {list(off)}")
            boxes.append((off, size, info))
        if not boxes:  # an empty tensor: nothing was written for it
            plan[0].append((fqn, "empty", (shape, md.properties.dtype)))
            continue
        owners = [rank_of[i.relative_path] for _, _, i in boxes]
        starts = [_contiguous_start(shape, o, s) for o, s, _ in boxes]
        if len(boxes) == 1 and boxes[0][1] == shape:
            plan[owners[0]].append((fqn, "full", (shape, boxes[0][2])))
        elif len(set(owners)) == len(owners) and all(s is not None for s in starts):
            for r, st, (_, size, info) in zip(owners, starts, boxes):
                plan[r].append((fqn, "flat", (shape, st, size, info)))
        else:  # a rank holds two boxes, or a box is not one run: assemble the tensor on its first writer
            plan[owners[0]].append((fqn, "gather", (shape, md.properties.dtype, boxes)))

    def states() -> Iterator[tuple[int, object]]:
        for r in range(world):
            state: dict[str | int, object] = {}
            for fqn, kind, payload in plan[r]:
                label = f"DCP key {fqn!r}"
                value: object
                if kind == "bytes":
                    value = _blob(root, payload, label)
                    bar.advance(payload.length)
                elif kind == "full":
                    shape, info = payload
                    value = _tensor(_blob(root, info, label), shape, label)
                    bar.advance(info.length)
                elif kind == "flat":
                    shape, start, size, info = payload
                    t = _tensor(_blob(root, info, label), size, label)
                    value = FlatShard(t.reshape(-1), shape, start)
                    bar.advance(info.length)
                elif kind == "empty":
                    value = torch.empty(payload[0], dtype=payload[1])
                else:
                    shape, dtype, boxes = payload
                    value = whole = torch.empty(shape, dtype=dtype)
                    for off, size, info in boxes:
                        t = _tensor(_blob(root, info, label), size, label)
                        whole[tuple(slice(o, o + s) for o, s in zip(off, size))] = t
                        bar.advance(info.length)
                _put(state, paths[fqn], value)
            yield r, _lists(state)
            del state

    return world, states()


def _tensor(t: object, size: tuple[int, ...], where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(size):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CorruptCheckpointError(f"{where}: the data file holds {got} where the metadata says a tensor of {tuple(size)}")
    return t.contiguous()


def import_dcp(src: str | os.PathLike[str], dst: PathLike, *, progress: bool = True, overwrite: bool = False,
               storage_options: dict[str, Any] | None = None) -> int:
    """Convert the DCP directory ``src`` into a shardpoint checkpoint at ``dst``.

    Keys keep DCP's nesting (``{"model": ..., "optim": ...}`` saved by DCP gives
    ``model/<fqn>``, ``optim/state/<fqn>/exp_avg``), so the result loads with
    :func:`shardpoint.load` into the same state dict on any number of ranks. One
    process; one DCP rank's data in memory at a time. Returns the world size DCP
    saved on, which the new checkpoint records.

    Raises:
        ShardpointError: ``.metadata`` names a class outside DCP's own (nothing
            from it is imported or run), or a data blob needs pickled code.
    """
    from ..api import save_offline

    root = os.fspath(src)
    meta = read_metadata(root)
    total = sum(i.length for i in (meta.storage_data or {}).values())
    with Progress(total, f"importing {root}", enabled=progress) as bar:
        world, states = _dcp_rank_states(root, meta, bar)
        save_offline(states, dst, world_size=world, overwrite=overwrite, storage_options=storage_options)
    return world


# -- export -------------------------------------------------------------------------------------------
#: Bytes of tensors read from the shardpoint checkpoint per read while exporting.
READ_BUDGET = 256 << 20


class _Source:
    """Reads tensors of a shardpoint checkpoint in groups of about READ_BUDGET bytes,
    in the order asked, keeping at most one group in memory."""

    def __init__(self, path: PathLike, tensors: dict[str, TensorInfo], storage_options: dict[str, Any] | None, bar: Progress) -> None:
        self.path, self.tensors, self.opts, self.bar = path, tensors, storage_options, bar
        self.order = list(tensors)
        self.pos = {k: i for i, k in enumerate(self.order)}
        self.cache: dict[str, torch.Tensor] = {}

    def get(self, key: str) -> torch.Tensor:
        from ..api import load_full

        if key not in self.cache:
            self.cache.clear()
            group: list[str] = []
            size = 0
            for k in self.order[self.pos[key]:]:
                if group and size + self.tensors[k].nbytes > READ_BUDGET:
                    break
                group.append(k)
                size += self.tensors[k].nbytes
            got = load_full(self.path, keys=group, storage_options=self.opts)
            for k in group:
                self.cache[k] = _lookup(got, decode_key(k))
        t = self.cache.pop(key)
        self.bar.advance(t.numel() * t.element_size())
        return t


def _lookup(tree: Any, path: tuple[str | int, ...]) -> Any:  # Any: a loaded tree, indexed along a path it has
    for seg in path:
        tree = tree[seg]
    return tree


def export_dcp(src: PathLike, dst: str | os.PathLike[str], *, progress: bool = True,
               storage_options: dict[str, Any] | None = None) -> list[str]:
    """Write the shardpoint checkpoint ``src`` as a DCP directory ``dst`` that
    ``torch.distributed.checkpoint.load`` reads on any number of ranks.

    Uses DCP's own writer from one process (``no_dist=True``); tensors are read
    from ``src`` only when the writer reaches them, a group of about
    :data:`READ_BUDGET` bytes at a time, so the whole model is never in memory.
    Keys map back to DCP's dotted names (``model/layer.weight`` -> ``model.layer.weight``).
    Per-rank values (``TrainState``'s RNG streams, a per-rank data position) have
    no DCP equivalent and are left out.

    Returns:
        The per-rank keys left out (empty when there were none).
    """
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    from ..api import load_full, metadata

    m = metadata(src, storage_options=storage_options)
    # the structure with every plain value, tensors as meta placeholders (no tensor data read)
    state = load_full(src, keys=sorted(m.values), storage_options=storage_options) if m.values else {}
    if not isinstance(state, dict):
        state = {}
    for k, t in m.tensors.items():
        _put_path(state, decode_key(k), torch.empty(t.shape, dtype=t.dtype, device="meta"))
    total = sum(t.nbytes for t in m.tensors.values())
    with Progress(total, f"exporting {dst}", enabled=progress) as bar:
        source = _Source(src, m.tensors, storage_options, bar)
        names: dict[str, str] = {}  # DCP's flattened name -> shardpoint key

        class _Planner(DefaultSavePlanner):
            def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None,
                               is_coordinator: bool = False) -> None:
                super().set_up_planner(state_dict, storage_meta, is_coordinator)
                mappings = getattr(self, "mappings", {}) or {}
                for fqn, path in mappings.items():
                    names[fqn] = encode_key(tuple(path))

            def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
                fqn = write_item.index.fqn
                key = names.get(fqn)
                if key is not None and key in m.tensors:
                    return source.get(key)
                return super().resolve_data(write_item)

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp.save(state, storage_writer=FileSystemWriter(os.fspath(dst)), planner=_Planner(), no_dist=True)
    return sorted(m.per_rank)


# Any: dicts and lists along the path, indexed by its segments (str or int for a dict, int for a list)
def _put_path(root: Any, path: tuple[Any, ...], value: object) -> None:
    node = root
    for seg in path[:-1]:
        if isinstance(node, list):
            while len(node) <= seg:
                node.append({})
            node = node[seg]
        else:
            node = node.setdefault(seg, {})
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value
