"""TrainState: one object that owns every part of a training run's state.

It holds *your* objects and restores each of them in place, so nothing has to be
re-bound after a load: ``state.model is model`` before and after, the optimizer
is the same optimizer, and so on. Its key layout (``docs/format.md``) is the one
every integration writes:

    model/<fqn>                        parameters and buffers, canonical names
    optimizer/state/<fqn>/<name>       per-parameter optimizer state
    optimizer/param_groups/<i>/<hp>    hyperparameters; ``params`` lists fqns
    scheduler/...  grad_scaler/...     their state_dict()
    rng/base_seed, rng/streams/...     RNG streams, per rank
    data/...                           a sampler / data loader (per rank unless global)
    extra/<name>/...                   anything else
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .errors import KeyMismatchError, ShardpointError
from .report import LoadReport
from .tree import PerRank, decode_key, is_stateful

_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """Drop the segments that wrappers insert (DDP's ``module.``, torch.compile's
    ``_orig_mod.``, activation checkpointing's wrapper) from a parameter name."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


class TrainState:
    """Everything a training run needs to resume, restored in place.

    Pass it to :func:`shardpoint.save` / :func:`shardpoint.load` or a
    :class:`CheckpointManager`. Every part is optional.

    Args:
        model: an ``nn.Module`` (plain, DDP, ``torch.compile``d, FSDP2) or a DeepSpeed
            engine. Saved under canonical parameter names, so a checkpoint made with
            one wrapping loads into another.
        optimizer: a ``torch.optim`` optimizer over the model's parameters. Loading
            into one that has never stepped creates its state like each parameter
            (no dummy step).
        scheduler: an LR scheduler (anything with ``state_dict``).
        grad_scaler: a ``torch.amp.GradScaler``.
        data: a sampler or data loader with ``state_dict``. Per rank, unless it sets
            ``shardpoint_global_state = True`` (the elastic sampler does).
        rng: True to save and restore Python, NumPy and torch (CPU, CUDA) RNG
            streams per rank; an int does the same and sets the base seed from
            which ranks that did not exist at save time derive their streams
            (``base_seed + 1000003 * rank``, hashed); False to leave RNG alone.
        key_map: for fine-tuning, a dict or callable mapping a checkpoint's parameter
            name to this model's name, applied to ``model/`` and ``optimizer/`` keys.
        **extra: more values (step counters, best metric) or Stateful objects,
            saved under ``extra/<name>``. Plain values are updated on load: read
            them back from ``state.extra[name]``.
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
        data: Any = None,
        rng: bool | int = True,
        key_map: Mapping[str, str] | Callable[[str], str] | None = None,
        **extra: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_scaler = grad_scaler
        self.data = data
        self.rng = rng
        self.key_map = key_map
        self.extra: dict[str, Any] = dict(extra)
        self._load_names: dict[str, str] | None = None  # local fqn -> checkpoint fqn, during a load
        self._created: list[str] = []
        self._no_saved_rng = False  # during a load from a checkpoint saved without RNG streams

    # -- the model -----------------------------------------------------------------
    def _integration(self) -> Any:
        if self.model is not None and type(self.model).__name__ == "DeepSpeedEngine":
            from .integrations import deepspeed as ds

            return ds
        return None

    def _model_state(self) -> dict[str, Any]:
        sd = self.model.state_dict()
        out: dict[str, Any] = {}
        for k, v in sd.items():
            name = canonical_name(k)
            if name in out:
                raise ShardpointError(f"model keys {k!r} and another both map to {name!r}; cannot name them uniquely")
            out[name] = v
        return out

    def _named_params(self) -> dict[int, str]:
        return {id(p): canonical_name(n) for n, p in self.model.named_parameters(remove_duplicate=False)}

    def _ckpt_name(self, fqn: str) -> str:
        return self._load_names.get(fqn, fqn) if self._load_names is not None else fqn

    # -- the optimizer -------------------------------------------------------------
    def _param_fqns(self) -> list[list[tuple[str, Any]]]:
        names = self._named_params() if self.model is not None else {}
        groups = []
        for gi, g in enumerate(self.optimizer.param_groups):
            row = []
            for pi, p in enumerate(g["params"]):
                fqn = names.get(id(p))
                if fqn is None:
                    raise ShardpointError(
                        f"optimizer param_groups[{gi}] parameter {pi} is not a parameter of the model; TrainState names "
                        "optimizer state by the model's parameter names, so pass the model the optimizer trains"
                    )
                row.append((fqn, p))
            groups.append(row)
        return groups

    def _optimizer_state(self) -> dict[str, Any]:
        opt = self.optimizer
        state: dict[str, Any] = {}
        groups = []
        for g, row in zip(opt.param_groups, self._param_fqns()):
            hp = {k: v for k, v in g.items() if k != "params"}
            hp["params"] = [self._ckpt_name(f) for f, _ in row]
            groups.append(hp)
            for fqn, p in row:
                if p in opt.state and opt.state[p]:
                    state[self._ckpt_name(fqn)] = opt.state[p]
        return {"state": state, "param_groups": groups}

    def _prepare_optimizer(self, entries: dict[str, Any], select: Callable[[str], bool]) -> None:
        """Create missing optimizer state like its parameter, for every entry the
        checkpoint has, so it is loaded in place (never a dummy step)."""
        opt = self.optimizer
        for row in self._param_fqns():
            for fqn, p in row:
                prefix = f"optimizer/state/{_esc(self._ckpt_name(fqn))}/"
                names = [k[len(prefix) :] for k in entries if k.startswith(prefix) and "/" not in k[len(prefix) :]]
                st = opt.state.get(p, {})
                for name in names:
                    key = prefix + name
                    if name in st or not select(key):
                        continue
                    st = opt.state[p]  # only now: opt.state is a defaultdict
                    e = entries[key]
                    if e["kind"] == "tensor":
                        dtype = getattr(torch, e["dtype"])
                        if tuple(e["shape"]) == tuple(p.shape):
                            st[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format).detach()
                        else:
                            st[name] = torch.zeros(tuple(e["shape"]), dtype=dtype)
                    else:
                        st[name] = None  # a plain value: filled on load
                    self._created.append(key)

    def _apply_optimizer(self, sd: Mapping[str, Any]) -> None:
        opt = self.optimizer
        saved_groups = sd.get("param_groups")
        rows = self._param_fqns()
        if saved_groups is not None:
            apply_param_groups(opt.param_groups, saved_groups, [[self._ckpt_name(f) for f, _ in row] for row in rows])
        saved_state = sd.get("state") or {}
        for row in rows:
            for fqn, p in row:
                entry = saved_state.get(self._ckpt_name(fqn))
                if entry is not None:
                    for name, v in entry.items():
                        opt.state[p][name] = v

    # -- RNG -------------------------------------------------------------------------
    @staticmethod
    def _rng_streams() -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_state = np.random.get_state(legacy=True)
        out: dict[str, Any] = {
            "python": {"version": version, "state": np.array(internal, dtype=np.int64), "gauss": gauss},
            "numpy": {"kind": np_state[0], "keys": np.asarray(np_state[1]).copy(), "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
        return out

    @staticmethod
    def _set_rng_streams(s: Mapping[str, Any]) -> None:
        py = s["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
        n = s["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
        torch.set_rng_state(torch.as_tensor(s["torch"], dtype=torch.uint8))
        if "cuda" in s and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.as_tensor(x, dtype=torch.uint8) for x in s["cuda"]])

    def _base_seed(self) -> int:
        return 0 if self.rng is True else int(self.rng)

    @staticmethod
    def derived_seed(base_seed: int, rank: int) -> int:
        """The seed a rank that did not exist at save time derives its streams from."""
        return zlib.crc32(f"{base_seed}:{rank}".encode()) * 1000003 % (1 << 63)

    # -- Stateful ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The nested state :func:`shardpoint.save` writes (live tensors, no copies)."""
        ds = self._integration()
        out: dict[str, Any] = {}
        if ds is not None:
            out.update(ds.train_state_parts(self.model))
        elif self.model is not None:
            m = self._model_state()
            out["model"] = {self._ckpt_name(k): v for k, v in m.items()}
        if self.optimizer is not None and ds is None:
            out["optimizer"] = self._optimizer_state()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler
        if self.data is not None:
            out["data"] = self.data if getattr(self.data, "shardpoint_global_state", False) else PerRank(self.data)
        if self.rng is not False and not self._no_saved_rng:
            out["rng"] = {"base_seed": self._base_seed(), "streams": PerRank(self._rng_streams())}
        if self.extra:
            out["extra"] = {k: v for k, v in self.extra.items()}
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Apply what :func:`shardpoint.load` filled in. Tensors were filled in place;
        this sets hyperparameters, plain values and RNG streams."""
        ds = self._integration()
        if ds is not None:
            ds.apply_train_state(self.model, sd)
        elif self.optimizer is not None and "optimizer" in sd:
            self._apply_optimizer(sd["optimizer"])
        rng = sd.get("rng")
        if self.rng is not False and isinstance(rng, Mapping) and isinstance(rng.get("streams"), PerRank):
            # this rank's saved streams, or (a rank new since the save) its current ones;
            # _shardpoint_after_load then derives fresh streams for the latter
            self._set_rng_streams(rng["streams"].value)
        if "extra" in sd:
            for k, v in sd["extra"].items():
                if not is_stateful(self.extra.get(k)):
                    self.extra[k] = v

    # hooks called by shardpoint.load around the generic load
    def _shardpoint_prepare_load(self, entries: dict[str, Any], select: Callable[[str], bool]) -> None:
        self._created = []
        self._load_names = None
        # a checkpoint saved without RNG streams (rng=False, or converted from DeepSpeed)
        # leaves this rank's streams alone instead of failing a strict load
        self._no_saved_rng = not any(k == "rng" or k.startswith("rng/") for k in entries)
        if self.key_map is not None:
            self._load_names = self._map_names(entries)
        ds = self._integration()
        if ds is not None:
            self._created += ds.prepare_train_state(self.model, entries, select) or []
        elif self.optimizer is not None:
            self._prepare_optimizer(entries, select)

    def _shardpoint_loaded(self) -> None:
        ds = self._integration()
        if ds is not None:
            ds.finish_load(self.model)

    def _map_names(self, entries: dict[str, Any]) -> dict[str, str]:
        """local fqn -> checkpoint fqn, from ``key_map`` (checkpoint name -> local name)."""
        km = self.key_map
        out: dict[str, str] = {}
        for k in entries:
            path = decode_key(k)
            if len(path) == 2 and path[0] == "model" and isinstance(path[1], str):
                old = path[1]
                new = km.get(old, old) if isinstance(km, Mapping) else km(old)  # type: ignore[operator, union-attr]
                if new is not None:
                    out[new] = old
        return out

    def _shardpoint_after_load(self, report: LoadReport, rank: int) -> None:
        created = [k for k in self._created if k in report.loaded]
        report.loaded = [k for k in report.loaded if k not in set(created)]
        report.created = sorted(set(report.created) | set(created))
        self._created = []
        self._load_names = None
        if self._no_saved_rng:
            self._no_saved_rng = False
            if self.rng is not False:
                report.per_rank["rng/streams"] = "not in checkpoint"
            return
        if self.rng is False:
            return
        if report.per_rank.get("rng/streams") == "kept":
            seed = self.derived_seed(self._base_seed(), rank)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
            torch.manual_seed(seed)
            report.per_rank["rng/streams"] = "derived"


def apply_param_groups(groups: list[dict[str, Any]], saved: list[Mapping[str, Any]], fqns: list[list[str]]) -> None:
    """Set the saved hyperparameters of each param group, after checking that the
    groups hold the same parameters (by name, in order); raises KeyMismatchError
    naming the first group that differs."""
    if len(saved) != len(groups):
        raise KeyMismatchError(
            f"optimizer: the checkpoint has {len(saved)} param_groups, this optimizer has {len(groups)}; "
            "build the optimizer with the same groups, or exclude=['optimizer']"
        )
    for i, (sg, want) in enumerate(zip(saved, fqns)):
        got = list(sg.get("params", want))
        if got != want:
            raise KeyMismatchError(
                f"optimizer param_groups[{i}] holds {want[:5]}... here but {got[:5]}... in the checkpoint; "
                "the groups must hold the same parameters in the same order"
            )
    for g, sg in zip(groups, saved):
        g.update({k: v for k, v in sg.items() if k != "params"})


def _esc(fqn: str) -> str:
    from .tree import join

    return join("", fqn)
