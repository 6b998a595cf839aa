"""The sharded strategies' arguments, names and layout checks, in one process (the runs: tests/lightning/test_hsdp.py)."""

from __future__ import annotations

import pytest

import lightning_dgc
from lightning_dgc import comm
from lightning_dgc.front import sharding


def test_each_algorithm_has_a_sharded_name_for_the_trainer() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("dgc", "deft", "powersgd"):
        entry = StrategyRegistry[f"{name}_hsdp"]
        assert entry["strategy"] is lightning_dgc.HSDPCompressionStrategy
        assert entry["init_params"] == {"algorithm": name}
    assert StrategyRegistry.get("powersgd_hsdp").algorithm == "powersgd"


def test_the_algorithm_takes_its_options_as_the_flat_strategies_do() -> None:
    by_keyword = lightning_dgc.HSDPCompressionStrategy("dgc", density=0.01, value_dtype="int8")
    by_options = lightning_dgc.HSDPCompressionStrategy("dgc", {"density": 0.01, "value_dtype": "int8"})
    assert by_keyword.config == by_options.config and by_keyword.density == 0.01
    with pytest.raises(TypeError, match="unknown argument `densty` \\(did you mean `density`\\?\\)"):
        lightning_dgc.HSDPCompressionStrategy("dgc", densty=0.01)


def test_ddps_arguments_and_a_single_file_checkpoint_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="no DDP wrapper.*save_distributed_checkpoint"):
        lightning_dgc.HSDPCompressionStrategy("dgc", find_unused_parameters=True)
    with pytest.raises(ValueError, match="holds no process's exchange state.*save_exchange_state=False"):
        lightning_dgc.HSDPCompressionStrategy("dgc", save_distributed_checkpoint=False)
    lightning_dgc.HSDPCompressionStrategy("dgc", save_distributed_checkpoint=False, save_exchange_state=False)


def test_the_nodes_must_be_numbered_node_by_node_on_one_host_each() -> None:
    what = "HSDPCompressionStrategy (FSDP2 inside each node)"
    assert comm.check_node_layout([(r, r // 2, r % 2) for r in range(4)], 2, what, "") == 2
    with pytest.raises(ValueError, match=r"FSDP2 inside each node\) needs global ranks numbered node by node.*"
                       r"\(rank, node_rank, local_rank\) = \(1, 1, 0\)\. Use the launcher's default rank assignment\.$"):
        comm.check_node_layout([(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], 2, what, "")
    with pytest.raises(ValueError, match="same number of devices on every node"):
        comm.check_node_layout([(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)], 2, what, "")
    sharding.check_nodes_on_hosts([7.0, 7.0, 9.0, 9.0], 2, "S")
    with pytest.raises(ValueError, match=r"those of node 1 \(global ranks 2 to 3\) run on different hosts.*num_nodes="):
        sharding.check_nodes_on_hosts([7.0, 7.0, 9.0, 7.0], 2, "S")
