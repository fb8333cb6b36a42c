"""Keys: typed paths <-> strings, int and str segments kept apart, and the
whole-segment prefix rule of only=/exclude=."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.tree import PerRank, decode_key, encode_key, matches_prefix, walk

# str segments that stress the escaping: '/', '%', digit strings, signs, escapes
tricky = st.sampled_from(["/", "%", "%2F", "%25", "0", "-1", "007", "1/2", "a%b", "", "-", "+1", " 1", "1.5", "%30", "é"])
segment = st.one_of(
    st.integers(-(10**20), 10**20),
    st.text(max_size=8),
    tricky,
    st.from_regex(r"-?[0-9]{1,4}", fullmatch=True),
)
paths = st.lists(segment, min_size=1, max_size=5).map(tuple)


@settings(max_examples=500, deadline=None)
@given(paths)
def test_key_round_trip(path) -> None:  # type: ignore[no-untyped-def]
    key = encode_key(path)
    back = decode_key(key)
    assert back == path
    assert [type(s) for s in back] == [type(s) for s in path]
    assert len(key.split("/")) == len(path), "a '/' inside a segment must be escaped"


@settings(max_examples=300, deadline=None)
@given(paths, paths)
def test_distinct_paths_give_distinct_keys(a, b) -> None:  # type: ignore[no-untyped-def]
    same_typed = len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b, strict=False))
    assert (encode_key(a) == encode_key(b)) == same_typed


def test_key_examples() -> None:
    assert encode_key(("model", "layers.0.weight")) == "model/layers.0.weight"
    assert encode_key(("dl_state", "data", "a")) == "dl_state/data/a"
    assert encode_key(("a/b", "c%d")) == "a%2Fb/c%25d"
    assert encode_key((0, "0", -3, "-3")) == "0/%30/-3/%2D3"
    assert encode_key(()) == "" and decode_key("") == ()
    assert encode_key(("",)) == "%" and encode_key(("", "")) == "%/%" and decode_key("a/%") == ("a", "")


def test_int_and_str_keys_stay_apart() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    w = walk({0: a, "0": b})
    assert sorted(w.leaves) == ["%30", "0"]
    assert w.leaves["0"].obj is a and w.leaves["%30"].obj is b
    assert decode_key("0") == (0,) and decode_key("%30") == ("0",)


def test_walk_keys_of_nested_state() -> None:
    w = walk({"model": {"w": torch.zeros(2)}, "opt": [{"lr": 0.1}, (1, None)], "rng": PerRank({"seed": 3})})
    assert sorted(w.leaves) == ["model/w", "opt/0/lr", "opt/1/0", "opt/1/1"]
    assert w.containers == {"": "dict", "model": "dict", "opt": "list", "opt/0": "dict", "opt/1": "tuple"}
    assert sorted(w.per_rank) == ["rng"] and sorted(w.per_rank["rng"].leaves) == ["rng/seed"]


def test_walk_refuses_unsupported_keys_and_values() -> None:
    with pytest.raises(TypeError, match="dict key of type float"):
        walk({"a": {1.5: 1}})
    with pytest.raises(TypeError, match="dict key of type bool"):
        walk({True: 1})
    with pytest.raises(TypeError, match="'a/0' holds a builtins.object"):
        walk({"a": [object()]})


@pytest.mark.parametrize(
    ("key", "prefixes", "want"),
    [
        ("model/w", ["model"], True),
        ("model", ["model"], True),
        ("model_ema/w", ["model"], False),
        ("modelx", ["model"], False),
        ("model/w", ["model/"], True),
        ("model/layers.0.weight", ["model/layers.0"], False),  # '.' is not a separator
        ("model/layers/0/weight", ["model/layers/0"], True),
        ("model/layers/00/weight", ["model/layers/0"], False),
        ("opt/state", ["model", "opt"], True),
        ("a%2Fb/c", ["a"], False),  # an escaped '/' is inside one segment
        ("anything", [""], True),
        ("x", [], False),
    ],
)
def test_matches_prefix_whole_segments(key: str, prefixes: list[str], want: bool) -> None:
    assert matches_prefix(key, prefixes) is want


@settings(max_examples=200, deadline=None)
@given(paths, paths)
def test_matches_prefix_is_path_prefix(a, b) -> None:  # type: ignore[no-untyped-def]
    is_prefix = len(a) <= len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b, strict=False))
    assert matches_prefix(encode_key(b), [encode_key(a)]) == is_prefix
