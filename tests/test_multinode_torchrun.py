"""Two nodes under torchrun: two network namespaces joined by a rate-limited veth pair, one torchrun per "node".

``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` in each namespace runs ``mixprec train`` with the
hierarchical fp32-accumulating reducer, whose topology (2 nodes x 2 ranks) comes from torchrun's LOCAL_WORLD_SIZE
and GROUP_WORLD_SIZE; its metrics must equal a one-machine ``--nproc 4 --ranks-per-node 2`` run bit for bit (the
same data, the same two-stage reduction over the same gloo groups; only the wire differs). Killing one node's
torchrun and its ranks must stop the other within ``--timeout`` with an error naming the lost node's address.
examples/integrations/train_accelerate.py (Hugging Face Accelerate) runs across the same two nodes.
docs/multinode.md has the same commands for a real cluster. Needs root and iproute2 (ip, tc); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.launch import preflight, torchrun_env
from mixprec.lab.metrics import METRICS_NAME, read_rows
from mixprec.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model.n-layer", "1", "--model.n-head", "2", "--model.n-embd", "16", "--model.block-size", "16",
    "--data.global-batch-size", "8", "--data.micro-batch-size", "2", "--data.eval-sequences", "8",
    "--training.eval-interval", "3",
    "--optimizer.lr", "0.01", "--model.precision", "bf16", "--parallel.reduce", "fp32_accumulate_hierarchical",
]  # fmt: skip
RDZV_PORT = 29500  # inside a fresh namespace: nothing else listens there
TIMEOUT_S = 30  # --timeout of the kill test; torchrun's own start-up is not under it


# ------------------------------------------------------------------ the topology from torchrun's environment
def _torchrun_vars(monkeypatch, **values: int) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in values.items():
        monkeypatch.setenv(k, str(v))


def test_ranks_per_node_come_from_local_world_size(monkeypatch, tmp_path) -> None:
    """4 ranks as 4 nodes x 1: without torchrun's LOCAL_WORLD_SIZE the default would be nproc // 2 = 2."""
    from mixprec.lab.config import TrainConfig

    _torchrun_vars(monkeypatch, RANK=0, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_WORLD_SIZE=4)
    cfg = TrainConfig().replace(
        parallel={"reduce": "fp32_accumulate_hierarchical"}, training={"out_dir": str(tmp_path)}
    )
    resolved = preflight(cfg)
    assert (resolved.parallel.nproc, resolved.parallel.ranks_per_node) == (4, 1)
    _torchrun_vars(monkeypatch, RANK=0, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2)
    assert preflight(cfg).parallel.ranks_per_node == 2


def test_nodes_with_different_rank_counts_are_refused(monkeypatch, capsys, tmp_path) -> None:
    """torchrun lets each node pick --nproc-per-node; the hierarchical groups need one count everywhere."""
    _torchrun_vars(monkeypatch, RANK=0, WORLD_SIZE=4, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_WORLD_SIZE=2)
    with pytest.raises(ValueError, match="same --nproc-per-node"):
        torchrun_env()
    assert main(["train", "--training.out-dir", str(tmp_path / "r"), *TINY, "--training.steps", "1"]) == 2
    assert "LOCAL_WORLD_SIZE" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------ two namespaces, one link
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    used = _sh("ip", "-4", "addr").stdout + _sh("ip", "-4", "route").stdout
    for third in range(1, 250):
        if f"10.231.{third}." not in used:
            return f"10.231.{third}"
    pytest.skip("no free 10.231.x.0/30 subnet")


