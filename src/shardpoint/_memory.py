"""A CPU tensor's bytes as a memoryview over its memory, made in C: one slice of a
view of the whole address space, where ``t.numpy().data`` or a ctypes array over
each tensor makes several objects and calls into torch (the load reads into such
views, the save streams from them)."""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["COMPLEX", "bytes_of"]

#: This torch's complex dtypes, the only ones a tensor's conjugate bit applies to (a set
#: lookup, where ``dtype.is_complex`` is a call into torch).
COMPLEX = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_complex)

#: The lowest address :data:`_MEMORY` covers (the page at 0 is never mapped).
_BASE = 4096
#: The bytes :data:`_MEMORY` covers.
_SPAN = sys.maxsize - _BASE
#: The process's memory from address :data:`_BASE` up, as one writable byte view: a
#: tensor's bytes are a slice of it, one object made in C, where a ctypes array over
#: each tensor made three (the array, its view, the cast) at about three times the cost.
_MEMORY = memoryview((ctypes.c_char * _SPAN).from_address(_BASE)).cast("B")


def bytes_of(t: torch.Tensor, n: int | None = None) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, as a flat memoryview over its
    memory (any dtype; a tensor that requires grad needs no detached alias; the bits
    as stored: a caller asks first whether the tensor has its conjugate or negative
    bit set). The view does not keep ``t`` alive: its holder keeps ``t`` while it
    uses the view (a load's read job, a save's writer). ``n``: ``t.nbytes``, where the
    caller has it."""
    if n is None:
        n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    at = t.data_ptr() - _BASE
    if 0 <= at <= _SPAN - n:
        return _MEMORY[at : at + n]
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")  # pragma: no cover - outside it
