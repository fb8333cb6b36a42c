"""Train a small GPT-style language model with FSDP2 on CPU ranks, checkpoint it
with shardpoint, and resume it on any number of ranks with the same global batch.

    torchrun --nproc_per_node 4 examples/train_elastic.py --train-batch-size 32 \\
        --micro-batch-size 4 --steps 40 --checkpoint-every 20 --run-name baseline
    torchrun --nproc_per_node 2 examples/train_elastic.py --train-batch-size 32 \\
        --micro-batch-size 4 --steps 40 --resume --checkpoint-dir runs/baseline/checkpoints \\
        --resume-step 20 --run-name resume-2

The second run does twice the gradient accumulation of the first on half the ranks,
sees exactly the samples the first saw after step 20, and logs the same losses up
to floating-point summation order.

What makes the loss independent of the world size:
- the global batch and its samples come from ``ElasticBatchSampler``, whose position
  is restored by ``TrainState(data=sampler)``;
- each micro-batch's loss is scaled by its share of the global batch (sum of token
  losses / global token count), so accumulated gradients are the global mean;
- the logged loss is the sum of token losses all-reduced over ranks / global count;
- nothing random happens during training (no dropout), and the model is
  initialised identically on every rank before ``fully_shard`` shards it.

Writes ``<out>/<run-name>/losses.jsonl`` (one line per step) and, with
``--log-samples``, ``samples.jsonl`` (each step's sample indices, all ranks).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import shardpoint
from shardpoint.elastic import ElasticBatchSampler

# ---------------------------------------------------------------------------- data


class MarkovText(Dataset):
    """Deterministic synthetic text with structure at two ranges: each token mostly
    follows a fixed random bigram table (a few likely successors per token), and
    with probability ``copy`` it repeats the token ``lag`` positions back. A model
    learns the bigrams first, then (through attention) the copies, so the loss
    falls in stages as a real LM's does. The same on every rank and every run.

    Item ``i`` is ``(i, inputs, targets)``; the index lets the trainer log which
    samples it really consumed."""

    def __init__(self, n: int, seq_len: int, vocab: int, *, seed: int = 1234, copy: float = 0.3, lag: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        probs = torch.softmax(torch.randn(vocab, vocab, generator=g) * 4.0, dim=-1)
        tokens = torch.empty(n, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(1, seq_len + 1):
            nxt = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
            if t >= lag:
                copies = torch.rand(n, generator=g) < copy
                nxt = torch.where(copies, tokens[:, t - lag], nxt)
            tokens[:, t] = nxt
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        row = self.tokens[i]
        return i, row[:-1], row[1:]


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no dropout
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ------------------------------------------------------------------------ training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-batch-size", type=int, default=32, help="global batch: samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per forward/backward per rank")
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps of the run (sets the LR schedule)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="restore from --checkpoint-dir before training")
    p.add_argument("--resume-step", type=int, default=None, help="step to resume from (default: latest)")
    p.add_argument("--no-restore-data", action="store_true",
                   help="restore everything but the data position (a negative control: the sampler restarts)")
    p.add_argument("--run-name", default="run")
    p.add_argument("--out", default="runs", help="runs go to <out>/<run-name>/")
    p.add_argument("--checkpoint-dir", default=None, help="default: <out>/<run-name>/checkpoints")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--log-samples", action="store_true", help="also write each step's sample indices")
    p.add_argument("--dataset-size", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


def build(args: argparse.Namespace, world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)  # the same full model on every rank, then sharded
    model = GPT(args.vocab, args.seq_len, args.dim, args.layers, args.heads)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return model, opt, sched


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.out) / args.run_name
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else run_dir / "checkpoints"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    dataset = MarkovText(args.dataset_size, args.seq_len, args.vocab, seed=1234)
    sampler = ElasticBatchSampler(
        len(dataset), args.train_batch_size, args.micro_batch_size, rank=rank, world_size=world, seed=args.seed
    )
    accum = sampler.accumulation_steps
    model, opt, sched = build(args, world)

    start = 0
    state = manager = None
    if args.checkpoint_every or args.resume:
        state = shardpoint.TrainState(model=model, optimizer=opt, scheduler=sched, data=sampler, rng=True)
        manager = shardpoint.CheckpointManager(ckpt_dir)
    if args.resume:
        assert manager is not None and state is not None
        exclude = ["data"] if args.no_restore_data else None
        report = manager.restore(state, step=args.resume_step, exclude=exclude)
        if report is None:
            raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
        start = report.step
        if rank == 0:
            print(f"resumed step {start} from {ckpt_dir} on {world} ranks: epoch {sampler.epoch}, "
                  f"offset {sampler.offset}, {accum} micro-batches of {args.micro_batch_size} per rank per step",
                  flush=True)

    # made after the restore, so the iterator starts at the restored position
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.num_workers,
                        prefetch_factor=4 if args.num_workers else None)
    batches = iter(loader)

    def next_micro_batch():  # type: ignore[no-untyped-def]
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:  # end of an epoch; a new iterator continues from the sampler's position
            batches = iter(loader)
            return next(batches)

    tokens_per_step = args.train_batch_size * args.seq_len
    log = open(run_dir / "losses.jsonl", "w") if rank == 0 else None  # noqa: SIM115
    samples_log = open(run_dir / "samples.jsonl", "w") if rank == 0 and args.log_samples else None  # noqa: SIM115
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        loss_sum = torch.zeros((), dtype=torch.float64)
        seen: list[int] = []
        for i in range(accum):
            idx, x, y = next_micro_batch()
            model.set_requires_gradient_sync(i == accum - 1)  # reduce-scatter once per step
            token_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            # FSDP averages gradients over ranks; scale so the result is the global-batch mean
            (token_loss * (world / tokens_per_step)).backward()
            loss_sum += token_loss.detach().double()
            seen += idx.tolist()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sampler.step()

        dist.all_reduce(loss_sum)
        loss = (loss_sum / tokens_per_step).item()
        all_seen: list[list[int]] = [[] for _ in range(world)] if args.log_samples else []
        if args.log_samples:
            dist.all_gather_object(all_seen, seen)
        if rank == 0:
            assert log is not None
            log.write(json.dumps({"step": step + 1, "loss": loss, "lr": sched.get_last_lr()[0], "world_size": world,
                                  "accumulation": accum, "epoch": sampler.epoch,
                                  "elapsed_s": round(time.perf_counter() - t0, 3)}) + "\n")
            log.flush()
            if samples_log is not None:
                samples_log.write(json.dumps({"step": step + 1, "samples": sorted(i for s in all_seen for i in s)}) + "\n")
                samples_log.flush()
            if (step + 1) % 10 == 0 or step + 1 == args.steps:
                print(f"step {step + 1:4d}  loss {loss:.4f}  ({world} ranks x {accum} x {args.micro_batch_size})",
                      flush=True)
        if manager is not None and args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            manager.save(state, step + 1)

    if log is not None:
        log.close()
    if samples_log is not None:
        samples_log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
