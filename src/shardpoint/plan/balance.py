"""One writer for each replicated chunk: largest first onto the least-loaded holder,
ties to the lowest rank (the longest-processing-time rule).

The rule is sequential: each choice sees the loads the earlier ones left. But a choice
reads only the loads of its own holders, so consecutive groups whose holders do not
overlap (the 128 shards of an HSDP tensor, each replicated over its own ranks) are
chosen together in a few array calls; groups of no bytes change no load and are all
chosen together at the end. The choices are exactly the sequential rule's.
"""

from __future__ import annotations

import numpy as np

#: Holders below which a batch is chosen in Python (an array call costs as much as ~300 of them).
_SMALL_BATCH = 256


def choose(load: np.ndarray, holders: np.ndarray, starts: np.ndarray, nbytes: np.ndarray,
           sets: np.ndarray | None = None) -> np.ndarray:
    """Choose each group's writer, largest group first.

    Args:
        load: (world,) int64 bytes each rank writes already; the chosen bytes are added
            in place.
        holders: the ranks of each holder list, list after list (in row order within a
            list: the first of two equal holders is the one chosen).
        starts: where each list begins in ``holders``, and its end.
        nbytes: (groups,) bytes of each group; ties are taken in group order.
        sets: (groups,) the holder list of each group (groups that share one name it
            once: the keys of one pattern of a grid); by default list ``g`` is group ``g``'s.

    Returns:
        (groups,) int64: the position in ``holders`` of each group's writer.
    """
    sets = np.arange(len(nbytes), dtype=np.int64) if sets is None else sets
    chosen = np.zeros(len(nbytes), dtype=np.int64)
    order = np.argsort(-nbytes, kind="stable")
    heavy = order[nbytes[order] > 0]
    for batch in _disjoint_runs(heavy, holders, starts, sets, len(load)):
        _choose_batch(load, holders, starts, nbytes, sets, batch, chosen)
    _choose_batch(load, holders, starts, nbytes, sets, order[nbytes[order] <= 0], chosen)  # no load changes
    return chosen


def ranges(lo: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranges ``[lo[i], lo[i] + lens[i])`` one after another, and where each
    begins among them ((len(lo) + 1,))."""
    first = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(lens, out=first[1:])
    return np.repeat(lo - first[:-1], lens) + np.arange(int(first[-1]), dtype=np.int64), first


def _entries(lists: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions in ``holders`` of the holders of ``lists``, list after list, and
    where each list's begin among them."""
    return ranges(starts[lists], starts[lists + 1] - starts[lists])


def _disjoint_runs(groups: np.ndarray, holders: np.ndarray, starts: np.ndarray, sets: np.ndarray,
                   world: int) -> list[np.ndarray]:
    """``groups`` (in the order they are chosen) cut into maximal runs in which no two
    groups share a holder: a group starts a new run when one of its holders appeared
    since the current run began."""
    if not groups.size:
        return []
    last_seen = _last_seen(groups, holders, starts, sets, world).tolist()
    cuts, run = [0], 0
    for p in range(1, len(groups)):
        if last_seen[p] >= run:
            run = p
            cuts.append(p)
    cuts.append(len(groups))
    return [groups[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _last_seen(groups: np.ndarray, holders: np.ndarray, starts: np.ndarray, sets: np.ndarray,
               world: int) -> np.ndarray:
    """For each of ``groups`` (in order), the latest earlier position in the order of a
    group that may share a holder with it (-1: none). When any two holder lists in use
    are equal or disjoint (replica sets: HSDP's, a pipeline stage's), each list has a
    block, the lowest list that holds its first rank, and lists of different blocks
    share no rank: one stable sort of the groups' blocks. Otherwise one stable sort of
    every holder by rank."""
    used = np.unique(sets[groups])
    idx, first = _entries(used, starts)
    list_of = np.repeat(used, np.diff(first))
    block = np.full(world, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(block, holders[idx], list_of)  # each rank's lowest list
    block_of = np.zeros(int(used.max()) + 1, dtype=np.int64)
    block_of[used] = block[holders[starts[used]]]
    if (block[holders[idx]] == block_of[list_of]).all():  # every rank of a list is in the list's block
        q, pos, first = block_of[sets[groups]], np.arange(len(groups), dtype=np.int64), np.arange(len(groups) + 1)
    else:
        idx, first = _entries(sets[groups], starts)
        q = holders[idx]
        pos = np.repeat(np.arange(len(groups), dtype=np.int64), np.diff(first))
    q = q.astype(np.int16 if int(q.max(initial=0)) < 1 << 15 else np.int64)  # 16 bits: a radix sort
    by_q = np.argsort(q, kind="stable")  # by holder (or block), then by position in the order
    qs, ps = q[by_q], pos[by_q]
    prev_sorted = np.full(len(qs), -1, dtype=np.int64)
    again = (qs[1:] == qs[:-1]) & (ps[1:] != ps[:-1])  # the same holder in an earlier group
    prev_sorted[1:][again] = ps[:-1][again]
    prev = np.empty_like(prev_sorted)
    prev[by_q] = prev_sorted
    return np.maximum.reduceat(prev, first[:-1]) if len(prev) else prev


def _choose_batch(load: np.ndarray, holders: np.ndarray, starts: np.ndarray, nbytes: np.ndarray, sets: np.ndarray,
                  groups: np.ndarray, chosen: np.ndarray) -> None:
    """Choose the writers of ``groups``, which share no holder (or carry no bytes):
    each takes its least-loaded holder as the loads stand, then adds its bytes."""
    if not groups.size:
        return
    idx, first = _entries(sets[groups], starts)
    if len(idx) < _SMALL_BATCH:
        for g in groups.tolist():
            a, b = int(starts[sets[g]]), int(starts[sets[g] + 1])
            ranks = holders[a:b].tolist()
            r = min(ranks, key=lambda q: (int(load[q]), q))
            chosen[g] = a + ranks.index(r)
            load[r] += nbytes[g]
        return
    q = holders[idx].astype(np.int64, copy=False)  # holders may be narrower (see ChunkTable)
    v = load[q]
    lens = np.diff(first)
    least = np.repeat(np.minimum.reduceat(v, first[:-1]), lens)
    r = np.minimum.reduceat(np.where(v == least, q, np.iinfo(np.int64).max), first[:-1])
    hit = np.where(q == np.repeat(r, lens), np.arange(len(q)), len(q))
    chosen[groups] = idx[np.minimum.reduceat(hit, first[:-1])]
    load[r] += nbytes[groups]  # each rank at most once (holders disjoint), or adding 0
