"""``DGCStrategy(density="auto")`` under the two-level exchange with a real ``Trainer``: 2 nodes x 2 processes, one
``torchrun`` agent per node (``auto_two_level_script.py``), on one host and across a shaped link between two
network namespaces."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.netns import ADDRESSES, INTERFACES, SlowLink, missing_requirements
from lightning_dgc.algorithms import TensorSpec
from lightning_dgc.algorithms.dgc import DGC, DGCConfig
from lightning_dgc.schedules.auto_density import Choice, choose_density
from lightning_dgc.schedules.link_measure import LinkEstimate
from tests.conftest import free_port
from tests.lightning.run import HERE, _environment, outputs_of_passed, run_together, two_torchrun_agents

pytestmark = pytest.mark.slow


def _priced_choice(decision: dict) -> Choice:
    """The density the pricing gives for what a run's ``density="auto"`` measured and priced (its decision)."""
    link = LinkEstimate(*decision["link"])
    buckets = [([TensorSpec(n, tuple(shape), o, k) for n, shape, o, k in layout], dense_bytes)
               for layout, dense_bytes in decision["buckets"]]  # fmt: skip
    config = DGCConfig(density="auto", auto_every=0)
    return choose_density(link, buckets, decision["world_size"], DGC, config, decision["min_density"],
                          check_s=decision["check_s"])  # fmt: skip


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text())["auto"] for r in range(4)]


def test_two_nodes_on_one_host_measure_dense_and_end_where_ddp_does(tmp_path: Path) -> None:
    """Both nodes on this machine: every rank of both nodes chooses dense (one host), the exchange stays two-level,
    and the weights equal DDP's on the same 4 processes (the tolerance of the two-level exchange at density 1)."""
    two_torchrun_agents("auto_two_level_script.py", ["--out", str(tmp_path), "--steps", "10"], tmp_path)
    for report in _reports(tmp_path):
        assert report["hierarchical"] and report["steps"] == 10
        assert report["decision"]["density"] == 1.0 and "one host" in report["decision"]["reason"]
        assert report["auto_density"] == report["density"] == 1.0 and report["auto_measuring"] is False
        assert 0 < report["inter_node_bytes"] < report["link_bytes"]
    ddp = torch.load(tmp_path / "ddp.rank0.params.pt", weights_only=True)
    for rank in range(4):
        auto = torch.load(tmp_path / f"auto.rank{rank}.params.pt", weights_only=True)
        torch.testing.assert_close(auto, ddp, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(missing_requirements() is not None, reason=f"a shaped link: {missing_requirements()}")
def test_two_nodes_across_a_100_mbit_link_choose_what_the_measured_link_prices(tmp_path: Path) -> None:
    """Two network namespaces of two processes each, the veth between them shaped to 100 Mbit/s (the processes of
    a node talk inside their namespace, unshaped): an MLP of 6.3 M parameters, whose dense exchange across the
    link takes seconds per step against a compute window of tens of milliseconds on an idle machine. Every rank
    chooses the same density, compressed, and keeps it after the check; the density is the one the pricing gives
    for the link and the compute window the run measured (on a busy machine the window grows, the measured
    throughput falls, and a denser or sparser choice is right)."""
    port = free_port()
    env = _environment() | {"OMP_NUM_THREADS": "1"}
    script = ["--out", str(tmp_path), "--strategies", "auto", "--width", "2048", "--features", "512",
              "--batch-size", "2", "--steps", "14"]  # fmt: skip
    with SlowLink(tag=f"t{os.getpid()}") as link:
        link.set_rate(100)
        commands = [
            [*link.exec_prefix(node), sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", ADDRESSES[0],
             "--master-port", str(port), str(HERE / "auto_two_level_script.py"), *script]
            for node in range(2)
        ]  # fmt: skip
        envs = [env | {"GLOO_SOCKET_IFNAME": INTERFACES[node]} for node in range(2)]
        outputs_of_passed(run_together(commands, envs, tmp_path, timeout=500))
    reports = _reports(tmp_path)
    decisions = {report["decision"]["density"] for report in reports}
    assert len(decisions) == 1, f"the ranks chose {decisions}"
    for report in reports:
        decision = report["decision"]
        assert report["hierarchical"]
        assert decision["link_mbit_s"] < 150, decision  # the shaped link, not the node's
        assert decision["density"] == _priced_choice(decision).density < 1.0, decision
        assert report["auto_density"] == report["decision"]["density"], "the check sent the exchange back to dense"
        assert report["checked_step_ms"] < report["dense_step_ms"]
    params = [torch.load(tmp_path / f"auto.rank{r}.params.pt", weights_only=True) for r in range(4)]
    assert all(torch.equal(params[0], p) for p in params[1:])
