"""Nested state <-> flat leaves with typed keys.

A key is the path from the root joined with ``/``. ``str`` segments are escaped
(``%`` -> ``%25``, ``/`` -> ``%2F``; a str segment that reads as an integer has its
first character percent-encoded, so ``"0"`` -> ``%30``; the empty string is
``%``); ``int`` segments are written in decimal. So ``{0: x}`` and ``{"0": x}`` get different keys, and every
key decodes back to its typed path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeGuard

import msgspec
import numpy as np
import torch

from .errors import UnsupportedTypeError
from .layout import FlatShard
from .runtime import PROCESS

__all__ = ["PerRank", "Selection", "Stateful", "encode_key", "decode_key", "join", "is_stateful", "matches_prefix", "Walk",
           "walk"]

_INT = re.compile(r"^-?[0-9]+$")


class Stateful(Protocol):
    """An object that saves and restores itself, as torch's own ``Stateful``:
    ``state_dict()`` returns its state, ``load_state_dict()`` takes it back."""

    def state_dict(self) -> dict[str, Any]: ...  # Any: as torch's Stateful (and nn.Module, Optimizer) type it

    def load_state_dict(self, state_dict: dict[str, Any], /) -> object: ...


class PerRank:
    """Marks a value that differs between ranks and is kept once per rank (an RNG
    state, a per-rank data loader position). Without it, every value is taken as
    replicated among the ranks that hold it and must be identical on all of them.

    On load, rank ``r`` gets the value saved by rank ``r``; a rank that did not exist
    at save time keeps its current value (``LoadReport.per_rank`` says which)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


#: Most escaped str segments remembered (:attr:`shardpoint.runtime.Process.key_segments`).
SEGMENTS_MAX = 1 << 16


def _enc(seg: str | int) -> str:
    if type(seg) is str:  # remembered: a state's keys repeat a few names (weight, exp_avg, step) hundreds of times
        got = PROCESS.key_segments.get(seg)
        return got if got is not None else _enc_str(seg)
    if isinstance(seg, bool) or not isinstance(seg, (str, int)):
        raise UnsupportedTypeError(f"a key segment must be a str or an int, not {type(seg).__name__} ({seg!r})")
    return str(seg) if isinstance(seg, int) else _enc_str(seg)


def _enc_str(seg: str) -> str:
    """A str segment, escaped, and remembered."""
    if seg == "":
        s = "%"  # a lone '%' never comes out of the escaping below
    else:
        s = seg.replace("%", "%25").replace("/", "%2F")
        if _INT.match(s):
            s = f"%{ord(s[0]):02X}{s[1:]}"
    memo = PROCESS.key_segments
    if len(memo) >= SEGMENTS_MAX:
        memo.clear()
    memo[seg] = s
    return s


def join(prefix: str, seg: str | int) -> str:
    """Append one segment to an encoded key (``""`` is the root)."""
    e = _enc(seg)
    return e if prefix == "" else f"{prefix}/{e}"


def encode_key(path: tuple[str | int, ...] | list[str | int]) -> str:
    """Typed path -> key string."""
    out = ""
    for seg in path:
        out = join(out, seg)
    return out


def decode_key(key: str) -> tuple[str | int, ...]:
    """Key string -> typed path."""
    if key == "":
        return ()
    out: list[str | int] = []
    for part in key.split("/"):
        if _INT.match(part):
            out.append(int(part))
        elif part == "%":
            out.append("")
        else:
            out.append(re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), part))
    return tuple(out)


def matches_prefix(key: str, prefixes: list[str] | tuple[str, ...]) -> bool:
    """Whether ``key`` equals a prefix or lies under it, on whole segments
    (``model`` matches ``model/w``, never ``model_ema/w``)."""
    for p in prefixes:
        p = p.rstrip("/")
        if p == "" or key == p or key.startswith(p + "/"):
            return True
    return False


class Selection:
    """The keys a load's ``only``/``exclude`` prefixes select (:func:`matches_prefix`);
    called with a key, whether it is selected."""

    __slots__ = ("everything", "exclude", "only")

    def __init__(self, only: list[str] | str | None, exclude: list[str] | str | None) -> None:
        self.only = [only] if isinstance(only, str) else only
        self.exclude = [exclude] if isinstance(exclude, str) else exclude
        #: Every key is selected (no ``only``, no ``exclude``).
        self.everything = self.only is None and not self.exclude

    def __call__(self, key: str) -> bool:
        if self.only is not None and not matches_prefix(key, self.only):
            return False
        return not (self.exclude and matches_prefix(key, self.exclude))


