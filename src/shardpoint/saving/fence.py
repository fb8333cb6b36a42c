"""Fencing: exactly one attempt of a job writes to a manager's root.

Elastic jobs restart: torchrun, Kubernetes and Slurm start a new attempt while the old
one may only be frozen (a stalled or partitioned node) and wake up later. Each attempt
that restores from a root, or first saves into it, *claims* it: it creates
``owners/<generation, 8 digits>`` one above the highest there, with a conditional
create that exactly one claimant wins (a hard link locally, ``If-None-Match: *`` on
S3; :meth:`~shardpoint.storage.Storage.create_new`). Generations only grow, and every
claim is one above an existing one, so "a newer attempt exists" is one look-up:
whether ``owners/<generation + 1>`` exists.

An :class:`Owner` checks that before everything that changes what the root holds: a
save's planning (so a stale attempt writes no data), its commit (before the
manifest), the ``latest`` update and each retention pass; a stale attempt gets
:class:`~shardpoint.errors.FencedError` and writes nothing. The checks are storage
requests of rank 0, never an extra collective round trip.

What remains: a check and the write after it are two requests, so an attempt frozen
in the instant between them (microseconds locally) can still make that one write
when it wakes. A manifest is created with the same conditional create when its folder
held none, which closes that instant for the common case (the newer attempt commits
the same step); ``latest`` and a replaced manifest keep it. On a store without
conditional writes the claim itself is the weaker form (a look-up, the write, a
read-back). docs/guarantees.md states the rule.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from ..errors import FencedError
from ..format.digest import is_sealed, unseal
from ..format.digest import seal as _seal
from ..storage import Storage

#: The folder of a manager's root that holds one record per claim.
OWNERS = "owners"
_RECORD = re.compile(r"^(\d{8,})$")
#: Claims tried before giving up (each lost race moves one generation up).
_TRIES = 64


def record_name(generation: int) -> str:
    """The claim record of ``generation``, relative to the root."""
    return f"{OWNERS}/{generation:08d}"


@dataclass(frozen=True, slots=True)
class Owner:
    """This attempt's claim on ``root``: its ``generation``."""

    root: Storage
    generation: int

    def newer(self) -> bool:
        """Whether a newer attempt claimed the root (one look-up)."""
        return self.root.exists(record_name(self.generation + 1))

    def check(self, doing: str) -> None:
        """Raise :class:`FencedError` (naming the root, both generations and what to
        do) when a newer attempt claimed the root; ``doing`` says what was refused."""
        if self.newer():
            raise self.fenced(doing)

    def fenced(self, doing: str) -> FencedError:
        newest = highest(self.root)
        who = describe_claim(self.root, self.generation + 1)
        return FencedError(
            f"{doing} under {self.root.url} was refused: this attempt of the job (generation {self.generation}) no "
            f"longer owns that root; generation {self.generation + 1} claimed it{who}"
            + (f" (generation {newest} is the newest)" if newest > self.generation + 1 else "")
            + ". A newer attempt (a restart or a requeue of this job) restored from or saved into it, so this one "
            "was presumed dead; nothing was written. Stop this process and let the newer attempt carry on; to make "
            "this process the owner instead, stop the other one, then call restore() on a new CheckpointManager "
            "(which claims the next generation)",
            root=self.root.url, generation=self.generation, newer=max(newest, self.generation + 1))


def highest(root: Storage) -> int:
    """The highest generation claimed under ``root`` (0: none)."""
    best = 0
    for name in root.child(OWNERS).list():
        m = _RECORD.match(name)
        if m:
            best = max(best, int(m.group(1)))
    return best


def claim(root: Storage) -> Owner:
    """Claim ``root`` for this attempt: the next generation, created so that of two
    attempts claiming at once exactly one gets each generation. Not collective (rank
    0 of the attempt calls it). The record names the host, the process and the time,
    for the message a stale attempt gets."""
    for _ in range(_TRIES):
        gen = highest(root) + 1
        body = {"generation": gen, "claimed": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "nonce": uuid.uuid4().hex}
        data = _seal(json.dumps(body, separators=(",", ":")).encode())
        # a store that ignores the condition lets the last writer win: read back to know who did
        if root.create_new(record_name(gen), data) and bytes(root.read(record_name(gen))) == data:
            return Owner(root, gen)
    raise FencedError(f"could not claim {root.url} for this attempt: {_TRIES} other attempts claimed it at the "
                      f"same time (see {root.url}/{OWNERS}/); start one attempt of the job at a time", root=root.url)


def describe_claim(root: Storage, generation: int) -> str:
    """" on host H (pid P) at T" from ``generation``'s record, or "" when unreadable."""
    try:
        data = bytes(root.read(record_name(generation)))
        doc = json.loads(unseal(data, record_name(generation), fix="")) if is_sealed(data) else {}
        when = datetime.fromtimestamp(float(doc["claimed"]), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f" on host {doc['host']} (pid {doc['pid']}) at {when}"
    except Exception:  # noqa: BLE001 - only the message loses its detail
        return ""
