"""What checkpoints a folder holds, for the command line (``ls``, ``verify ROOT``,
``prune``, and what ``inspect`` says about a path that is not a checkpoint).

A folder is one of three things: a checkpoint itself (it has a ``manifest.json``); a
:class:`~shardpoint.CheckpointManager` root (``step-N`` folders, ``latest``); or a
folder that holds checkpoints somewhere below it: a trainer's output folder
(Lightning's ``*.ckpt`` folders, the HF Trainer's ``checkpoint-N``, Accelerate's
``checkpoint_N`` or whatever ``save_state`` was given), or several manager roots.
Every step folder of a manager root is listed, whatever state it is in; nothing is
guessed from a folder's name alone that its files contradict.

Statuses: ``committed`` (a sound manifest), ``damaged`` (a manifest whose seal or
contents fail), ``incomplete`` (shardpoint data files and no manifest: a save that
never committed, or is still writing), ``referenced data only`` (a step retention
dropped whose data files kept checkpoints still read: keep it), ``not shardpoint``
(a trainer's checkpoint folder in its own format).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.manifest import MANIFEST_NAME
from .format.pointer import LATEST, STEP_FOLDER, Pointer
from .health import HealthRule
from .load.locate import read_manifest
from .manager import CheckpointInfo, CheckpointManager, referenced_files
from .storage import Storage, storage_for

__all__ = ["Entry", "Catalog", "catalog", "shardpoint_files", "referrers"]

COMMITTED, DAMAGED, INCOMPLETE, REFERENCED, FOREIGN = (
    "committed", "damaged", "incomplete", "referenced data only", "not shardpoint")

#: Folder names trainers give their checkpoints, and where the step is in each:
#: HF Trainer ``checkpoint-500``, Accelerate ``checkpoint_3`` (its automatic naming)
#: and ``step_500`` (shardpoint's own example), Lightning ``epoch=0-step=100.ckpt`` and
#: ``last.ckpt``, DeepSpeed ``global_step100``.
TRAINER_FOLDER = re.compile(r"^(?:checkpoint[-_]\d+|step[-_]\d+|global_step\d+|.+\.ckpt)$")
_STEP_IN_NAME = re.compile(r"^(?:step-|checkpoint[-_]|step_|global_step)(\d+)$|(?:^|[-_])step=(\d+)")
#: The data files and indexes a shardpoint save writes (saving/describe.py, format/index.py).
DATA_FILE = re.compile(r"^r\d{5}-[0-9A-Za-z]+\.(?:safetensors|index\.json)$")
#: How deep ``catalog`` looks for checkpoints under a folder that is neither a checkpoint nor a
#: manager root (Lightning's default ``lightning_logs/version_0/checkpoints/last.ckpt`` is 4 deep),
#: and how many folders it opens at most.
DEPTH, FOLDERS = 4, 2000
_SKIP = {"owners", "__pycache__", "node_modules"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One folder ``shardpoint ls`` lists."""

    name: str
    """Its path relative to the folder listed (``.``: that folder is the checkpoint)."""
    storage: Storage
    step: int | None
    """From its name (``step-N``, ``checkpoint-N``, ``step=N``), else from what it saved; None: unknown."""
    status: str
    info: CheckpointInfo | None = None
    """Committed or damaged: what its manifest says (``info.damaged`` says why it is damaged)."""
    latest: bool = False
    """The one its manager root's ``latest`` names (or the newest, without a ``latest``)."""
    root: Storage | None = None
    """The manager root it is a step folder of (None: not a step folder)."""