def is_stateful(obj: object) -> TypeGuard[Stateful]:
    """Whether ``obj`` follows the Stateful protocol (``state_dict``/``load_state_dict``)."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping, list, tuple))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


_PLAIN = (type(None), bool, int, float, str, bytes)
_PLAIN_TYPES = frozenset(_PLAIN)  # exactly these types (a subclass takes the general way)


#: The children of every leaf node: none, and none can be added.
_NO_CHILDREN: Mapping[str | int, Any] = MappingProxyType({})


class Node(msgspec.Struct):
    """One node of the walked state. ``kind``: dict, list, tuple (containers),
    stateful, per_rank, tensor, value. A :class:`msgspec.Struct` (made in C): a walk
    makes one per leaf and container."""

    kind: str
    obj: Any = None  # Any: the walked object of any kind above, used by the load as its kind says
    key: str = ""
    """Its encoded key (a later pass over the nodes need not join the segments again)."""
    children: Mapping[str | int, Node] = _NO_CHILDREN
    """A container's nodes by segment (a dict made by the walk); a leaf's is empty."""
    inner: Node | None = None


@dataclass(slots=True)
class Walk:
    """The flat view of a (sub)tree: container types and leaf nodes by key, the
    per-rank sub-walks by key, and the Stateful objects with their keys (outermost
    first)."""

    root: Node
    containers: dict[str, str] = field(default_factory=dict)
    leaves: dict[str, Node] = field(default_factory=dict)
    per_rank: dict[str, Walk] = field(default_factory=dict)
    stateful: list[tuple[str, Stateful]] = field(default_factory=list)


def walk(state: object, prefix: str = "") -> Walk:
    """Walk ``state`` once, calling each Stateful object's ``state_dict()`` exactly
    once. Raises ``TypeError`` naming the key of anything that cannot be saved."""
    w = Walk(root=Node("dict", None, "", {}))
    w.root = _walk(state, prefix, w, in_per_rank=False)
    return w


_TENSORS = (torch.Tensor, FlatShard, np.ndarray)


def _walk(obj: object, key: str, w: Walk, in_per_rank: bool) -> Node:
    if isinstance(obj, _TENSORS):  # the commonest first (a PerRank is none of them)
        n = Node("tensor", obj, key)
        w.leaves[key] = n
        return n
    if isinstance(obj, PerRank):
        if in_per_rank:
            return _walk(obj.value, key, w, True)
        sub = Walk(root=Node("dict", None, "", {}))
        sub.root = _walk(obj.value, key, sub, in_per_rank=True)
        w.per_rank[key] = sub
        return Node("per_rank", obj, key, inner=sub.root)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, _PLAIN):
        n = Node("value", obj, key)
        w.leaves[key] = n
        return n
    if isinstance(obj, Mapping):
        return _walk_mapping(obj, key, w, in_per_rank)
    if isinstance(obj, (list, tuple)):
        kind = "list" if isinstance(obj, list) else "tuple"
        items: dict[str | int, Node] = {}
        n = Node(kind, obj, key, items)
        w.containers[key] = kind
        leaves = w.leaves
        above = "" if key == "" else key + "/"
        for i, v in enumerate(obj):
            child_key = above + str(i)
            if type(v) in _PLAIN_TYPES:  # a param group's parameter names, without a call
                c = items[i] = Node("value", v, child_key)
                leaves[child_key] = c
            else:
                items[i] = _walk(v, child_key, w, in_per_rank)
        return n
    if is_stateful(obj):
        w.stateful.append((key, obj))
        sd = obj.state_dict()
        if not isinstance(sd, Mapping):
            raise UnsupportedTypeError(f"key {key or '<root>'!r}: {type(obj).__name__}.state_dict() returned {type(sd).__name__}, not a dict")
        return Node("stateful", obj, key, inner=_walk(sd, key, w, in_per_rank))
    raise UnsupportedTypeError(
        f"key {key or '<root>'!r} holds a {type(obj).__module__}.{type(obj).__name__}, which shardpoint cannot save: "
        "use tensors, numpy arrays, None/bool/int/float/str/bytes, dicts, lists, tuples, or an object "
        "with state_dict()/load_state_dict()"
    )


def _walk_mapping(obj: Mapping[Any, object], key: str, w: Walk, in_per_rank: bool) -> Node:
    """A dict or other mapping: its node, its children walked."""
    children: dict[str | int, Node] = {}
    n = Node("dict", obj, key, children)
    w.containers[key] = "dict"
    leaves, memo = w.leaves, PROCESS.key_segments
    above = "" if key == "" else key + "/"
    for k, v in obj.items():
        if type(k) is str:  # a state's keys repeat a few names: their escaped forms are remembered
            e = memo.get(k)
            child_key = above + (e if e is not None else _enc_str(k))
        elif isinstance(k, bool) or not isinstance(k, (str, int)):
            raise UnsupportedTypeError(
                f"key {key or '<root>'!r} has a dict key of type {type(k).__name__} ({k!r}); "
                "only str and int keys can be saved: convert the key to str"
            )
        else:
            child_key = join(key, k)
        if isinstance(v, _TENSORS):  # a tensor leaf, the commonest child, without a call
            c = children[k] = Node("tensor", v, child_key)
            leaves[child_key] = c
        elif type(v) in _PLAIN_TYPES:  # a plain value (an optimizer's lr), without a call
            c = children[k] = Node("value", v, child_key)
            leaves[child_key] = c
        elif type(v) is dict:  # a nested dict (one parameter's optimizer state), without the checks
            children[k] = _walk_mapping(v, child_key, w, in_per_rank)
        else:
            children[k] = _walk(v, child_key, w, in_per_rank)
    return n
