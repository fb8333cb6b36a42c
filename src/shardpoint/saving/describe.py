"""Describe: what this rank holds, as a :class:`~shardpoint.saving.records.Described`.

The state is walked (:mod:`shardpoint.tree`) to its leaves; each tensor leaf is
cut into the chunks this rank holds, in global coordinates
(:mod:`shardpoint.layout`); plain values are encoded for the manifest.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedTypeError, UsageError
from ..format.datafile import DTYPES, dtype_name
from ..format.manifest import encode_value
from ..layout.local import Describe
from ..tree import walk
from .records import ChunkRows, Described, Encoded, TensorMeta


def describe(state: Any) -> Described:
    """This rank's description of ``state`` (and of each of its per-rank values);
    raises naming the key that cannot be saved."""
    w = walk(state)
    described: dict[str, Described] = {}
    chunks_of = Describe().__call__  # DTensor layouts met in this walk, kept (a model's DTensors share a few); a bound method: called faster
    names: dict[torch.dtype, str] = {}  # the dtypes met, checked, with their names
    # per-rank values first: the top level's description holds theirs
    for pkey, sub in [*w.per_rank.items(), ("", w)]:
        values: dict[str, Encoded] = {}
        tensors: dict[str, TensorMeta] = {}
        rows = ChunkRows([], [], [])
        keys, offsets, sizes = rows.keys, rows.offsets, rows.sizes
        views: list[torch.Tensor] = []
        for key, node in sub.leaves.items():
            obj = node.obj
            if node.kind == "value":
                try:
                    values[key] = encode_value(obj)
                except TypeError:  # pragma: no cover - walk only lets plain values through
                    raise UnsupportedTypeError(f"key {key!r}: cannot encode {type(obj).__name__}") from None
                continue
            if isinstance(obj, torch.Tensor):
                # a DTensor's kind is its local shard's (whose attributes are read without
                # DTensor's dispatch, several times cheaper)
                local = obj if type(obj) is torch.Tensor else getattr(obj, "_local_tensor", None)
                _check_kind(key, local if isinstance(local, torch.Tensor) else obj, names)
            lc = chunks_of(key, obj)
            for v in lc.views:
                if v.is_meta:
                    raise UsageError(f"key {key!r} is on the meta device and holds no data; materialise it before saving")
            name = names.get(lc.dtype)
            if name is None:
                name = dtype_name(lc.dtype)
            tensors[key] = {"dtype": name, "shape": list(lc.shape), "numpy": lc.numpy}
            for b in lc.boxes:
                keys.append(key)
                offsets.append(list(b.offsets))
                sizes.append(list(b.sizes))
            views += lc.views
        per_rank = {} if pkey else described
        owners = () if pkey else tuple((k, o) for k, o in w.stateful if hasattr(o, "_shardpoint_health_role"))
        described[pkey] = Described(sub.containers, values, tensors, rows, views, dict(per_rank), owners)
    return described[""]


def _check_kind(key: str, t: torch.Tensor, names: dict[torch.dtype, str]) -> None:
    """Refuse, naming the key and what to save instead, the tensors the format has no
    place for (found here, before anything is written, not as a damaged manifest later).
    ``names``: the dtypes found good so far, with their names (one look-up a tensor)."""
    if t.is_nested:
        raise UnsupportedTypeError(f"key {key!r} is a nested tensor; shardpoint saves dense tensors. Save its "
                                   "pieces, `list(t.unbind())`, and nest them again after loading")
    dtype = t.dtype
    if dtype not in names:  # a dtype found good before is no quantized one (a quantized tensor has a q-dtype)
        if t.is_quantized:
            raise UnsupportedTypeError(
                f"key {key!r} is a quantized tensor ({t.dtype}); save `t.int_repr()` with its scale and zero point "
                "(`t.q_scale()`, `t.q_zero_point()`), or `t.dequantize()`")
        name = dtype_name(dtype)
        if name not in DTYPES:
            raise UnsupportedTypeError(f"key {key!r} has dtype {dtype}, which the checkpoint format does not hold "
                                       f"(it holds {', '.join(sorted(DTYPES))}); convert it first, e.g. "
                                       "`t.to(torch.complex64)` for complex32")
        names[dtype] = name
    if t.layout != torch.strided:
        raise UnsupportedTypeError(
            f"key {key!r} is a {t.layout} tensor; shardpoint saves dense (strided) tensors only. "
            "Save `t.to_dense()` instead, and make it sparse again after loading")


def data_file(rank: int, save_id: str) -> str:
    """The data file rank ``rank`` writes in save ``save_id``."""
    return f"r{rank:05d}-{save_id}.safetensors"