@dataclass(slots=True)
class Catalog:
    """What :func:`catalog` found under a folder."""

    storage: Storage
    kind: str
    """``checkpoint`` (the folder is one), ``manager`` (a manager root), ``folder`` (anything else)."""
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Things to say beside the entries (a damaged ``latest``, a walk cut short)."""
    roots: list[Storage] = field(default_factory=list)
    """The manager roots found (the folder itself when ``kind`` is ``manager``)."""


def catalog(path: str | os.PathLike[str] | Storage) -> Catalog:
    """Every checkpoint folder at or under ``path`` (see the module's docstring).

    Raises:
        CheckpointNotFoundError: ``path`` is not a folder.
    """
    st = storage_for(path)
    if "://" not in st.url and not os.path.isdir(st.url):
        what = "is a file, not a folder" if os.path.isfile(st.url) else "does not exist"
        raise CheckpointNotFoundError(f"{st.url} {what}")
    if st.exists(MANIFEST_NAME):
        cat = Catalog(st, "checkpoint")
        cat.entries.append(_checkpoint(st, ".", _step_of(os.path.basename(st.url.rstrip("/")))))
        return cat
    dirs = st.list_dirs()
    if any(STEP_FOLDER.match(n) for n in dirs):
        cat = Catalog(st, "manager")
        _manager(cat, st, "")
        return cat
    cat = Catalog(st, "folder")
    budget = [FOLDERS]
    _walk(cat, st, "", dirs, 1, budget)
    if budget[0] <= 0:
        cat.notes.append(f"stopped looking after {FOLDERS} folders; list a folder further down")
    cat.entries.sort(key=lambda e: (os.path.dirname(e.name), e.step if e.step is not None else -1, e.name))
    return cat


def _walk(cat: Catalog, st: Storage, rel: str, dirs: list[str], depth: int, budget: list[int]) -> None:
    for name in dirs:
        if name.startswith(".") or name in _SKIP or budget[0] <= 0:
            continue
        budget[0] -= 1
        sub, r = _child(st, name), f"{rel}{name}"
        try:
            if sub.exists(MANIFEST_NAME):
                cat.entries.append(_checkpoint(sub, r, _step_of(name)))
                continue
            if TRAINER_FOLDER.match(name):
                status = INCOMPLETE if shardpoint_files(sub) else FOREIGN
                cat.entries.append(Entry(name=r, storage=sub, step=_step_of(name), status=status))
                continue
            if depth >= DEPTH:
                continue
            below = sub.list_dirs()
        except OSError as e:
            cat.notes.append(f"{sub.url} cannot be read ({e})")
            continue
        if any(STEP_FOLDER.match(n) for n in below):
            _manager(cat, sub, r + "/")
        else:
            _walk(cat, sub, r + "/", below, depth + 1, budget)


def _child(st: Storage, name: str) -> Storage:
    """``st/name``, also for a name no checkpoint file may have (Lightning's ``epoch=0-step=100.ckpt``)."""
    try:
        return st.child(name)
    except CorruptCheckpointError:
        return storage_for(f"{st.url}/{name}")


def _manager(cat: Catalog, root: Storage, rel: str) -> None:
    """The step folders of the manager root ``root``: every one, in every state."""
    mgr = CheckpointManager(root)
    cat.roots.append(root)
    found = {i.step: i for i in mgr.list()}  # the manager's own reading: damaged manifests included
    sound = [mgr.step_dir(s) for s, i in found.items() if i.damaged is None]
    needed = referenced_files(root, sound) or {}
    named = _latest(root, cat, rel)
    entries: list[Entry] = []
    for name in root.list_dirs():
        m = STEP_FOLDER.match(name)
        if not m:
            continue
        step, sub = int(m.group(1)), root.child(name)
        info = found.get(step)
        if info is not None:
            status = DAMAGED if info.damaged else COMMITTED
        elif name in needed:
            status = REFERENCED  # retention dropped it; kept checkpoints still read these files
        else:
            status = INCOMPLETE
        entries.append(Entry(name=f"{rel}{name}", storage=sub, step=step, status=status, info=info, root=root))
    if named is not None and (named == -1 or named not in found):  # none, or it names a folder with no manifest
        named = max(found, default=None)
    entries = [Entry(name=e.name, storage=e.storage, step=e.step, status=e.status, info=e.info, root=root,
                     latest=e.step == named and e.info is not None) for e in entries]
    cat.entries += sorted(entries, key=lambda e: e.step if e.step is not None else -1)


def _latest(root: Storage, cat: Catalog, rel: str) -> int | None:
    """The step ``root/latest`` names; -1: there is no ``latest``; None: it is damaged (noted)."""
    if not root.exists(LATEST):
        return -1
    where = f"{root.url}/{LATEST}"
    try:
        return Pointer.parse(bytes(root.read(LATEST)), where, "").step
    except (CorruptCheckpointError, OSError) as e:
        cat.notes.append(f"{rel}{LATEST} is damaged ({str(e).strip()}); a restore raises unless given "
                         "fallback=True, which resumes from the newest sound checkpoint")
        return None


def _checkpoint(sub: Storage, name: str, step: int | None) -> Entry:
    """A folder with a manifest: committed, or damaged (saying why)."""
    try:
        man = read_manifest(sub)
    except CheckpointNotFoundError:  # removed since it was seen
        return Entry(name=name, storage=sub, step=step, status=INCOMPLETE if shardpoint_files(sub) else FOREIGN)
    except (CorruptCheckpointError, OSError) as e:
        info = CheckpointInfo(step=step if step is not None else -1, path=sub.url, time=datetime.fromtimestamp(0, tz=timezone.utc),
                              size=0, world_size=0, damaged=str(e))
        return Entry(name=name, storage=sub, step=step, status=DAMAGED, info=info)
    if step is None:  # Lightning's last.ckpt: the step it saved
        saved = man.tree.values.get("extra/lightning/global_step")
        step = saved if isinstance(saved, int) and not isinstance(saved, bool) else None
    info = CheckpointInfo(
        step=step if step is not None else -1, path=sub.url, time=datetime.fromtimestamp(man.created, tz=timezone.utc),
        size=man.own_bytes(), world_size=man.world_size, referenced=man.referenced_bytes(),
        nonfinite=None if man.nonfinite is None else tuple(man.nonfinite), metrics=dict(man.metrics),
        unfit=HealthRule().unfit(man.nonfinite, man.nan, man.roles), nan=None if man.nan is None else tuple(man.nan),
        roles=dict(man.roles))
    return Entry(name=name, storage=sub, step=step, status=COMMITTED, info=info)


def _step_of(name: str) -> int | None:
    m = _STEP_IN_NAME.search(name)
    return int(m.group(1) or m.group(2)) if m else None


def shardpoint_files(st: Storage) -> list[str]:
    """The shardpoint data files and indexes directly in ``st`` (a save that never
    committed leaves these and no manifest)."""
    if "://" not in st.url:  # local: this folder only, never a walk of what is below it
        try:
            names = [e.name for e in os.scandir(st.url) if e.is_file()]
        except OSError:
            return []
    else:
        names = [n for n in st.list() if "/" not in n]
    return sorted(n for n in names if DATA_FILE.match(n))


def referrers(root: Storage, folder: str) -> list[int]:
    """The steps of the sound committed checkpoints under the manager root ``root``
    whose data lies (in part) in ``root/folder`` (incremental saves); one manifest
    read per step."""
    out = []
    for info in CheckpointManager(root).list():
        name = CheckpointManager.step_dir(info.step)
        if info.damaged is None and name != folder and folder in (referenced_files(root, [name]) or {}):
            out.append(info.step)
    return out
