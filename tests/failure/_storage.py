"""Storage wrappers that fail on purpose: a disk that fills up after a byte
budget, and a storage that kills its process in the middle of writing a file."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

from shardpoint.storage import Storage
from shardpoint.storage.base import Delegating


class Wrapper(Delegating):
    """Delegates everything to ``inner``; ``child`` wraps the child the same way."""

    def __init__(self, inner: Storage, **options: Any) -> None:
        super().__init__(inner)
        self.options = options

    def _wrap(self, inner: Storage) -> Wrapper:
        w = type(self)(inner, **self.options)
        w.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("inner", "url")})
        return w

    def child(self, name: str) -> Storage:
        return self._wrap(self.inner.child(name))


class Budget:
    """Bytes left on the pretend disk, shared by a storage and its children."""

    def __init__(self, left: int | None = None) -> None:
        self.left = left  # None: unlimited

    def take(self, n: int, name: str) -> int:
        """Take up to ``n`` bytes; raise ENOSPC (naming ``name``) when none are left."""
        if self.left is None:
            return n
        if self.left <= 0 and n > 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        got = min(n, self.left)
        self.left -= got
        return got


class FullDisk(Wrapper):
    """Raises ``OSError(ENOSPC)`` once ``budget`` bytes have been written (data files
    and atomic writes alike), after writing what fitted, as a real disk does."""

    def __init__(self, inner: Storage, budget: Budget | None = None) -> None:
        super().__init__(inner)
        self.budget = budget or Budget()

    def _wrap(self, inner: Storage) -> Wrapper:
        return FullDisk(inner, self.budget)

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        where = f"{self.url}/{name}"

        def metered() -> Iterator[bytes | memoryview]:
            for part in parts:
                view = memoryview(part).cast("B")
                got = self.budget.take(len(view), where)
                yield view[:got]
                if got < len(view):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)

        return self.inner.write_file(name, metered())

    def write_atomic(self, name: str, data: bytes) -> None:
        if self.budget.take(len(data), f"{self.url}/{name}") < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{self.url}/{name}")
        self.inner.write_atomic(name, data)


class KillMidWrite(Wrapper):
    """SIGKILLs its own process after writing half the parts of its ``nth`` data
    file (counting from 1 over the whole process)."""

    count = 0

    def __init__(self, inner: Storage, nth: int = 1) -> None:
        super().__init__(inner)
        self.nth = nth

    def _wrap(self, inner: Storage) -> Wrapper:
        return KillMidWrite(inner, self.nth)

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        if not name.endswith(".safetensors"):  # a data file's index object: not counted
            return self.inner.write_file(name, parts)
        KillMidWrite.count += 1
        if KillMidWrite.count != self.nth:
            return self.inner.write_file(name, parts)
        parts = list(parts)  # the data file's header, then one part per tensor or CRC block
        assert len(parts) >= 2, "a mid-write kill needs a file of at least two parts"

        def then_die() -> Iterator[bytes | memoryview]:
            for i, p in enumerate(parts):
                if i == len(parts) // 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield p

        return self.inner.write_file(name, then_die())
