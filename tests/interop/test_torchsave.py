"""``torch.save`` files in: a nanoGPT-style checkpoint converts and loads back equal,
into plain objects and into a model and optimizer; a file that needs pickled code is
refused, naming the class and the way out, without running it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch


def _nanogpt_ckpt() -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "model_args": {"n_layer": 1, "n_embd": 8, "vocab_size": 11, "bias": False, "dropout": 0.0},
        "iter_num": 250,
        "best_val_loss": torch.tensor(2.5),
        "config": {"batch_size": 12, "learning_rate": 6e-4, "dataset": "shakespeare_char", "betas": (0.9, 0.95)},
    }
    return ckpt, model, opt


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


def test_nanogpt_checkpoint_converts_and_loads_equal(tmp_path: Path) -> None:
    import shardpoint
    from shardpoint.interop import import_torch

    ckpt, model, opt = _nanogpt_ckpt()
    torch.save(ckpt, tmp_path / "ckpt.pt")
    import_torch(tmp_path / "ckpt.pt", tmp_path / "sp")
    assert _equal(shardpoint.load_full(tmp_path / "sp"), ckpt)

    # and in place, into a fresh model and optimizer, the way a resumed run loads it
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    target = {"model": model2, "optimizer": opt2, "model_args": {}, "iter_num": 0, "best_val_loss": torch.tensor(0.0), "config": {}}
    report = shardpoint.load(target, tmp_path / "sp")
    assert report.missing == []
    assert target["iter_num"] == 250 and target["config"] == ckpt["config"]
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    assert _equal(opt2.state_dict(), opt.state_dict())


@dataclass
class TrainConfig:
    lr: float = 0.1


def test_file_needing_pickled_code_is_refused_with_the_way_out(tmp_path: Path) -> None:
    from shardpoint import ShardpointError
    from shardpoint.interop import import_torch

    torch.save({"model": {"w": torch.ones(2)}, "config": TrainConfig()}, tmp_path / "ckpt.pt")
    with pytest.raises(ShardpointError) as e:
        import_torch(tmp_path / "ckpt.pt", tmp_path / "sp")
    msg = str(e.value)
    assert "needs pickled code to load" in msg and f"{__name__}.TrainConfig" in msg
    assert "weights_only=False" in msg and "torch.save(ckpt, 'plain.pt')" in msg
    assert not (tmp_path / "sp").exists()


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_file_does_not_run(tmp_path: Path) -> None:
    from shardpoint import ShardpointError
    from shardpoint.interop import import_torch

    marker = tmp_path / "ran"
    torch.save({"w": torch.ones(2), "x": _Evil(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(ShardpointError, match="posix.system"):
        import_torch(tmp_path / "evil.pt", tmp_path / "sp")
    assert not marker.exists()


def test_bare_state_dict_under_a_key_loads_into_train_state(tmp_path: Path) -> None:
    import shardpoint
    from shardpoint.interop import import_torch

    src = torch.nn.Linear(3, 2)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    import_torch(tmp_path / "w.pt", tmp_path / "sp", key="model")
    dst = torch.nn.Linear(3, 2)
    shardpoint.load(shardpoint.TrainState(model=dst, rng=False), tmp_path / "sp")
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)


@pytest.mark.parametrize("content", [b"hello, a text file\n", bytes(range(256)) * 8, b"\x80\x02junk, not a pickle",
                                     "cut"])
def test_a_file_that_is_not_a_torch_save_file_is_named_so(tmp_path: Path, content: Any) -> None:
    """A text file, random bytes, a broken pickle and a zip cut in half are refused as
    not (or no longer) a torch.save file, never as 'needs pickled code', and nothing is written."""
    from shardpoint.errors import ConversionError
    from shardpoint.interop import import_torch

    src = tmp_path / "in.pt"
    if content == "cut":
        torch.save({"w": torch.ones(64)}, src)
        content = src.read_bytes()[: src.stat().st_size // 2]
    src.write_bytes(content)
    with pytest.raises(ConversionError, match="in.pt") as e:
        import_torch(src, tmp_path / "sp")
    assert "pickled code" not in str(e.value) and "torch.save" in str(e.value)
    assert not (tmp_path / "sp").exists()
