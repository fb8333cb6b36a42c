"""Where checkpoints live, chosen by URL scheme: a plain path is the local
filesystem; ``s3://``, ``gs://``, ``memory://`` and other fsspec URLs go through
fsspec (``pip install shardpoint[s3]``)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import UsageError
from ..format.names import check_name
from .base import Storage
from .local import LocalStorage

__all__ = ["Storage", "LocalStorage", "check_name", "storage_for"]


def storage_for(path: str | os.PathLike[str] | Storage, storage_options: dict[str, Any] | None = None) -> Storage:
    """Return the storage for ``path``: a :class:`Storage` as is, a path without a
    scheme (or ``file://``) on the local filesystem, any other URL through fsspec."""
    if isinstance(path, Storage):
        return path
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"a checkpoint location is a path or a URL, not {type(path).__name__} {path!r}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise UsageError(f"a checkpoint location is a path or a URL, not bytes {p!r}: decode it first")
    if "://" in p and not p.startswith("file://"):
        from .fsspec import FsspecStorage  # optional dependency, imported on demand

        return FsspecStorage(p, storage_options=storage_options)
    if p.startswith("file://"):
        p = p[len("file://") :]
    return LocalStorage(p)