class Nodes:
    """Two namespaces ``ns[0]``, ``ns[1]`` with addresses ``addr[0]``, ``addr[1]`` on a 1 Gbit/s veth pair."""

    def __init__(self) -> None:
        tag = f"mpx{os.getpid()}"
        self.ns, self.dev = [tag + "a", tag + "b"], [tag + "ea", tag + "eb"]
        subnet = _free_subnet()
        self.addr = [f"{subnet}.1", f"{subnet}.2"]
        self.created: list[str] = []

    def up(self) -> None:
        for name in self.ns:
            if _sh("ip", "netns", "add", name, check=False).returncode:
                pytest.skip("cannot create network namespaces here")
            self.created.append(name)
            _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name",
                        self.dev[1], "netns", self.ns[1])  # fmt: skip
        for i in range(2):
            ns, dev = self.ns[i], self.dev[i]
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr[i]}/30", "dev", dev)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "1gbit",
                "burst", "500000", "latency", "50ms")  # fmt: skip

    def down(self) -> None:
        for name in self.created:
            _sh("ip", "netns", "del", name, check=False)  # removes the veth pair with it

    def torchrun(self, node: int, script: list[str], log: Path) -> subprocess.Popen:
        """``torchrun`` for ``node`` in its namespace; node 0 hosts the c10d rendezvous store. ``--local-addr``:
        the address the other node reaches this one at (the hostname here resolves to localhost)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=self.dev[node])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        cmd = ["ip", "netns", "exec", self.ns[node], sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{self.addr[0]}:{RDZV_PORT}", "--rdzv-id", f"mpx{os.getpid()}",
               "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=120", "--local-addr", self.addr[node],
               *script]  # fmt: skip
        with open(log, "w") as fh:  # a file, not a pipe: nothing blocks on a full pipe while the other node runs
            return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=log.parent)


@pytest.fixture(scope="module")
def nodes():
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs the ip and tc commands (iproute2)")
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, veth, tc)")
    n = Nodes()
    try:
        n.up()
        yield n
    finally:
        n.down()


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its ranks in sessions of their own: not one process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in _tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _run_both(nodes: Nodes, script: list[str], tmp: Path, timeout: float = 240) -> list[str]:
    procs = [nodes.torchrun(k, script, tmp / f"node{k}.log") for k in range(2)]
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    logs = [(tmp / f"node{k}.log").read_text() for k in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    return logs


def _numerics(run_dir: Path) -> list[tuple]:
    rows = read_rows(str(run_dir / METRICS_NAME))
    return [(r["step"], r["loss"], r["eval_loss"], r["loss_scale"], r["skipped"], r["grad_norm"]) for r in rows]


@pytest.mark.slow
def test_two_nodes_train_as_one_machine_bit_for_bit(nodes, tmp_path) -> None:
    steps = ["--training.steps", "4", "--parallel.timeout", "60"]
    logs = _run_both(nodes, ["-m", "mixprec.cli.main", "train", "--training.out-dir", str(tmp_path / "nodes"), *TINY,
                             *steps],
                     tmp_path)  # fmt: skip
    shape = (
        "torchrun: 4 ranks, 2 node(s) x 2 (WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_WORLD_SIZE=2); "
        "fp32_accumulate_hierarchical topology: 2 nodes x 2 ranks"
    )
    assert sum(shape in log for log in logs) == 1, logs  # printed by rank 0, on whichever node it is
    config = (tmp_path / "nodes" / "config.toml").read_text()
    assert "nproc = 4" in config and "ranks_per_node = 2" in config
    assert (
        main(
            [
                "train",
                "--training.out-dir",
                str(tmp_path / "one"),
                *TINY,
                *steps,
                "--parallel.nproc",
                "4",
                "--parallel.ranks-per-node",
                "2",
            ]
        )
        == 0
    )
    got, want = _numerics(tmp_path / "nodes"), _numerics(tmp_path / "one")
    assert [r[0] for r in got] == [0, 1, 2, 3]
    assert got == want


@pytest.mark.slow
def test_a_killed_node_stops_the_other_within_the_timeout_naming_it(nodes, tmp_path) -> None:
    run = tmp_path / "run"
    script = ["-m", "mixprec.cli.main", "train", "--training.out-dir", str(run), *TINY, "--training.steps", "100000",
              "--parallel.timeout", str(TIMEOUT_S)]  # fmt: skip
    procs = [nodes.torchrun(k, script, tmp_path / f"node{k}.log") for k in range(2)]
    try:
        deadline = time.monotonic() + 180  # start-up: both torchruns, the rendezvous, the first steps
        while not (run / METRICS_NAME).exists() or len((run / METRICS_NAME).read_text().splitlines()) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                tmp_path / "node0.log"
            ).read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
            time.sleep(0.2)
        _kill_tree(procs[1])  # node 1's torchrun and its two ranks, all at once, as a machine that dies
        try:
            code = procs[0].wait(timeout=TIMEOUT_S + 30)  # + the grace torchrun gives its ranks to exit
        except subprocess.TimeoutExpired:
            pytest.fail("node 0 still running after --timeout + 30 s: " + (tmp_path / "node0.log").read_text()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    log = (tmp_path / "node0.log").read_text()
    assert code != 0, log[-3000:]
    # Each rank of node 0 says which rank it is and why it stopped; the first to fail can only have seen node 1
    # go (its node-0 peer fails after it, on this rank closing its connections).
    lines = [line for line in log.splitlines() if line.startswith("mixprec train: rank ")]
    assert lines, log[-3000:]
    assert lines[0].endswith(f"stopped: the rank at {nodes.addr[1]} failed or is unreachable"), lines
    assert not any(line.startswith("[rank") for line in log.splitlines()), log[-3000:]  # no rank's traceback


# ------------------------------------------------------------------------------------- an adapter example
def _wrapper_rank(rank: int, world: int) -> dict:
    """examples/integrations/train_accelerate.py's run under mixprec's own DistributedDataParallel, 2 x 2."""
    from integration_reference import load_example, wrapper_run

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets: the reducer's topology, 2 nodes x 2
    run = wrapper_run(
        load_example("train_accelerate"), rank, reduce="fp32_accumulate_hierarchical", schedule_steps=world
    )
    return {key: run[key] for key in ("weight", "skipped", "scale")}


@pytest.mark.slow
def test_the_accelerate_example_across_two_nodes(nodes, tmp_path) -> None:
    pytest.importorskip("accelerate")
    out = tmp_path / "params.pt"
    script = [str(ROOT / "examples/integrations/train_accelerate.py"), "--reduce", "fp32_accumulate_hierarchical",
              "--out", str(out)]  # fmt: skip
    logs = "".join(_run_both(nodes, script, tmp_path))
    assert "replicas identical: True" in logs and "train_accelerate example: OK" in logs, logs[-3000:]
    got = torch.load(out, weights_only=True)
    want = run_distributed(_wrapper_rank, 4, timeout=240)[0]
    assert got["skipped"] == want["skipped"] == 1
    assert got["scale"] == want["scale"]
    assert torch.equal(got["weight"], want["weight"])
