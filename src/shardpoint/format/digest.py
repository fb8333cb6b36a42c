"""The seal: a digest that a metadata document carries at a fixed place, checked
before anything in the document is trusted.

A sealed document is a JSON object whose first member is the seal::

    {"seal":"<algorithm>:<lower-case hex digits>",<the members of the body>}

where the digest is of the *body*: the same document without that first member,
that is ``b"{" + sealed[header_len:]``. Two algorithms: ``crc32`` (8 hex digits,
the CRC-32 that the data files' chunks carry; a manifest of format version 3) and
``sha256`` (64 hex digits; a manifest of version 2, the manager's ``latest`` pointer,
the fence's records). The sealed file stays valid JSON (``jq`` and ``json.load``
read it; readers that do not check ignore an unknown ``seal`` field), and the seal
sits at a fixed byte range for its algorithm, so checking it needs no parsing:
compare a fixed prefix, read the hex digits, digest the rest.

Why this detects any single flipped bit (``tests/failure/test_bitflip.py`` flips
every one): a flip in the body changes its digest (a CRC-32 detects every error of
up to 32 consecutive bits, a single flip among them); a flip in the hex digits
changes the expected digest (or makes it not lower-case hex); a flip in the fixed
text around them breaks the prefix (no flip turns one algorithm's prefix into the
other's), so the document is not sealed, and a caller that still reads an older
unsealed form accepts that form only when the (unflipped) body says it is that
older form, which a sealed body never does (a sealed manifest says ``"version":2``
or ``3``; see :meth:`shardpoint.format.manifest.Manifest.parse`).

:func:`seal` and :func:`unseal` (or :func:`check_seal`) are the whole API; any metadata object the
format adds (a manifest, the manager's ``latest`` pointer, per-file indexes)
seals itself with them. :func:`content_digest` and :func:`digest_matches` name and
check the digest a manifest records for an index object.
"""

from __future__ import annotations

import hashlib

from ..errors import CorruptCheckpointError, UsageError
from .datafile import crc32 as _crc32  # the format's CRC-32 (zlib's, computed by zlib-ng)

__all__ = ["ALGORITHM", "SEAL_HEADER_LEN", "check_seal", "content_digest", "digest_matches", "is_sealed", "seal",
           "seal_algorithm", "unseal"]

#: The digest algorithm of a seal by default (the ``latest`` pointer, the fence's records).
ALGORITHM = "sha256"
#: The algorithm of a version-3 manifest's seal and of its index digests.
CRC32 = "crc32"
#: Hex digits of each algorithm's digest.
_HEX_LENS = {"sha256": 64, "crc32": 8}
_PREFIXES = {alg: b'{"seal":"' + alg.encode() + b":" for alg in _HEX_LENS}
#: Bytes before a ``sha256`` seal's body: the prefix, the hex digest and ``",``.
SEAL_HEADER_LEN = len(_PREFIXES["sha256"]) + 64 + 2
_HEX = frozenset(b"0123456789abcdef")


def _hex_of(algorithm: str, data: bytes | memoryview, head: bytes = b"") -> str:
    """The lower-case hex digest of ``head + data``."""
    if algorithm == "crc32":
        return f"{_crc32(data, _crc32(head)) if head else _crc32(data):08x}"
    h = hashlib.sha256(head)
    h.update(data)
    return h.hexdigest()


def seal(body: bytes, algorithm: str = ALGORITHM) -> bytes:
    """``body`` (the UTF-8 bytes of a non-empty JSON object, as the writer emits
    them) with its seal (``algorithm``: ``sha256`` or ``crc32``) inserted as the
    object's first member."""
    body = bytes(body)
    if not body.startswith(b"{") or body[1:].lstrip()[:1] in (b"}", b""):
        raise UsageError("seal() takes the bytes of a non-empty JSON object starting with '{'; this is a bug in the caller")
    if algorithm not in _PREFIXES:
        raise UsageError(f"seal(): unknown algorithm {algorithm!r} (sha256 or crc32)")
    return _PREFIXES[algorithm] + _hex_of(algorithm, body).encode() + b'",' + body[1:]


def seal_algorithm(data: bytes | memoryview) -> str | None:
    """The algorithm ``data`` starts like it is sealed with (its seal is not checked), or None."""
    head = bytes(data[:16])
    for alg, prefix in _PREFIXES.items():
        if head.startswith(prefix):
            return alg
    return None


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` starts like a sealed document (its seal is not checked)."""
    return seal_algorithm(data) is not None


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
    n = check_seal(data, where, fix=fix)
    return b"{" + data[n:]


def check_seal(data: bytes, where: str, *, fix: str = "") -> int:
    """Check the seal of the sealed document ``data`` (raises as :func:`unseal`),
    digesting its body where it lies, with no copy of it; returns where the body's
    members begin (the length of the seal's header). A sealed document is itself
    valid JSON, so a reader that checked the seal may decode ``data`` whole (its
    ``seal`` member is one field more) instead of the body :func:`unseal` makes."""
    tail = f" {fix}" if fix else ""
    alg = seal_algorithm(data)
    if alg is None:
        raise CorruptCheckpointError(
            f"{where}: has no valid seal (it must start with {_PREFIXES['crc32'].decode()!r} or "
            f"{_PREFIXES['sha256'].decode()!r}): the file is damaged or was not written by shardpoint.{tail}"
        )
    start = len(_PREFIXES[alg])
    end = start + _HEX_LENS[alg]
    hexd = bytes(data[start:end])
    if len(hexd) != _HEX_LENS[alg] or not _HEX.issuperset(hexd) or data[end : end + 2] != b'",':
        raise CorruptCheckpointError(
            f"{where}: its seal is malformed (not {_HEX_LENS[alg]} hex digits and '\",'): the file is damaged.{tail}")
    if _hex_of(alg, memoryview(data)[end + 2 :], b"{").encode() != hexd:
        name = "CRC-32" if alg == "crc32" else "SHA-256"
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: its {name} differs from the one sealed into it when it was written, so the "
            f"file is damaged (a flipped bit, a torn copy) and nothing in it was used.{tail}"
        )
    return end + 2


def content_digest(data: bytes | memoryview, algorithm: str = CRC32) -> str:
    """The digest a manifest records for an index object, named: ``crc32:<8 hex>``
    (version 3) or ``sha256:<64 hex>`` (version 2)."""
    return f"{algorithm}:{_hex_of(algorithm, data)}"


def digest_matches(named: str, data: bytes | memoryview) -> bool:
    """Whether ``data`` has the digest ``named`` (:func:`content_digest`'s form)."""
    alg, _, _ = named.partition(":")
    return alg in _HEX_LENS and content_digest(data, alg) == named


class Digester:
    """A :func:`content_digest` of bytes fed piece by piece (a copy that checks what it copied)."""

    def __init__(self, named: str) -> None:
        self.algorithm = named.partition(":")[0]
        if self.algorithm not in _HEX_LENS:
            raise CorruptCheckpointError(f"unknown digest {named[:40]!r} (sha256 or crc32)")
        self._sha = hashlib.sha256() if self.algorithm == "sha256" else None
        self._crc = 0

    def update(self, data: bytes | memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = _crc32(data, self._crc)

    def named(self) -> str:
        """The digest of everything fed, named as :func:`content_digest` names it."""
        return f"sha256:{self._sha.hexdigest()}" if self._sha is not None else f"crc32:{self._crc:08x}"
