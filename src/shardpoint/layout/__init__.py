"""What a rank holds of each tensor, in global coordinates.

:func:`chunks_of` turns a tensor leaf (a plain tensor, a DTensor, a
:class:`FlatShard`, a numpy array) into its global shape and the boxes this rank
holds, each with the local tensor view that holds its elements.
"""

from __future__ import annotations

from .flat import FlatShard
from .local import LocalChunks, chunks_of

__all__ = ["FlatShard", "LocalChunks", "chunks_of"]
