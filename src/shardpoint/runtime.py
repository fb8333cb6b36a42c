"""Everything shardpoint keeps for the life of a process, in one object.

:data:`PROCESS` is the only mutable state shardpoint holds between calls:

* ``channels``: each process group's checkpoint channel: its call sequence and its
  own gloo groups (:mod:`shardpoint.collective`);
* ``plans``: rank 0's last save plan of each process group (the coordinator reuses
  it when every rank's layout is unchanged);
* ``assignments``: this rank's last assignment in each process group (it sends the
  coordinator only a digest when its layout is unchanged);
* ``in_flight``: the asynchronous save still running, if any (one at a time);
* ``staging`` and ``pool``: the host buffers saves copy through, reused;
* ``seams``: what tests and benchmarks may set or read (phase hooks, counters);
* ``layout_checks``, ``layout_chunks``, ``key_segments`` and ``whole_boxes``: bounded
  memos of pure functions (a manifest layout's check and chunks, a key segment's
  escaping, the box of a whole tensor of a shape), kept across forks: they hold no
  process's resources.

Its lifecycle:

* first use: created empty at import; buffers are allocated by the first save
  that needs them and kept;
* ``fork``: a child (a DataLoader worker) forgets the parent's channels, save in
  flight and plans (:meth:`Process.forget_parent`): they belong to the parent, whose
  gloo threads the child does not have;
* exit: the save in flight gets a grace period to commit before the interpreter
  winds down (:mod:`shardpoint.saving.handle` registers that hook), then the
  checkpoint channels are released (:mod:`shardpoint.collective`).

Test seams and counters are :attr:`Process.seams`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the owner sits below the pipeline that fills it
    pass


@dataclass(slots=True)
class Counters:
    """Bytes the save path moved (tests and benchmarks read and reset them)."""

    host_allocated: int = 0  # host staging bytes allocated (pool slots, staging buffers)
    pooled: int = 0  # bytes copied through the blocking save's pool

    def reset(self) -> None:
        self.host_allocated = self.pooled = 0


@dataclass(slots=True)
class Traffic:
    """Bytes this process received through the checkpoint group's collectives, and
    how many collectives it ran (the scale tests and benchmark read it)."""

    received: int = 0
    ops: int = 0

    def reset(self) -> None:
        self.received = self.ops = 0

    def add(self, nbytes: int) -> None:
        self.received += int(nbytes)
        self.ops += 1


@dataclass(slots=True)
class Seams:
    """The points where tests hold, slow or kill a save deterministically, and the
    counters benchmarks read. Production code only calls them; nothing here changes
    what a save writes."""

    #: Called with each phase boundary of a save ("planned", "written",
    #: "before_commit", "committed"); the failure tests kill a rank there.
    phase: Callable[[str], object] | None = None
    #: Called by the staging copy with "start" before its first byte and "done" after its last.
    copy: Callable[[str], object] | None = None
    #: Route CPU tensors through the blocking save's pool too (``SHARDPOINT_FORCE_POOL=1``):
    #: the path device tensors take, minus the device.
    force_pool: bool = os.environ.get("SHARDPOINT_FORCE_POOL", "") == "1"
    #: Record which floating-point chunks hold NaN or infinity while they are written
    #: (off only to measure what the check costs: benchmarks/health_bench.py).
    health_check: bool = True
    counters: Counters = field(default_factory=Counters)
    #: Counted at the Comm layer for every JSON collective.
    traffic: Traffic = field(default_factory=Traffic)

    def fire_phase(self, name: str) -> None:
        if self.phase is not None:
            self.phase(name)

    def fire_copy(self, name: str) -> None:
        if self.copy is not None:
            self.copy(name)


@dataclass(slots=True)
class Process:
    """The process-wide state of shardpoint (see the module docstring).

    The owner sits below the pipelines that fill it, so it names none of their
    types: each value is typed where it is made and narrowed (``isinstance``)
    where it is read (:mod:`shardpoint.saving`)."""

    #: The checkpoint channel of each process group (collective._Channel), by its tag.
    channels: dict[str, object] = field(default_factory=dict)
    #: Guards ``channels`` and the making of their gloo groups.
    channel_lock: threading.Lock = field(default_factory=threading.Lock)
    plans: dict[str, object] = field(default_factory=dict)  # process group tag -> saving.coordinator.CachedPlan
    assignments: dict[str, object] = field(default_factory=dict)  # tag -> saving.records.HeldAssignment
    in_flight: object | None = None  # saving.handle.SaveHandle
    staging: object | None = None  # saving.buffers.StagingBuffer
    pool: object | None = None  # saving.buffers.Pool
    seams: Seams = field(default_factory=Seams)
    #: Adapters registered by :func:`shardpoint.adapters.register` (dotted class name ->
    #: an Adapter subclass or ``"module:Class"``), and those imported for a name.
    adapters: dict[str, object] = field(default_factory=dict)
    #: Manifest layouts already checked (format.layouts), by layout text: why one is
    #: malformed, or None. Bounded by format.layouts.MEMO_MAX.
    layout_checks: dict[bytes, str | None] = field(default_factory=dict)
    #: Manifest layouts already expanded into their chunks (format.chunks.SavedChunk
    #: tuples, immutable and shared), by layout text.
    layout_chunks: dict[bytes, tuple[object, ...]] = field(default_factory=dict)
    #: State keys' str segments already escaped (tree.encode_key), by segment. Bounded by
    #: tree.SEGMENTS_MAX.
    key_segments: dict[str, str] = field(default_factory=dict)
    #: The box of a whole tensor (layout.local.whole_box: a format.boxes.Box), by shape.
    #: Bounded by layout.local.WHOLE_MAX.
    whole_boxes: dict[tuple[int, ...], object] = field(default_factory=dict)
    #: Whether the exit hook of the save in flight is registered (at the first save or restore).
    exit_hook: bool = False
    #: Per thread: the CUDA copy stream of each device (made on first use).
    cuda_streams: threading.local = field(default_factory=threading.local)

    def forget_plans(self, tag: str | None = None) -> None:
        """Drop the cached plans and assignments of one process group (all when None):
        the next save sends and plans every layout again."""
        if tag is None:
            self.plans.clear()
            self.assignments.clear()
        else:
            self.plans.pop(tag, None)
            self.assignments.pop(tag, None)

    def forget_parent(self) -> None:
        """In a forked child (a DataLoader worker): the parent's channels, save in
        flight and plans are not ours. The child never uses, closes or destroys the
        inherited gloo groups (it does not have their threads)."""
        self.channels.clear()
        self.channel_lock = threading.Lock()  # another thread may have held it at the fork
        self.in_flight = None
        self.forget_plans()


#: The one owner of shardpoint's process-wide state.
PROCESS = Process()
os.register_at_fork(after_in_child=PROCESS.forget_parent)
