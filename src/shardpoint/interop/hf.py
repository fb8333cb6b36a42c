"""Hugging Face safetensors weights out and in.

Export (:func:`export_hf`) writes the model weights of a shardpoint checkpoint as
``model.safetensors``, or above ``max_shard_size`` as
``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``,
the layout ``transformers``' ``from_pretrained`` reads. The header of each file is
computed from the checkpoint's metadata before any tensor is read; tensors are then
read a group of at most :data:`READ_BUDGET` bytes at a time (never more than one
output file's worth) and streamed into the file, so memory stays bounded by one
group, not by the model.

Import (:func:`import_hf`) reads ``model.safetensors`` or an index and its files
(memory-mapped, parsed here: no pickle anywhere in the format) into a checkpoint
with keys ``model/<name>``, which ``TrainState(model=...)`` loads on any number of
ranks. Tied weights that the files store once (``lm_head.weight`` tied to the
input embedding) are found from the ``config.json`` beside the weights when
``transformers`` is installed, and saved under both names, as the model's own
``state_dict`` has them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..errors import (
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
    UsageError,
)
from ..format.datafile import DTYPES, dtype_name, header_bytes, tensor_bytes
from ..tree import decode_key
from ._progress import Progress

if TYPE_CHECKING:
    from ..api import PathLike

__all__ = ["export_hf", "import_hf", "parse_size", "READ_BUDGET"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: Most tensor bytes read from the checkpoint at once while exporting.
READ_BUDGET = 256 << 20
_CODES = {v: k for k, v in DTYPES.items() if v is not None}
_CODE_OF = {k: v for k, v in DTYPES.items() if v is not None}  # DTYPES without the dtypes safetensors lacks
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"100MiB"`` -> 104_857_600 (as ``transformers`` reads them); ints pass."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", size)
    if not m or m.group(2).upper() not in _UNITS:
        raise UsageError(f"cannot read {size!r} as a size; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _renamer(key_map: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if key_map is None:
        return lambda n: n
    if callable(key_map):
        return key_map
    pairs = sorted(key_map.items(), key=lambda kv: -len(kv[0]))  # longest prefix wins

    def rename(n: str) -> str:
        for old, new in pairs:
            if n.startswith(old):
                return new + n[len(old):]
        return n

    return rename


# -- export -------------------------------------------------------------------------------------------
def _header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    return header_bytes(entries, fmt="pt")


def export_hf(
    src: PathLike,
    dst: str | os.PathLike[str],
    *,
    prefix: str = "model/",
    key_map: Mapping[str, str] | Callable[[str], str] | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    config: str | os.PathLike[str] | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Write the tensors under ``prefix`` of the shardpoint checkpoint ``src`` as
    Hugging Face safetensors weights in the directory ``dst``.

    Args:
        prefix: export only keys under this prefix, with it removed (``"model/"``:
            ``model/transformer.wte.weight`` -> ``transformer.wte.weight``); ``""``
            exports every tensor. Nested segments below it are joined with ``.``.
        key_map: renames after the prefix is removed: a dict of name prefixes
            (``{"_orig_mod.": ""}``) or a function of the name.
        max_shard_size: one file up to this size (bytes, or ``"5GB"``, ``"500MB"``),
            else several files and ``model.safetensors.index.json``.
        dtype: cast floating-point tensors to it (``torch.bfloat16`` or ``"bfloat16"``).
        config: a ``config.json`` (or a folder holding one) to copy beside the weights.

    Returns:
        The names of the files written in ``dst``.
    """
    from ..api import load_full, metadata

    limit = parse_size(max_shard_size)
    cast = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if dtype is not None and not (isinstance(cast, torch.dtype) and cast.is_floating_point):
        raise UsageError(f"dtype={dtype!r}: pass a floating-point dtype such as bfloat16, float16 or float32")
    rename = _renamer(key_map)
    m = metadata(src, storage_options=storage_options)
    ppath = decode_key(prefix.rstrip("/")) if prefix.strip("/") else ()
    rows: list[tuple[str, str, torch.dtype, tuple[int, ...], int]] = []  # key, name, out dtype, shape, bytes
    seen: dict[str, str] = {}
    for k, t in m.tensors.items():
        path = decode_key(k)
        if path[: len(ppath)] != ppath or len(path) == len(ppath):
            continue
        name = rename(".".join(str(s) for s in path[len(ppath):]))
        if name in seen:
            raise UsageError(f"keys {seen[name]!r} and {k!r} both export as {name!r}; change key_map")
        seen[name] = k
        out = cast if cast is not None and t.dtype.is_floating_point else t.dtype
        if DTYPES.get(dtype_name(out)) is None:
            raise UsageError(f"{k!r} is {dtype_name(out)}, which safetensors cannot store; pass dtype= or leave it out")
        rows.append((k, name, out, t.shape, int(np.prod(t.shape, dtype=np.int64)) * out.itemsize))
    if not rows:
        raise UsageError(
            f"{src} has no tensors under {prefix!r} (its tensor keys start with "
            f"{sorted({k.split('/')[0] for k in m.tensors})[:5]}); pass prefix= ('' for every tensor)"
        )
    shards: list[list[int]] = [[]]
    size = 0
    for i, r in enumerate(rows):
        if shards[-1] and size + r[4] > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += r[4]
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    os.makedirs(dst, exist_ok=True)
    total = sum(r[4] for r in rows)
    with Progress(total, f"exporting {os.fspath(dst)}", enabled=progress) as bar:
        for fname, idx in zip(names, shards):
            entries = [(rows[i][1], _CODE_OF[dtype_name(rows[i][2])], rows[i][3], rows[i][4]) for i in idx]
            tmp = os.path.join(dst, f".{fname}.tmp")
            with open(tmp, "wb") as f:
                f.write(_header(entries))
                j = 0
                while j < len(idx):  # read a group of tensors, write it, drop it
                    group: list[int] = []
                    budget = 0
                    while j < len(idx) and (not group or budget + rows[idx[j]][4] <= READ_BUDGET):
                        group.append(idx[j])
                        budget += rows[idx[j]][4]
                        j += 1
                    got = load_full(src, keys=[rows[i][0] for i in group], storage_options=storage_options)
                    for i in group:
                        t = _lookup(got, decode_key(rows[i][0]))
                        t = t.to(rows[i][2]).contiguous()
                        f.write(tensor_bytes(t))
                        bar.advance(rows[i][4])
                    del got, t
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(dst, fname))
    written = list(names)
    # a previous export's other layout (or shard count) would shadow or litter this one
    stale = [f for f in os.listdir(dst) if (f in (SINGLE, INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", f))
             and f not in names]
    for old in stale:
        os.remove(os.path.join(dst, old))
    if n > 1:
        weight_map = {rows[i][1]: fname for fname, idx in zip(names, shards) for i in idx}
        with open(os.path.join(dst, INDEX), "w") as index:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, index, indent=2, sort_keys=True)
        written.append(INDEX)
    if config is not None:
        cfg = os.fspath(config)
        cfg = os.path.join(cfg, "config.json") if os.path.isdir(cfg) else cfg
        if not os.path.isfile(cfg):
            raise CheckpointNotFoundError(f"config {cfg} does not exist")
        if os.path.abspath(cfg) != os.path.abspath(os.path.join(dst, "config.json")):
            shutil.copyfile(cfg, os.path.join(dst, "config.json"))
        written.append("config.json")
    return written


def _lookup(tree: Any, path: tuple[str | int, ...]) -> Any:  # Any: a loaded tree, indexed along a path it has
    for seg in path:
        tree = tree[seg]
    return tree


# -- import -------------------------------------------------------------------------------------------
def _files(src: str) -> list[str]:
    if os.path.isfile(src) and src.endswith(".json"):
        index, folder = src, os.path.dirname(src)
    elif os.path.isfile(src):
        return [src]
    elif os.path.isdir(src):
        folder = src
        index = os.path.join(src, INDEX)
        if not os.path.exists(index):
            single = os.path.join(src, SINGLE)
            if os.path.exists(single):
                return [single]
            found = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if len(found) == 1:
                return [os.path.join(src, found[0])]
            raise CheckpointNotFoundError(
                f"{src} has neither {SINGLE} nor {INDEX}" + (f" (it has {len(found)} .safetensors files; pass the index)" if found else "")
            )
    else:
        raise CheckpointNotFoundError(f"no safetensors weights at {src}")
    try:
        with open(index) as f:
            wm = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"{index} is not a safetensors index (a JSON object with weight_map): {e}") from None
    return [os.path.join(folder, n) for n in sorted(set(wm.values()))]


