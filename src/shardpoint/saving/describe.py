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
from ..layout import chunks_of
from ..tree import walk
from .records import ChunkRows, Described, Encoded, TensorMeta


def describe(state: Any) -> Described:
    """This rank's description of ``state`` (and of each of its per-rank values);
    raises naming the key that cannot be saved."""
    w = walk(state)
    described: dict[str, Described] = {}
    # per-rank values first: the top level's description holds theirs
    for pkey, sub in [*w.per_rank.items(), ("", w)]:
        values: dict[str, Encoded] = {}
        tensors: dict[str, TensorMeta] = {}
        rows = ChunkRows([], [], [])
        views: list[torch.Tensor] = []
        for key, node in sub.leaves.items():
            if node.kind == "value":
                try:
                    values[key] = encode_value(node.obj)
                except TypeError:  # pragma: no cover - walk only lets plain values through
                    raise UnsupportedTypeError(f"key {key!r}: cannot encode {type(node.obj).__name__}") from None
                continue
            if isinstance(node.obj, torch.Tensor):
                _check_kind(key, node.obj)
            if isinstance(node.obj, torch.Tensor) and node.obj.layout != torch.strided:
                raise UnsupportedTypeError(
                    f"key {key!r} is a {node.obj.layout} tensor; shardpoint saves dense (strided) tensors only. "
                    "Save `t.to_dense()` instead, and make it sparse again after loading")
            lc = chunks_of(key, node.obj)
            if any(v.device.type == "meta" for v in lc.views):
                raise UsageError(f"key {key!r} is on the meta device and holds no data; materialise it before saving")
            tensors[key] = {"dtype": dtype_name(lc.dtype), "shape": list(lc.shape), "numpy": lc.numpy}
            for b, v in zip(lc.boxes, lc.views):
                rows.keys.append(key)
                rows.offsets.append(list(b.offsets))
                rows.sizes.append(list(b.sizes))
                views.append(v)
        per_rank = {} if pkey else described
        owners = () if pkey else tuple((k, o) for k, o in w.stateful if hasattr(o, "_shardpoint_health_role"))
        described[pkey] = Described(sub.containers, values, tensors, rows, views, dict(per_rank), owners)
    return described[""]


def _check_kind(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the key and what to save instead, the tensors the format has no
    place for (found here, before anything is written, not as a damaged manifest later)."""
    if t.is_nested:
        raise UnsupportedTypeError(f"key {key!r} is a nested tensor; shardpoint saves dense tensors. Save its "
                                   "pieces, `list(t.unbind())`, and nest them again after loading")
    if t.is_quantized:
        raise UnsupportedTypeError(
            f"key {key!r} is a quantized tensor ({t.dtype}); save `t.int_repr()` with its scale and zero point "
            "(`t.q_scale()`, `t.q_zero_point()`), or `t.dequantize()`")
    if dtype_name(t.dtype) not in DTYPES:
        raise UnsupportedTypeError(f"key {key!r} has dtype {t.dtype}, which the checkpoint format does not hold "
                                   f"(it holds {', '.join(sorted(DTYPES))}); convert it first, e.g. "
                                   "`t.to(torch.complex64)` for complex32")


def data_file(rank: int, save_id: str) -> str:
    """The data file rank ``rank`` writes in save ``save_id``."""
    return f"r{rank:05d}-{save_id}.safetensors"
