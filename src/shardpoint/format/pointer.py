"""The ``latest`` pointer of a manager's root: which step folder to resume from, and
which attempt of the job (its generation, :mod:`shardpoint.saving.fence`) pointed it
there. Pure: bytes in, a :class:`Pointer` out, and back.

It is sealed like a manifest (:mod:`.digest`): ``{"latest": "step-00000100",
"step": 100, "generation": 3}``. Pointers written before generations existed carry
``latest`` alone, and the oldest ones are the folder name in plain text; both are
still read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from .digest import is_sealed, seal, unseal

LATEST = "latest"
#: A step folder's name.
STEP_FOLDER = re.compile(r"^step-(\d+)$")
#: The only unsealed pointer read (as written before seals): one step folder name, an optional
#: newline. A sealed pointer starts with '{"seal":' and is ~100 bytes, so no single flipped bit
#: turns it into this.
_LEGACY = re.compile(rb"step-\d{1,20}\n?")


@dataclass(frozen=True, slots=True)
class Pointer:
    """What ``latest`` says: the step folder, and (pointers written with fencing) the
    step and the generation of the attempt that wrote it."""

    folder: str
    generation: int | None = None

    @property
    def step(self) -> int:
        m = STEP_FOLDER.match(self.folder)
        assert m is not None  # checked when parsed or made
        return int(m.group(1))

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {"latest": self.folder, "step": self.step}
        if self.generation is not None:
            doc["generation"] = self.generation
        return seal(json.dumps(doc, separators=(",", ":")).encode())

    @staticmethod
    def parse(data: bytes, where: str, fix: str) -> Pointer:
        """The pointer in ``data``; raises :class:`CorruptCheckpointError` naming
        ``where`` (with ``fix`` appended) when it is damaged."""
        if not is_sealed(data):
            if _LEGACY.fullmatch(data):  # written by a shardpoint without seals
                return Pointer(data.decode().strip())
            raise CorruptCheckpointError(f"{where}: not a checkpoint pointer (no valid seal): the file is damaged. {fix}")
        try:
            doc = json.loads(unseal(data, where, fix=fix))
            name, gen = doc["latest"], doc.get("generation")
        except (ValueError, KeyError, TypeError, AttributeError):
            name, gen = None, None
        if (not isinstance(name, str) or not STEP_FOLDER.match(name)
                or not (gen is None or (isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0))):
            raise CorruptCheckpointError(f"{where}: its seal matches but it names no step folder. {fix}")
        return Pointer(name, gen)