def _open(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private memory map."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(size - 8, 100 << 20):
            raise CorruptCheckpointError(f"{path}: header length {hlen} exceeds the file ({size} bytes) or 100 MB")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as e:
            raise CorruptCheckpointError(f"{path}: the header is not JSON: {e}") from None
    mm = np.memmap(path, dtype=np.uint8, mode="c") if size > 0 else np.zeros(0, np.uint8)
    base = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        code = entry.get("dtype")
        if code not in _CODES:
            raise UnsupportedCheckpointError(f"{path}: tensor {name!r} has dtype {code!r}, which shardpoint does not read; "
                                             "save the weights in another dtype (float32, bfloat16, ...) first")
        dt = getattr(torch, _CODES[code])
        shape = tuple(int(s) for s in entry["shape"])
        a, b = (int(x) for x in entry["data_offsets"])
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if b - a != need or base + b > size or a < 0:
            raise CorruptCheckpointError(f"{path}: tensor {name!r} claims bytes {a}..{b}, which do not fit {code}{list(shape)} or the file")
        raw = torch.from_numpy(mm[base + a : base + b])
        t = raw.view(dt) if (base + a) % dt.itemsize == 0 else raw.clone().view(dt)
        out[name] = t.reshape(shape)
    return out


def _tied(folder: str, names: set[str]) -> dict[str, str]:
    """Parameters the model shares that the files store under one name: ``{missing: stored}``.
    Found by building the model of ``folder/config.json`` on the meta device."""
    cfg = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg):
        return {}
    try:
        import transformers
    except ImportError:
        return {}
    config = transformers.AutoConfig.from_pretrained(folder)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        return {}
    with torch.device("meta"):
        model = cls(config)
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    out = {}
    for group in groups.values():
        stored = [n for n in group if n in names]
        if stored:
            out.update({n: stored[0] for n in group if n not in names})
    return out


