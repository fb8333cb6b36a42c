"""``torch.save`` files in: the checkpoints of nanoGPT and most research code.

The file is read with ``torch.load(weights_only=True, mmap=True)``: tensors and
plain containers and values only, memory-mapped (the file's pages, not a copy of
them), and no pickled code is run. A file that needs a class to load (an
``argparse.Namespace``, a dataclass config, a whole pickled model) is refused with
the names of the classes, before any of them is imported.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CheckpointNotFoundError, ConversionError, UnsupportedCheckpointError

if TYPE_CHECKING:
    from ..api import PathLike

__all__ = ["import_torch", "read_torch"]


def read_torch(path: str | os.PathLike[str]) -> Any:  # Any: what the file holds, as torch.load returns it
    """``torch.load`` the file at ``path`` with weights only and memory-mapped.

    Raises:
        UnsupportedCheckpointError: the file needs pickled code (names the classes and what to do).
        ConversionError: the file is not a ``torch.save`` file, or a damaged one.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"no torch.save file at {path}")
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive (since 1.6) or, in the legacy format, a pickle
    # (protocol 2 and up starts with the PROTO opcode, 0x80)
    if head != b"PK\x03\x04" and head[:1] != b"\x80":
        raise ConversionError(f"{path} is not a torch.save file (it is neither a zip archive nor a pickle: it "
                              f"starts with {head!r}); give the file torch.save wrote, or pick the right "
                              "--from (hf, deepspeed, dcp)")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # the legacy (pre-1.6, non-zip) format cannot be memory-mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            bad = list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - fall back to the names in torch's message
            bad = re.findall(r"GLOBAL ([\w.]+)", str(e))
        if not bad:  # nothing names a class: the pickle itself is broken
            raise _damaged(path, e) from None
        names = ", ".join(bad)
        raise UnsupportedCheckpointError(
            f"{path} needs pickled code to load: it contains {names}, and unpickling a class can run arbitrary "
            "code, so shardpoint reads only tensors and plain values (dict, list, tuple, int, float, str, bool, "
            "None). If you trust the file, re-save it with plain types, e.g.\n"
            f"    ckpt = torch.load({path!r}, weights_only=False)\n"
            "    ckpt['config'] = vars(ckpt['config'])  # each object named above -> a dict (or drop it)\n"
            "    torch.save(ckpt, 'plain.pt')\n"
            "and convert plain.pt"
        ) from None
    except (KeyError, IndexError, EOFError, ValueError, RuntimeError, OSError) as e:
        raise _damaged(path, e) from None


def _damaged(path: str, e: BaseException) -> ConversionError:
    return ConversionError(f"{path} cannot be read as a torch.save file ({type(e).__name__}: {e}); it is "
                           "damaged or cut short, or not a torch.save file; check the file (its size, its "
                           "copy) and give the one torch.save wrote")


def import_torch(src: str | os.PathLike[str], dst: PathLike, *, key: str | None = None, overwrite: bool = False,
                 storage_options: dict[str, Any] | None = None) -> None:
    """Convert the ``torch.save`` file ``src`` into a shardpoint checkpoint at ``dst``.

    The saved object keeps its nesting: ``{"model": sd, "optimizer": osd,
    "iter_num": 5}`` gives keys ``model/<name>``, ``optimizer/state/0/exp_avg``,
    ``iter_num``, and ``shardpoint.load_full(dst)`` returns an equal object (tuples
    and lists as saved). One process; the file is memory-mapped, not copied.

    Args:
        key: put the object under this top-level key (``key="model"`` for a bare
            state dict, so ``TrainState(model=...)`` finds it under ``model/``).

    Raises:
        ShardpointError: the file needs pickled code (see :func:`read_torch`).
    """
    from ..api import save_offline

    obj = read_torch(src)
    if key is not None:
        obj = {key: obj}
    save_offline([(0, obj)], dst, world_size=1, overwrite=overwrite, storage_options=storage_options)
