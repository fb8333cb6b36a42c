"""A torch-only script that merely imports shardpoint exits 0: FSDP2 over gloo on 4
ranks, ``torch.distributed.checkpoint.save``, then the end of the script, with and
without ``destroy_process_group()``, under torchrun (which reports any rank's
SIGABRT as a failure). Importing shardpoint starts no thread, registers no exit hook
and creates no process group; it must not make such a script die with ``terminate
called without an active exception``.

A soak, not a CI gate: it runs only with ``SHARDPOINT_EXIT_RUNS=N``. The same script
*without* shardpoint imported aborted in 4 of 22 runs on a loaded machine (torch's own
gloo teardown at interpreter exit), so on a shared CI machine a single run can fail
for a reason that is not ours; the soak compares the rates (see the issue notes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._dist import free_port

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.timeout(3600),
    pytest.mark.skipif("SHARDPOINT_EXIT_RUNS" not in os.environ,
                       reason="a soak: torch's own exit aborts now and then without shardpoint too; "
                              "run with SHARDPOINT_EXIT_RUNS=50"),
]

_SCRIPT = textwrap.dedent("""
    import sys
    import shardpoint  # imported, never called
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=sys.argv[1])
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()
    print("done", rank, shardpoint.__name__, flush=True)
""")


@pytest.mark.parametrize("how", ["destroy", "no-destroy"])
def test_a_torch_only_script_that_imports_shardpoint_exits_0(tmp_path: Path, how: str) -> None:
    script = tmp_path / "fsdp_dcp.py"
    script.write_text(_SCRIPT)
    runs = int(os.environ.get("SHARDPOINT_EXIT_RUNS", "1"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    for i in range(runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(script), str(tmp_path / f"dcp{i}"), how]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, f"run {i} ({how}) exited {proc.returncode}:\n{out}\n{err[-4000:]}"
        assert "terminate called" not in err, f"run {i} ({how}):\n{err[-4000:]}"
        assert out.count("done") == 4, out