def import_hf(
    src: str | os.PathLike[str],
    dst: PathLike,
    *,
    prefix: str = "model/",
    key_map: Mapping[str, str] | Callable[[str], str] | None = None,
    tie: bool | Mapping[str, str] = True,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Convert Hugging Face safetensors weights (a folder with ``model.safetensors``
    or ``model.safetensors.index.json``, or one such file) into a shardpoint
    checkpoint at ``dst``, with keys ``<prefix><name>``.

    The result loads with ``shardpoint.load(TrainState(model=model), dst)`` on any
    number of ranks (a fine-tune starting from published weights), and the first
    save of the run is then an ordinary sharded checkpoint.

    Args:
        key_map: renames of the weight names (prefixes, or a function) first.
        tie: find tied weights from ``config.json`` beside the weights (needs
            ``transformers``) and store them under every name the model uses;
            a dict ``{alias: stored}`` names them yourself; False stores only what
            the files hold.
    """
    from ..api import save_offline

    files = _files(os.fspath(src))
    rename = _renamer(key_map)
    ppath = decode_key(prefix.rstrip("/")) if prefix.strip("/") else ()
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _open(f).items():
            new = rename(name)
            if new in weights:
                raise ConversionError(f"{f}: tensor {name!r} is stored twice (or two names map to {new!r}); remove the "
                                      "duplicate from the weights, or give key_map= names that stay distinct")
            weights[new] = t
    folder = os.fspath(src) if os.path.isdir(src) else os.path.dirname(os.fspath(src))
    aliases = dict(tie) if isinstance(tie, Mapping) else (_tied(folder, set(weights)) if tie else {})
    for alias, stored in aliases.items():
        if stored not in weights:
            raise UsageError(f"tie={{{alias!r}: {stored!r}}}: {stored!r} is not in the weights")
        weights.setdefault(alias, weights[stored])
    state: dict[str | int, object] = {}
    node = state
    for seg in ppath:
        node = cast("dict[str | int, object]", node.setdefault(seg, {}))  # only dicts are put on this path
    node.update(weights) if ppath else state.update(weights)
    total = sum(os.path.getsize(f) for f in files)
    with Progress(total, f"importing {os.fspath(src)}", enabled=progress) as bar:
        save_offline([(0, state)], dst, world_size=1, overwrite=overwrite, storage_options=storage_options)
        bar.advance(total)
