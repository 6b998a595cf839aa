"""What the sharded front doors share (the Trainer's :mod:`lightning_dgc.front.hsdp`, Fabric's
:mod:`lightning_dgc.front.hsdp_fabric`): their arguments, the nodes' mesh, the exchange hooked into every FSDP group,
the rank check across the replicas of a shard, and the exchange state inside a checkpoint folder."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import (
    check_entry,
    finish_save,
    restore_exchange_state,
    save_exchange_state,
)
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.comm.mesh import across_host_group
from lightning_dgc.exchange import agreement
from lightning_dgc.exchange.params import local_shard
from lightning_dgc.exchange.sharded import exchange_shard
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.exchange.takeover import OptimizerTakeOver, check_ranks_agree
from lightning_dgc.front import sharding
from lightning_dgc.front.core import ExchangeAccess

__all__ = ["EXCHANGE_FILES", "ShardedExchangeAccess"]

#: The exchange state's name inside a checkpoint folder: its rank files are in ``<folder>/lightning_dgc.exchange/``.
EXCHANGE_FILES = "lightning_dgc"


class ShardedExchangeAccess(ExchangeAccess):
    """Mixin of a sharded front door (before its ``ModelParallelStrategy`` base): :class:`ExchangeAccess` for a
    model that FSDP2 shards over each node's processes, with the exchange across the nodes.

    The door calls :meth:`_take_sharded_arguments` in its ``__init__``, :meth:`_set_up_nodes` once the process
    group is up (it returns the mesh), :meth:`_shard_and_check` on the model, and :meth:`_set_up_exchange` once its
    optimizers exist.
    """

    _topology: comm.Topology | None = None
    _across_host_group: Any = None
    sharded_modules: tuple[type[torch.nn.Module], ...] = ()
    mp_policy: Any = None
    resume_exchange_state: bool = True

    def _take_sharded_arguments(
        self, algorithm: str | AlgorithmConfig, options: dict[str, Any] | None, kwargs: dict[str, Any], base: type,
        save_exchange_state: bool, max_consecutive_skips: int | None, check_ranks_every: int | None,
        save_distributed_checkpoint: bool, sharded_modules: Iterable[type[torch.nn.Module]] | None, mp_policy: Any,
        resume_exchange_state: bool,
    ) -> None:  # fmt: skip
        """The opening of a sharded door's ``__init__``: :meth:`_take_arguments`, and what has no meaning here."""
        owner = type(self).__name__
        self._take_arguments(algorithm, options, kwargs, base, save_exchange_state, max_consecutive_skips,
                             check_ranks_every)  # fmt: skip
        if kwargs:
            raise TypeError(
                f"{owner} got unexpected arguments {sorted(kwargs)}: a sharded model has no DDP wrapper, so DDP's"
                " arguments do not apply; the algorithm's settings and ModelParallelStrategy's"
                " (save_distributed_checkpoint, process_group_backend, timeout) do."
            )
        if not save_distributed_checkpoint and save_exchange_state:
            raise ValueError(
                f"{owner}(save_distributed_checkpoint=False) gathers the model into one file, which holds no"
                " process's exchange state: keep save_distributed_checkpoint=True (the default), or pass"
                " save_exchange_state=False as well to save the model and the optimizer only."
            )
        self.sharded_modules = tuple(sharded_modules or ())
        self.mp_policy = mp_policy
        self.resume_exchange_state = bool(resume_exchange_state)
        self._taken_over = OptimizerTakeOver(owner)

    def _set_up_nodes(self) -> Any:
        """The ``(replicate, data_parallel, tensor_parallel)`` mesh of the nodes (every rank, once its process group
        is up), the ranks checked: numbered node by node, each node's processes on one host."""
        owner = type(self).__name__
        comm.destroy_process_group_at_exit()
        mesh, self._topology = sharding.node_mesh(self, owner)
        self._across_host_group = across_host_group(self._topology, self.global_rank)  # type: ignore[attr-defined]
        rank_zero_info(
            f"{owner}: {self._topology.nodes} node(s) x {self._topology.per_node} process(es): FSDP2 inside the node,"
            f" {self.algorithm} across the nodes on each process's shard."
        )
        return mesh

    def _shard_and_check(self, module: torch.nn.Module, mesh: Any, shard: Any = None) -> torch.nn.Module:
        """``module`` as the exchange reads it: sharded by ``shard(module, mesh)`` (the user's), by
        ``sharded_modules``, or already (a ``configure_model``), over ``mesh["data_parallel"]``, and checked."""
        return sharding.shard_and_check(module, mesh, type(self).__name__, self.sharded_modules, self.mp_policy, shard)

    def _set_up_exchange(self, module: torch.nn.Module, named: list[tuple[str, torch.Tensor]], optimizers: Any) -> None:
        """The exchange state over the sharded parameters, its hook on every FSDP group, the optimizers taken over
        (every rank)."""
        assert self._topology is not None
        sharding.check_reduce(module, type(self).__name__)
        self._align_replicas(module)
        state = self._state
        if state is None or list(state.param_names.values()) != [n for n, _ in named]:
            state = self._state = ExchangeState(self._config, sharded=self._topology)
        state.register_parameters(named)
        self._attach_auto_density(state)
        self._set_up_rank_checks()
        for fsdp_module, group in sharding.hooked_groups(module):
            fsdp_module.set_all_reduce_hook(self._shard_hook(state, group))
        self._take_over(named, optimizers)

    def _align_replicas(self, module: torch.nn.Module) -> None:
        """Every node starts from node 0's shards and every process from rank 0's buffers, as DDP starts every rank
        from rank 0's model: FSDP2 shards what each process initialised, and nodes that initialised differently
        (no common seed) would otherwise train replicas that never agree (every rank; a checkpoint loaded later
        replaces them all alike)."""
        assert self._topology is not None
        with torch.no_grad():
            shards = [local_shard(p.detach()) for p in module.parameters()]
            comm.broadcast_(shards, src=self._topology.local_rank, group=getattr(self._topology.across, "group", None))
            comm.broadcast_(list(module.buffers()), src=0)

    def _take_over(self, named: Iterable[tuple[str, torch.Tensor]], optimizers: Any) -> None:
        state = self._state
        if state is not None and state.algorithm.takes_over_momentum and optimizers:
            self._taken_over.take_over(state, optimizers, named, self.root_device)  # type: ignore[attr-defined]
        if state is not None:
            check_ranks_agree(state, type(self).__name__, self.max_consecutive_skips)

    def _shard_hook(self, state: ExchangeState, group: Any) -> Any:
        """The all-reduce hook of one FSDP parameter group: the exchange of this rank's shard across the nodes."""

        def hook(shard: torch.Tensor) -> None:
            layout = sharding.group_shard(group, state.name_of)
            aliased = sharding.grads_alias_shard(group, shard)
            self._run_exchange(state, lambda: exchange_shard(state, layout, shard, aliased))

        return hook

    def _after_optimizer_step(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The rank check compares the replicas of each shard: this process's local shards, across the nodes."""
        self._optimizer_steps += 1
        if self._auto is not None and self._state is not None:
            self._auto.step_done(self._state, self._host_group)
        if agreement.rank_check_due(self._optimizer_steps, self.check_ranks_every):
            local = [(name, local_shard(p)) for name, p in named_params]
            agreement.check_parameters_agree(local, type(self).__name__, self._optimizer_steps, self._across_host_group)

    # -- checkpoints: the exchange state inside torch.distributed.checkpoint's folder -------------------------
    def _save_exchange_files(self, path: Path) -> dict[str, Any] | None:
        """Every process's exchange state into ``path/lightning_dgc.exchange/`` (every rank calls it; the folder is
        made first); the manifest on rank 0, ``None`` elsewhere."""
        assert self._state is not None
        if self.is_global_zero:  # type: ignore[attr-defined]
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()  # type: ignore[attr-defined]
        return save_exchange_state(self._state, self.algorithm, path / EXCHANGE_FILES, FileIO(None),
                                   type(self).__name__, with_memory=self.save_exchange_state)  # fmt: skip

    def _finish_exchange_files(self, path: Path, manifest: dict[str, Any] | None) -> None:
        """After the checkpoint was written: rank 0 deletes the files of earlier saves to ``path``."""
        if manifest is not None:
            finish_save(path / EXCHANGE_FILES, manifest, FileIO(None))
        self.barrier()  # type: ignore[attr-defined]

    def _restore_exchange_files(self, path: Path, entry: dict[str, Any] | None, loads_optimizer: bool) -> None:
        """This process's exchange state from the checkpoint folder ``path`` (``resume_exchange_state=False``: none)."""
        check_entry(entry, self.algorithm, type(self).__name__, loads_optimizer)
        if entry is None or self._state is None:
            return
        if self.resume_exchange_state:
            restore_exchange_state(self._state, entry, self.root_device, path / EXCHANGE_FILES, FileIO(None))  # type: ignore[attr-defined]
            return
        self._state.step = int(entry.get("step", 0))
        rank_zero_warn(
            f"{type(self).__name__}(resume_exchange_state=False): the exchange starts with empty buffers; the"
            " update they held when the checkpoint was saved is dropped."
        )
