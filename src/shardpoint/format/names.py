"""The names a manifest may give its files (docs/format.md, section 1): plain
relative paths inside the checkpoint, so that a hostile manifest cannot reach
outside it. Pure: checks the string it is handed."""

from __future__ import annotations

import re

from ..errors import CorruptCheckpointError

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def check_name(name: object) -> str:
    """``name`` if it is a plain relative file name inside the checkpoint; raises
    :class:`CorruptCheckpointError` naming it otherwise."""
    if not isinstance(name, str) or not _NAME.match(name) or any(p in (".", "..") for p in name.split("/")):
        raise CorruptCheckpointError(
            f"file name {name!r} in the manifest is not a plain relative name inside the checkpoint; "
            "the manifest is damaged or hostile, refusing to open it"
        )
    return name
