"""Hugging Face safetensors out and in: a tiny GPT-2 trained a step under FSDP2 on
2 ranks and saved with shardpoint exports to weights that ``from_pretrained`` loads
with the trained model's logits (one file, and sharded with an index); weights
written by ``save_pretrained`` (tied lm_head left out) import and resume on 2 ranks;
exporting a checkpoint many shards large keeps memory near one shard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def _config() -> Any:
    return transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=101,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )


def _ids() -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) % 101


def _fsdp_gpt2(world: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_config())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_save(rank: int, world: int, path: str) -> torch.Tensor | None:
    import shardpoint

    model, opt = _fsdp_gpt2(world, seed=0)
    torch.manual_seed(10 + rank)
    ids = torch.randint(0, 101, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    shardpoint.save(shardpoint.TrainState(model=model, optimizer=opt, rng=False), path)
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    return logits if rank == 0 else None


def _resume(rank: int, world: int, path: str) -> tuple[torch.Tensor, float]:
    import shardpoint

    model, opt = _fsdp_gpt2(world, seed=5)
    report = shardpoint.load(shardpoint.TrainState(model=model, rng=False), path)
    assert report.missing == [] and report.unexpected == [], report
    with torch.no_grad():
        logits = model(input_ids=_ids()).logits
    loss = model(input_ids=_ids(), labels=_ids()).loss  # and it trains on
    loss.backward()
    opt.step()
    return logits, float(loss.detach())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("gpt2")
    logits = run_ranks(_train_save, 2, str(root / "sp"), timeout=240)[0]
    _config().save_pretrained(root / "cfg")
    return root, logits


def _hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_export_single_file_loads_with_from_pretrained(trained: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    from shardpoint.interop import export_hf

    root, ref = trained
    files = export_hf(root / "sp", tmp_path / "hf", config=root / "cfg", progress=False)
    assert files == ["model.safetensors", "config.json"]
    assert torch.equal(_hf_logits(tmp_path / "hf"), ref)  # bit for bit


def test_export_sharded_with_index_and_bfloat16(trained: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    import shardpoint
    from shardpoint.interop import export_hf

    root, ref = trained
    files = export_hf(root / "sp", tmp_path / "hf", max_shard_size="100KB", config=root / "cfg", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and files[: len(shards)] == shards and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    meta = shardpoint.metadata(root / "sp")
    assert set(index["weight_map"]) == {k.removeprefix("model/") for k in meta.tensors if k.startswith("model/")}
    for s in shards:  # no file over the limit unless one tensor alone is
        assert (tmp_path / "hf" / s).stat().st_size <= 100_000 + 4096 or len([v for v in index["weight_map"].values() if v == s]) == 1
    assert torch.equal(_hf_logits(tmp_path / "hf"), ref)  # bit for bit

    export_hf(root / "sp", tmp_path / "bf16", dtype="bfloat16", config=root / "cfg", progress=False)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    full = shardpoint.load_full(root / "sp", keys=["model/transformer.wte.weight"])["model"]["transformer.wte.weight"]
    assert model.transformer.wte.weight.dtype == torch.bfloat16
    assert torch.equal(model.transformer.wte.weight, full.to(torch.bfloat16))


def test_save_pretrained_weights_import_and_resume_on_2_ranks(trained: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    from safetensors import safe_open

    from shardpoint.interop import export_hf, import_hf

    root, ref = trained
    export_hf(root / "sp", tmp_path / "hf", config=root / "cfg", progress=False)
    published = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    published.save_pretrained(tmp_path / "pub", max_shard_size="200KB")  # sharded, tied lm_head left out
    with safe_open(str(next((tmp_path / "pub").glob("model-00001-*.safetensors"))), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    import_hf(tmp_path / "pub", tmp_path / "sp", progress=False)
    logits, loss = run_ranks(_resume, 2, str(tmp_path / "sp"), timeout=240)[0]
    assert torch.equal(logits, ref)
    assert loss == loss  # finite: it trained a step


_MEASURE = r"""
import os, sys, threading, time
import shardpoint
from shardpoint.interop import export_hf

page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
shardpoint.metadata(sys.argv[1])
start, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True)
t.start()
export_hf(sys.argv[1], sys.argv[2], prefix="", max_shard_size=int(sys.argv[3]), progress=False)
done.set()
t.join()
print(max(peak[0], rss()) - start)
"""


def test_export_memory_stays_near_one_shard(tmp_path: Path) -> None:
    import shardpoint

    n, numel = 16, 1 << 20  # 16 tensors of 4 MiB: 64 MiB, eight 8 MiB shards
    shardpoint.save({f"layer{i}": torch.full((numel,), float(i)) for i in range(n)}, tmp_path / "sp")
    shard = 8 << 20
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "sp"), str(tmp_path / "hf"), str(shard)],
                         capture_output=True, text=True, timeout=240, cwd=ROOT, check=True)
    peak = int(out.stdout.split()[-1])
    print(f"HF export of {n * numel * 4 >> 20} MiB in {shard >> 20} MiB shards: peak RSS growth {peak / 2**20:.1f} MiB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 8
    # one shard's group of tensors, the reader's buffers for it, and a fixed allowance for the I/O threads and
    # allocator arenas; the whole checkpoint (64 MiB) would be far above
    assert peak < 2 * shard + (16 << 20), f"peak RSS grew by {peak} bytes for 8 MiB shards of a 64 MiB checkpoint"
