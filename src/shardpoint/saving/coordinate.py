"""Coordinate: every rank's side of planning a save (one round trip to rank 0).

Each rank sends rank 0 the digest of its layout and its plain values, and the
layout itself (structure, chunk boxes) only when it changed since this rank's last
save in the process group; a rank whose structure equals rank 0's leaves the
structure out. Rank 0 plans (:class:`~shardpoint.saving.coordinator.Coordinator`)
and answers each rank with its own assignment only, none when the rank already
holds it from the previous save of the same layout.
"""

from __future__ import annotations

from typing import Any

from ..collective import Comm, coordinate
from ..errors import InternalError
from ..format.manifest import MANIFEST_NAME
from ..runtime import PROCESS
from ..storage import Storage
from .commit import exists_error
from .coordinator import Coordinator, layout_message
from .records import Assignment, Described, HeldAssignment, Planned, SaveOptions


def request_assignment(comm: Comm, storage: Storage, described: Described | None, error: BaseException | None,
                       options: SaveOptions) -> tuple[Planned, Coordinator | None]:
    """This rank's assignment and the save id (collective), and on rank 0 the
    coordinator that will build the manifest. Raises on every rank when any rank
    failed to describe its state, a checkpoint is in the way, a newer attempt owns
    the manager root (nothing is written then), or the plan is refused."""
    coord = Coordinator(comm.tag, comm.world) if comm.rank == 0 else None
    digest, whole = layout_message(described.layout(), None) if described is not None else ("", None)
    # rank 0's structure digest: a rank whose structure is the same (the usual case) leaves its own out
    reference = comm.broadcast_json(whole["sd"] if whole is not None and comm.rank == 0 else None)
    held = PROCESS.assignments.get(comm.tag)
    held = held if isinstance(held, HeldAssignment) else None
    msg = None
    if whole is not None and described is not None:
        lay = dict(whole, s=None) if comm.rank != 0 and whole["sd"] == reference else whole
        same = held is not None and held.digest == digest
        msg = {"digest": digest, "plan": held.plan_id if same and held else None, "layout": None if same else lay,
               "values": described.value_message()}

    def decide(msgs: list[Any]) -> list[Any]:
        assert coord is not None
        if options.owner is not None:
            options.owner().check(options.what)
        if not options.overwrite and storage.exists(MANIFEST_NAME):
            raise exists_error(storage)
        return coord.plan_round(msgs)

    reply = coordinate(comm, msg, error, decide)
    if "resend" in reply:  # rank 0 does not know some layouts (its cache was dropped): those ranks send them
        assert coord is not None or comm.rank != 0
        reply = coordinate(comm, {"layout": whole if reply["resend"] else None}, None,
                           lambda msgs: coord.plan_round(msgs) if coord is not None else [])
    if reply["assign"] is not None:
        assignment = Assignment.from_wire(reply["assign"])
    elif held is not None and held.plan_id == reply["plan_id"]:
        assignment = held.assignment
    else:  # pragma: no cover - the coordinator only omits what it sent
        raise InternalError(f"rank {comm.rank}: the coordinator reused a plan this rank does not hold; save again")
    PROCESS.assignments[comm.tag] = HeldAssignment(digest, reply["plan_id"], assignment)
    return Planned(reply["save_id"], assignment), coord
