"""What the sharded benchmarks share: native HSDP as the baseline, the transformer they train, and 2 nodes x 2
processes started on this machine (or, with a :class:`~benchmarks.netns.SlowLink`, one node in each network
namespace).

* :class:`NativeHSDPStrategy`: Lightning's ``ModelParallelStrategy`` whose ``device_mesh["data_parallel"]`` is the
  2-D ``(replicate, data_parallel)`` mesh of the nodes, so that the recipe's ``configure_model`` (``fully_shard(...,
  mesh=self.device_mesh["data_parallel"])``) shards as HSDP: FSDP2 inside the node and its own dense all-reduce
  across the nodes. The same mesh as the sharded strategies', the same sampler (each process its own batches).
* :func:`transformer`: the PTB transformer recipe's model at a given width.
* :func:`launch`: every rank of ``python -m <module> <args>`` as nodes of processes, with the variables Lightning
  reads, optionally inside a link's namespaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from benchmarks import common

NODES, PER_NODE = 2, 2


def native_hsdp_strategy() -> Any:
    """Native HSDP over the nodes of the run (a :class:`NativeHSDPStrategy`)."""
    return NativeHSDPStrategy()


class NativeHSDPStrategy(ModelParallelStrategy):
    """FSDP2 inside the node, FSDP2's own HSDP all-reduce across the nodes (the baseline; ``benchmarks/native_hsdp.yaml``
    for the recipes' command line)."""

    def __init__(self) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1)

    def setup_environment(self) -> None:
        from lightning_dgc.comm.mesh import sharded_mesh

        self._setup_distributed()
        mesh = sharded_mesh(self.num_nodes, self.world_size // self.num_nodes, self.root_device.type)
        self._device_mesh = mesh
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = _HSDPView(mesh)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


class _HSDPView:
    """A mesh whose ``"data_parallel"`` is the 2-D ``(replicate, data_parallel)`` mesh (HSDP for ``fully_shard``)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    def __getitem__(self, name: Any) -> Any:
        return self.mesh["replicate", "data_parallel"] if name == "data_parallel" else self.mesh[name]


def transformer(d_model: int, layers: int, vocab: int = 10_000, heads: int = 4) -> Any:
    """The PTB transformer recipe's model (``TransformerLanguageModel``) at this width and depth, dropout 0."""
    from lightning_dgc_recipes.transformer import TransformerLanguageModel

    return TransformerLanguageModel(vocab_size=vocab, d_model=d_model, num_layers=layers, num_heads=heads,
                                    dropout=0.0, max_seq_len=64, warmup_steps=2)  # fmt: skip


def launch(module: str, args: Sequence[str], folder: Path, tag: str, timeout_s: float, link: Any = None,
           nodes: int = NODES, per_node: int = PER_NODE, **extra_env: str) -> list[int | None]:  # fmt: skip
    """Every rank of ``python -m module *args`` as ``nodes`` nodes of ``per_node`` processes (ranks node by node),
    logs in ``folder/<tag>.rank<r>.log``; with ``link`` (a :class:`~benchmarks.netns.SlowLink`) node ``n`` runs in
    its namespace ``n``. Returns the exit codes."""
    from benchmarks.netns import ADDRESSES, INTERFACES

    port = common.free_port()
    master = ADDRESSES[0] if link is not None else "127.0.0.1"
    procs = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        env = common.worker_env(MASTER_ADDR=master, MASTER_PORT=str(port), WORLD_SIZE=str(nodes * per_node),
                                RANK=str(rank), NODE_RANK=str(node), LOCAL_RANK=str(local), **extra_env)  # fmt: skip
        command = [common.python(), "-m", module, *args]
        if link is not None:
            env["GLOO_SOCKET_IFNAME"] = INTERFACES[node]
            command = [*link.exec_prefix(node), *command]
        procs.append(common.start(command, env, folder / f"{tag}.rank{rank}.log"))
    return common.wait_all(procs, timeout_s)
