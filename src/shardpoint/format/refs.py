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
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CorruptCheckpointError
from ..storage.base import Delegating, Storage

_REF = re.compile(r"^\.\./([A-Za-z0-9_.\-]+)/([A-Za-z0-9_.\-]+\.safetensors)$")


def split_ref(name: Any, *, where: str = "manifest") -> tuple[str, str]:
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


class RefView(Delegating):
    """The checkpoint's storage, where a reference name (``../<folder>/<file>``)
    reads from the sibling folder instead; every other name goes to ``inner``.
    Read-only for references; writes go to ``inner``."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._own = inner.url.rstrip("/").rsplit("/", 1)[-1]
        self._siblings: dict[str, Storage] = {}

    def _resolve(self, name: str) -> tuple[Storage, str]:
        if not is_ref(name):
            return self.inner, name
        folder, fname = split_ref(name, where=f"{self.url}/manifest.json")
        if folder == self._own:
            raise CorruptCheckpointError(
                f"{self.url}: reference {name!r} points into the checkpoint's own folder; a reference must name "
                "another checkpoint. The manifest is damaged or hostile"
            )
        s = self._siblings.get(folder)
        if s is None:
            s = self._siblings[folder] = self.inner.parent().child(folder)
        return s, fname

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        s, n = self._resolve(name)
        try:
            return s.read(n, offset, length)
        except FileNotFoundError:
            raise _missing(self.url, name) from None

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        s, n = self._resolve(name)
        try:
            s.read_into(n, offset, buf)
        except FileNotFoundError:
            raise _missing(self.url, name) from None

    def exists(self, name: str) -> bool:
        s, n = self._resolve(name)
        return s.exists(n)

    def size(self, name: str) -> int:
        s, n = self._resolve(name)
        return s.size(n)


def _missing(url: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: the referenced data file {name!r} is missing: the checkpoint it belongs to was deleted by hand (retention "
        "never deletes referenced data). Restore that folder, or load another checkpoint"
    )


def with_refs(storage: Storage, manifest: Any) -> Storage:
    """``storage`` able to read the manifest's references (as is when it has none)."""
    if not getattr(manifest, "refs", None) or isinstance(storage, RefView):
        return storage
    return RefView(storage)
