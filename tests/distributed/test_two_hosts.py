"""Two hosts on one machine: two network namespaces joined by a veth pair, one
torchrun node in each (``--nnodes 2``, c10d rendezvous across the link), 2 ranks
per host. They save to a directory both see and to the S3 server (moto, listening
on the first host's address); then 1 host x 3 ranks loads both, byte for byte.

Needs root and ``ip netns``. If a namespace cannot be made, the test fails under
``CI=true`` with the reason and is skipped (visibly) elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.s3server import KEY, REGION, SECRET

pytestmark = [pytest.mark.distributed, pytest.mark.s3]
ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
IFACE = "sp0"  # the veth end's name inside each namespace
LIMIT = 300.0  # seconds for any one step (namespaces, server, a torchrun job)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the two-host test cannot run in CI (CI=true): {reason}", pytrace=False)
    pytest.skip(f"two hosts unavailable here: {reason}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def two_hosts() -> Iterator[dict[str, str]]:
    """Namespaces ``a`` and ``b`` (unique names), linked by a veth pair with the
    addresses of :data:`ADDR`; every process left in them is killed and both are
    deleted on exit."""
    tag = f"sp{os.getpid()}{uuid.uuid4().hex[:4]}"
    ns = {"a": f"{tag}a", "b": f"{tag}b"}
    made: list[str] = []
    try:
        try:
            if shutil.which("ip") is None:
                raise OSError("the `ip` command (iproute2) is not installed")
            for h in ("a", "b"):
                _ip("netns", "add", ns[h])
                made.append(ns[h])
            _ip("link", "add", f"v{tag}a"[:15], "type", "veth", "peer", "name", f"v{tag}b"[:15])
            for h in ("a", "b"):
                _ip("link", "set", f"v{tag}{h}"[:15], "netns", ns[h])
                _ip("-n", ns[h], "link", "set", f"v{tag}{h}"[:15], "name", IFACE)
                _ip("-n", ns[h], "addr", "add", f"{ADDR[h]}/24", "dev", IFACE)
                _ip("-n", ns[h], "link", "set", IFACE, "up")
                _ip("-n", ns[h], "link", "set", "lo", "up")
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or ""
            _unavailable(f"{e} {detail}".strip())
        yield ns
    finally:
        for name in made:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)  # takes the veth with it


def _in(ns: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _finish(procs: list[subprocess.Popen[bytes]], logs: list[Path], what: str) -> None:
    deadline = time.monotonic() + LIMIT
    try:
        for p, log in zip(procs, logs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{what} did not finish within {LIMIT:g}s; {log}:\n{log.read_text()[-3000:]}")
            assert rc == 0, f"{what} exited {rc}; {log}:\n{log.read_text()[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait(timeout=30)


def _torchrun(nnodes: int, host: str, port: int, job: str, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node",
            "2" if nnodes == 2 else "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR['a']}:{port}",
            "--rdzv-id", job, "--local-addr", ADDR[host], "--max-restarts", "0",
            # the store's host cannot tell 10.77.0.1 is its own from its host name: say so
            "--rdzv-conf", f"is_host={int(host == 'a')},join_timeout={int(LIMIT)}",
            "-m", "tests.distributed._two_hosts_worker", *argv]


def _bucket(endpoint: str) -> str:
    import boto3

    name = f"sp-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET)
    client.create_bucket(Bucket=name)
    return name


def test_save_on_two_hosts_load_on_one(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("moto") is None:
        _unavailable("moto[server] is not installed (the S3 server of the test)")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFACE,
               PYTHONPATH=os.pathsep.join([str(repo), *sys.path]), NO_PROXY="*", no_proxy="*")
    env.pop("AWS_ENDPOINT_URL", None)
    out = tmp_path / "out"
    out.mkdir()
    with two_hosts() as ns:
        s3_port = 9000
        endpoint = f"http://{ADDR['a']}:{s3_port}"
        server = _in(ns["a"], [sys.executable, "-m", "moto.server", "-H", ADDR["a"], "-p", str(s3_port)], env,
                     tmp_path / "moto.log")
        try:
            deadline = time.monotonic() + 60
            while True:  # the server answers inside namespace a only: ask from there
                probe = subprocess.run(
                    ["ip", "netns", "exec", ns["b"], sys.executable, "-c",
                     f"import urllib.request; urllib.request.urlopen('{endpoint}/moto-api/data.json', timeout=2)"],
                    capture_output=True, timeout=60, env=env)
                if probe.returncode == 0:
                    break
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "moto.log").read_text()
                time.sleep(0.5)
            made = subprocess.run(
                ["ip", "netns", "exec", ns["a"], sys.executable, "-c",
                 f"from tests.distributed.test_two_hosts import _bucket; print(_bucket({endpoint!r}))"],
                capture_output=True, text=True, timeout=120, env=env, cwd=repo)
            assert made.returncode == 0, made.stderr
            bucket = made.stdout.strip().splitlines()[-1]
            argv = [str(out), str(tmp_path / "ckpt"), f"s3://{bucket}/ckpt", endpoint]

            # save: 2 hosts x 2 ranks, rendezvous across the link
            job = f"save-{uuid.uuid4().hex[:8]}"
            logs = [tmp_path / f"save-{h}.log" for h in ("a", "b")]
            procs = [_in(ns[h], _torchrun(2, h, 29400, job, ["save", *argv]), dict(env, SHARDPOINT_TEST_HOST=h), log)
                     for h, log in zip(("a", "b"), logs)]
            _finish(procs, logs, "the two-host save")
            saved = [json.loads((out / f"save-{r}.json").read_text()) for r in range(4)]
            assert sorted(s["host"] for s in saved) == ["a", "a", "b", "b"], saved

            # load: 1 host x 3 ranks
            log = tmp_path / "load.log"
            _finish([_in(ns["a"], _torchrun(1, "a", 29401, f"load-{uuid.uuid4().hex[:8]}", ["load", *argv]),
                         dict(env, SHARDPOINT_TEST_HOST="a"), log)], [log], "the one-host load")
        finally:
            if server.poll() is None:
                os.killpg(server.pid, 9)
                server.wait(timeout=30)
    loaded = [json.loads((out / f"load-{r}.json").read_text()) for r in range(3)]
    for res in loaded:
        for where in ("dir", "s3"):
            got = res[where]
            assert got["saved_world"] == 4 and got["exact"] == {"rows": True, "cols": True, "rep": True}, res
            assert got["host_of_rank"] == saved[res["rank"]]["host"], (res, saved)
