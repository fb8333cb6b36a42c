"""Offline converters: checkpoints of other tools in and out of shardpoint.

Each reads its source in one process, one file or one group of tensors at a time,
and never runs pickled code:

- :mod:`.deepspeed`: DeepSpeed ZeRO 1-3 checkpoints in (``convert``).
- :mod:`.dcp`: PyTorch Distributed Checkpoint directories in and out
  (``import_dcp``, ``export_dcp``).
- :mod:`.torchsave`: ``torch.save`` files in (``import_torch``).
- :mod:`.hf`: Hugging Face safetensors weights in and out (``import_hf``, ``export_hf``).

``shardpoint convert`` is the command-line form of each. Live engines and trainers
(saving and loading while training) are in :mod:`shardpoint.integrations`.
"""

from __future__ import annotations

from .dcp import export_dcp, import_dcp
from .hf import export_hf, import_hf
from .torchsave import import_torch

__all__ = ["import_dcp", "export_dcp", "import_torch", "import_hf", "export_hf"]
