"""References: a chunk stored in another checkpoint's data file (incremental saves).

A manifest may list, under ``refs``, data files of *sibling* checkpoints (other
folders under the same parent, the manager's root) whose bytes it uses::

    "refs": {"../step-00000003/r00001-3f9c1d2e8a7b.safetensors": {"size": 1073742080}}

and the index of each of its own data files names, for a chunk it did not write,
where the bytes lie: ``[offset, length, [crc32...], "../step-00000003/r00001-....safetensors"]``.

References are flat: a reference names the data file that physically holds the
bytes, never a manifest, an index or another reference, so a reader follows at
most one hop and there is no chain that could form a cycle. A reference name is
exactly ``../<folder>/<file>.safetensors`` (plain names, no ``.``/``..`` segment),
so it can only reach a sibling folder of the checkpoint: never outside the
manager's root, never the checkpoint's own folder. The bytes are checked against
the CRCs the referring index carries, like any chunk.

Pure: this checks names. Reading through a reference is the load's
(:class:`shardpoint.load.locate.RefView`).
"""

from __future__ import annotations

import re

from ..errors import CorruptCheckpointError

_REF = re.compile(r"^\.\./([A-Za-z0-9_.\-]+)/([A-Za-z0-9_.\-]+\.safetensors)$")


def split_ref(name: object, *, where: str = "manifest") -> tuple[str, str]:
    """``(folder, file)`` of a well-formed reference; raises
    :class:`CorruptCheckpointError` for anything that could leave the manager's root
    or name something other than a data file."""
    m = _REF.match(name) if isinstance(name, str) else None
    if m is None or m.group(1) in (".", "..") or m.group(2) in (".", ".."):
        raise CorruptCheckpointError(
            f"{where}: reference {str(name)[:120]!r} is not '../<step folder>/<data file>.safetensors'; a reference may "
            "only name a data file of a sibling checkpoint under the same root (no '..' beyond the root, no manifest, "
            "index or other metadata). The manifest is damaged or hostile; refusing to follow it"
        )
    return m.group(1), m.group(2)


def is_ref(name: str) -> bool:
    """Whether a chunk's file name is a reference (starts with ``../``)."""
    return name.startswith("../")
