"""Health: which tensors a save found holding a NaN or an infinity, what each of them
is, and which of those findings make a checkpoint unfit to resume from.

While a save checksums its bytes it notes each floating-point tensor that holds a
NaN or an infinity, whether a NaN was among them, and the key's *role*:

=============  ====================================================================
``param``      a model parameter (``model/<name>`` of a :class:`~shardpoint.TrainState`)
``buffer``     a model buffer: running statistics, attention masks
``optimizer``  optimizer state (``optimizer/...``): moments, step counts
``extra``      anything else a ``TrainState`` holds: ``extra/...`` (a best-loss
               sentinel), the scheduler, the grad scaler, the data position, RNG
``state``      a key outside any ``TrainState`` (a plain dict saved as is): what it
               is is not known, so it counts like model state
=============  ====================================================================

:class:`HealthRule` decides from these which findings are poison and which are
values: by default a NaN in the model or optimizer state (or in unknown state)
and an infinity in a parameter or optimizer state make a step unfit; an infinity in
a buffer or an extra (``best_val_loss = inf``, a ``-inf`` mask) is recorded only. A
checkpoint saved before roles were recorded counts every finding as a NaN in
unknown state (unfit), as it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from .errors import UsageError
from .tree import matches_prefix

ROLES = ("param", "buffer", "optimizer", "extra", "state")

#: What a chunk held, as a save's write stage notes it.
FINITE, INF, NAN = 0, 1, 2


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthRule:
    """Which non-finite values make a checkpoint unfit to resume from; give one to
    ``CheckpointManager(health=...)``. A step's ``accept=`` predicate overrides the
    verdict either way (it sees it as :attr:`CheckpointInfo.unfit`).

    Example: ``HealthRule(inf=frozenset({"param", "optimizer", "buffer", "state"}))``
    also refuses an infinity in a buffer; ``HealthRule(ignore=("extra",))`` never counts
    anything under ``extra/``.
    """

    nan: frozenset[str] = frozenset({"param", "buffer", "optimizer", "state"})
    """Roles in which a NaN makes a step unfit."""
    inf: frozenset[str] = frozenset({"param", "optimizer", "state"})
    """Roles in which an infinity (and no NaN) makes a step unfit."""
    ignore: tuple[str, ...] = ()
    """Key prefixes (matched on whole ``/`` segments) never counted."""

    def __post_init__(self) -> None:
        for name in ("nan", "inf"):
            got = getattr(self, name)
            if isinstance(got, str) or not isinstance(got, Iterable) or set(got) - set(ROLES):
                raise UsageError(f"HealthRule({name}={got!r}): give a set of roles among {list(ROLES)}")
            object.__setattr__(self, name, frozenset(got))
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise UsageError(f"HealthRule(ignore={self.ignore!r}): give a tuple of key prefixes")

    def unfit(self, nonfinite: Sequence[str] | None, nan: Sequence[str] | None,
              roles: Mapping[str, str]) -> tuple[str, ...]:
        """The keys of ``nonfinite`` that make a step unfit (empty: fit). ``nan``: the
        keys among them with a NaN (None: not recorded, each counts as one); ``roles``:
        each key's role (absent: ``state``)."""
        if not nonfinite:
            return ()
        nans = None if nan is None else set(nan)
        out = []
        for key in nonfinite:
            if self.ignore and matches_prefix(key, self.ignore):
                continue
            role = roles.get(key, "state")
            counted = self.nan if nans is None or key in nans else self.inf
            if role in counted or role not in ROLES:
                out.append(key)
        return tuple(out)


def roles_of(owners: Sequence[tuple[str, object]], keys: Iterable[str]) -> dict[str, str]:
    """The role of each key of ``keys``: asked of the innermost object in ``owners``
    (``(key, object)`` of the state's objects that have a
    ``_shardpoint_health_role(relative_key)`` hook, :class:`~shardpoint.TrainState`'s)
    whose key is a prefix of it; ``state`` when none is."""
    out: dict[str, str] = {}
    inner = sorted(owners, key=lambda ko: -len(ko[0]))
    for key in keys:
        role = "state"
        for prefix, obj in inner:
            if prefix == "" or key.startswith(prefix + "/"):
                rel = key[len(prefix) + 1 :] if prefix else key
                hook: Callable[[str], str] = getattr(obj, "_shardpoint_health_role")  # noqa: B009 - checked by describe
                role = str(hook(rel))
                break
        out[key] = role
    return out
