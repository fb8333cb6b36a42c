"""Skip a trainer test visibly where its framework is missing (or needs a newer
Python); under ``CI=true`` fail instead, so a CI image without it cannot pass silently."""

from __future__ import annotations

import importlib
import os
import sys

import pytest


def need(module: str, min_python: tuple[int, int] | None = None) -> None:
    """Import ``module`` or skip (fail under CI=true) saying why. Below ``min_python``
    the module cannot be installed at all: skip, CI or not."""
    if min_python is not None and sys.version_info < min_python:
        pytest.skip(f"{module} needs Python >= {min_python[0]}.{min_python[1]}")
    try:
        importlib.import_module(module)
    except ImportError as e:
        why = f"{module} cannot be imported ({e}); pip install 'shardpoint[lightning,hf]'"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {why}", pytrace=False)
        pytest.skip(why)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
