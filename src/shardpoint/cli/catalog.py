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

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..format.pointer import LATEST, STEP_FOLDER, Pointer
from ..health import HealthRule
from ..load.locate import read_manifest
from ..manager import CheckpointInfo, CheckpointManager, referenced_files
from ..storage import Storage, storage_for

__all__ = ["Entry", "Catalog", "catalog", "explain", "shardpoint_files", "referrers"]

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


def explain(path: str, cmd: str) -> tuple[bool, str]:
    """What is at ``path``, a local path that holds no committed checkpoint, in words
    that advise away nothing anyone still needs: a save that never committed
    (incomplete: True), data that kept checkpoints read, a folder of checkpoints,
    another format's checkpoint, anything else, or nothing. ``cmd``: the command
    that was given ``path``, to name in the advice."""
    if not os.path.exists(path):
        return False, f"no checkpoint at {path}: it does not exist"
    if not os.path.isdir(path):
        return False, f"{path} is a file; a shardpoint checkpoint is a folder with a manifest.json{_format_hint(path)}"
    st = storage_for(path)
    parent = st.parent()
    step_folder = STEP_FOLDER.match(os.path.basename(st.url)) is not None
    if step_folder:
        refs = referrers(parent, os.path.basename(st.url))
        if refs:
            return False, (f"{path} is not a checkpoint: it holds the data of a step that retention dropped, which the "
                           f"checkpoints of step(s) {refs} still read (incremental saves). Keep it: retention and "
                           "`shardpoint prune` remove it once no checkpoint refers to it. "
                           f"`shardpoint {cmd}` one of those steps instead")
    if shardpoint_files(st):
        fix = (f"when no save is running, `shardpoint prune {parent.url} --incomplete` removes it (and keeps any data "
               "another checkpoint refers to)" if step_folder else "load an earlier checkpoint")
        return True, (f"{path} is incomplete: it has shardpoint data files but no manifest.json, so its save never "
                      f"committed (or is still writing) and it cannot be loaded; {fix}")
    cat = catalog(st)
    found = [e for e in cat.entries if e.status in (COMMITTED, DAMAGED)]
    if found:
        what = "a CheckpointManager root" if cat.kind == "manager" else "a folder"
        names = ", ".join(e.name for e in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        return False, (f"{path} is not a checkpoint but {what} of {len(found)} checkpoint(s): {names}. Name one, e.g. "
                       f"`shardpoint {cmd} {os.path.join(path, found[-1].name)}`; `shardpoint ls {path}` lists them and "
                       f"`shardpoint verify {path}` verifies each")
    hint = _format_hint(path)
    foreign = [e.name for e in cat.entries if e.status == FOREIGN]
    if foreign:
        hint += (f"; its checkpoint folder(s) {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} are in a "
                 "trainer's own format, not shardpoint's")
    return False, f"no shardpoint checkpoint at {path}: it has no manifest.json and no checkpoint folder below it{hint}"


def _format_hint(path: str) -> str:
    """Which converter reads what is at ``path``, when it looks like another format's checkpoint."""
    if os.path.isfile(path):
        if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
            return f"; a torch.save file converts with `shardpoint convert --from torch {path} DST`"
        if path.endswith(".safetensors"):
            return f"; Hugging Face weights convert with `shardpoint convert --from hf {os.path.dirname(path) or '.'} DST`"
        return ""
    try:
        names = set(os.listdir(path))
    except OSError:
        return ""
    if ".metadata" in names:
        return f"; it is a torch.distributed.checkpoint (DCP) folder: `shardpoint convert --from dcp {path} DST`"
    if "latest" in names and any(n.startswith("global_step") for n in names):
        return f"; it is a DeepSpeed checkpoint folder: `shardpoint convert --from deepspeed {path} DST`"
    if names & {"model.safetensors", "model.safetensors.index.json"}:
        return f"; it holds Hugging Face weights: `shardpoint convert --from hf {path} DST`"
    return ""
