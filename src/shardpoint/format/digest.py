"""The seal: a SHA-256 digest that a metadata document carries at a fixed place,
checked before anything in the document is trusted.

A sealed document is a JSON object whose first member is the seal::

    {"seal":"sha256:<64 lower-case hex digits>",<the members of the body>}

where the digest is SHA-256 of the *body*: the same document without that first
member, that is ``b"{" + sealed[SEAL_HEADER_LEN:]``. The sealed file stays valid
JSON (``jq`` and ``json.load`` read it; readers that do not check ignore an
unknown ``seal`` field), and the seal sits at a fixed byte range, so checking it
needs no parsing: compare a fixed prefix, read 64 hex digits, hash the rest.

Why this detects any single flipped bit (``tests/failure/test_bitflip.py`` flips
every one): a flip in the body changes its digest; a flip in the hex digits
changes the expected digest (or makes it not hex); a flip in the fixed text
around them breaks the prefix, so the document is not sealed, and a caller that
still reads an older unsealed form accepts that form only when the (unflipped)
body says it is that older form, which a sealed body never does (a sealed
manifest says ``"version":2``; see :meth:`shardpoint.format.manifest.Manifest.parse`).

:func:`seal` and :func:`unseal` (or :func:`check_seal`) are the whole API; any metadata object the
format adds (a manifest, the manager's ``latest`` pointer, per-file indexes)
seals itself with them.
"""

from __future__ import annotations

import hashlib

from ..errors import CorruptCheckpointError, UsageError

__all__ = ["ALGORITHM", "SEAL_HEADER_LEN", "check_seal", "is_sealed", "seal", "unseal"]

#: The digest algorithm, as named in the seal.
ALGORITHM = "sha256"
_PREFIX = b'{"seal":"' + ALGORITHM.encode() + b":"
_HEX_LEN = 64
#: Bytes before the body's members: the prefix, the hex digest and ``",``.
SEAL_HEADER_LEN = len(_PREFIX) + _HEX_LEN + 2
_HEX = frozenset(b"0123456789abcdef")


def seal(body: bytes) -> bytes:
    """``body`` (the UTF-8 bytes of a non-empty JSON object, as the writer emits
    them) with its seal inserted as the object's first member."""
    body = bytes(body)
    if not body.startswith(b"{") or body[1:].lstrip()[:1] in (b"}", b""):
        raise UsageError("seal() takes the bytes of a non-empty JSON object starting with '{'; this is a bug in the caller")
    return _PREFIX + hashlib.sha256(body).hexdigest().encode() + b'",' + body[1:]


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` starts like a sealed document (its seal is not checked)."""
    return bytes(data[: len(_PREFIX)]) == _PREFIX


def unseal(data: bytes, where: str, *, fix: str = "") -> bytes:
    """The body of the sealed document ``data``, after checking its seal
    (:func:`check_seal`).

    Args:
        data: the document's bytes as read.
        where: the file, for messages (``.../manifest.json``).
        fix: what the user can do about damage, appended to the message.

    Raises:
        CorruptCheckpointError: ``data`` is not sealed, its seal is malformed, or
            the body's digest differs from the seal's (the file is damaged:
            nothing in it may be used).
    """
    data = bytes(data)
    check_seal(data, where, fix=fix)
    return b"{" + data[SEAL_HEADER_LEN:]


def check_seal(data: bytes, where: str, *, fix: str = "") -> None:
    """Check the seal of the sealed document ``data`` (raises as :func:`unseal`),
    hashing its body where it lies, with no copy of it. A sealed document is itself
    valid JSON, so a reader that checked the seal may decode ``data`` whole (its
    ``seal`` member is one field more) instead of the body :func:`unseal` makes."""
    tail = f" {fix}" if fix else ""
    if not is_sealed(data):
        raise CorruptCheckpointError(
            f"{where}: has no valid seal (it must start with {_PREFIX.decode()!r}): the file is damaged or was not "
            f"written by shardpoint.{tail}"
        )
    hexd = bytes(data[len(_PREFIX) : len(_PREFIX) + _HEX_LEN])
    if len(hexd) != _HEX_LEN or not _HEX.issuperset(hexd) or data[len(_PREFIX) + _HEX_LEN : SEAL_HEADER_LEN] != b'",':
        raise CorruptCheckpointError(f"{where}: its seal is malformed (not 64 hex digits and '\",'): the file is damaged.{tail}")
    h = hashlib.sha256(b"{")
    h.update(memoryview(data)[SEAL_HEADER_LEN:])
    if h.hexdigest().encode() != hexd:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: its SHA-256 differs from the one sealed into it when it was written, so the "
            f"file is damaged (a flipped bit, a torn copy) and nothing in it was used.{tail}"
        )
