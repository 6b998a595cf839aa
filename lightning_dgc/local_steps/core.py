"""What both DiLoCo front doors share: the Trainer's :class:`~lightning_dgc.DiLoCoStrategy` and Fabric's
:class:`~lightning_dgc.FabricDiLoCoStrategy` take the same arguments, set the outer state up from the model the
same way, count optimizer steps, finish a round and write and restore checkpoints the same way, through
:class:`OuterAccess`. The outer step itself is :class:`lightning_dgc.local_steps.outer.OuterStep` (no Lightning).

Lightning is not imported here (the strategy modules import it), so that this module loads in any order.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint import rank_files
from lightning_dgc.checkpoint.exchange import read_rank_states
from lightning_dgc.checkpoint.files import rank_zero_warn
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.takeover import check_max_consecutive_skips
from lightning_dgc.front.core import ProcessGroupAtExit, config_from_arguments, node_topology
from lightning_dgc.local_steps.outer import DENSE, OuterSettings, OuterStep, check_same_everywhere

__all__ = ["DILOCO_KEY", "OuterAccess", "outer_config"]

log = logging.getLogger(__name__)

#: The checkpoint entry of a DiLoCo run (rank 0's file): the outer state and the manifest of the rank files.
DILOCO_KEY = "lightning_dgc_diloco"


def outer_config(
    owner: str, algorithm: str | AlgorithmConfig, options: dict[str, Any] | None, kwargs: dict[str, Any], base: type
) -> AlgorithmConfig | None:
    """The outer exchange's configuration (``None``: ``"dense"``) from a front door's arguments; DDP's arguments
    (those of the ``DDPStrategy`` ``base`` and of ``DistributedDataParallel``) are refused."""
    if isinstance(algorithm, str) and algorithm == DENSE:
        given = sorted({*kwargs, *(options or {})})
        if given:
            raise TypeError(
                f"{owner}: `{given[0]}` is no setting of algorithm='dense' (the plain mean has none) nor an argument"
                f" of {owner}: drop it, or pick an algorithm that takes it (e.g. algorithm='dgc', density=0.01)."
            )
        return None
    try:
        config = config_from_arguments(owner, algorithm, options, kwargs, base)
    except ValueError as error:
        if isinstance(algorithm, str) and "no compression algorithm named" in str(error):
            raise ValueError(f"{owner}: {error}; or algorithm='dense' for the plain mean.") from error
        raise
    if kwargs:
        raise TypeError(
            f"{owner} does not wrap the model in DistributedDataParallel: `{sorted(kwargs)[0]}` would have no"
            " effect; drop it."
        )
    return config


class OuterAccess(ProcessGroupAtExit):
    """Mixin of a DiLoCo front door (before its ``DDPStrategy`` base): the outer settings, the outer state, its
    statistics, the optimizer steps counted, the round finished, and every rank's part of a checkpoint.

    The front door calls :meth:`_init_outer` first in its ``__init__`` (a bad argument fails on the launching
    process), :meth:`_start_outer` once the model is on its device, :meth:`_count_step` after every optimizer
    step, and :meth:`_save_ranks` / :meth:`_restore` around its checkpoints. It has ``global_rank``,
    ``world_size`` and ``root_device`` (its ``DDPStrategy`` base's).
    """

    settings: OuterSettings
    max_consecutive_skips: int
    _config: AlgorithmConfig | None
    _outer: OuterStep | None = None
    #: What sets the model (and the outer state) up, named in the error before it has run.
    set_up_by = "the strategy's setup"

    def _init_outer(
        self,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        outer_nesterov: bool,
        offload: bool,
        max_consecutive_skips: int | None,
        algorithm: str | AlgorithmConfig,
        options: dict[str, Any] | None,
        kwargs: dict[str, Any],
        base: type,
        hierarchical: Any,
        streaming: tuple[int, int, float],
    ) -> None:
        self.settings = OuterSettings(sync_every, outer_lr, outer_momentum, outer_nesterov, offload, *streaming)
        self.max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
        self._hierarchical = comm.check_hierarchical(hierarchical)  # the nodes are known at setup
        self._config = outer_config(type(self).__name__, algorithm, options, kwargs, base)

    @property
    def outer(self) -> OuterStep:
        """The global weights, the outer optimizer and exchange, the position in the round."""
        if self._outer is None:
            raise RuntimeError(f"{type(self).__name__} has no outer state before {self.set_up_by} has set up the model.")
        return self._outer

    def compression_stats(self) -> dict[str, Any]:
        """This optimizer step's bytes (0 on the steps inside a round), the last outer exchange's and the run's
        link bytes per optimizer step (:meth:`OuterStep.compression_stats`); what
        :class:`~lightning_dgc.CompressionMonitor` logs."""
        return self._outer.compression_stats() if self._outer is not None else {}

    def residual_norm(self) -> float | None:
        """L2 norm of what the outer exchange's memory holds back (``None``: ``"dense"``, or before set-up)."""
        state = self._outer.exchange_state if self._outer is not None else None
        return state.residual_norm() if state is not None else None

    # -- the round ---------------------------------------------------------------------------------------------
    def _start_outer(self, module: torch.nn.Module) -> comm.Topology | None:
        """Every rank takes rank 0's weights and buffers (as DDP's wrapper would), and the outer state starts from
        them (all ranks call this). Returns the nodes' process groups when the run is hierarchical (the front door
        then wraps the model in DDP over the node's ranks), else ``None``."""
        comm.broadcast_([t.detach() for t in (*module.parameters(), *module.buffers())])
        owner = type(self).__name__
        topology = node_topology(self, self._hierarchical, owner)
        across, node = (topology.across, topology.node) if topology is not None else (None, None)
        self._outer = OuterStep(self.settings, self._config, module.named_parameters(), module.named_buffers(),
                                collectives=across, node=node)  # fmt: skip
        check_same_everywhere(self._outer, owner)
        if topology is not None and self.global_rank == 0:  # type: ignore[attr-defined]
            log.info(
                "%s: %d nodes x %d devices: DDP's all-reduce inside the node at every step, DiLoCo (%s outer exchange)"
                " across the nodes.", owner, topology.nodes, topology.per_node, self._outer.algorithm,
            )  # fmt: skip
        return topology

    def _count_step(self) -> None:
        """After an optimizer step: count it, and run the outer step at the end of a round."""
        self._after(self.outer.after_optimizer_step())

    def finish(self) -> None:
        """End the rounds cut short with an outer step over their steps so far (what is in flight merged first), so
        that every rank holds the same (global) weights; nothing when the last optimizer step ended every round.
        All ranks call it."""
        if self._outer is not None:
            self._after(self._outer.step())

    def _after(self, finite: bool | None) -> None:
        """After an outer step (``finite``; ``None``: none ran): warn of a skipped one, stop a stalled run."""
        if finite is None or finite:
            return
        outer = self.outer
        rank_zero_warn(
            f"{type(self).__name__}: the pseudo-gradient of outer step {outer.outer_steps} was not finite (inf/NaN"
            " on at least one rank); the outer step was skipped on every rank and every rank restarts the round"
            " from the global weights."
        )
        if self.max_consecutive_skips and outer.consecutive_skipped >= self.max_consecutive_skips:
            raise RuntimeError(
                f"{type(self).__name__}: the last {outer.consecutive_skipped} outer steps were all skipped because"
                " the pseudo-gradients were not finite, so the model has stopped training. Check the loss for"
                " inf/NaN (data, learning rate; gradient clipping), lower `sync_every`, or raise"
                " `max_consecutive_skips` (None turns this check off)."
            )

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _save_ranks(self, filepath: Any, io: FileIO, inner_optimizers: Any) -> dict[str, Any] | None:
        """Every rank writes its local weights, ``inner_optimizers`` (its inner optimizer state) and outer exchange
        memory into its own file beside ``filepath`` (all ranks call this). Rank 0 gets the checkpoint's DiLoCo
        entry (the outer state and the manifest of the rank files), the others ``None``."""
        outer = self.outer
        outer.settle()  # the exchanges in flight received and stepped: what is saved is complete
        tag = comm.all_gather_object(f"{outer.optimizer_steps:08d}-{os.urandom(4).hex()}")[0]  # rank 0's
        mine = {
            "local": {n: p.detach().cpu().clone() for n, p in zip(outer.names, outer.params, strict=True)},
            "inner_optimizers": inner_optimizers,
            "exchange": outer.exchange_state.state_dict() if outer.exchange_state is not None else None,
        }
        folder = rank_files.folder_of(filepath)
        rank = self.global_rank  # type: ignore[attr-defined]
        record = io.save(mine, rank_files.join(folder, rank_files.rank_file_name(rank, str(tag))))
        records = comm.gather_object(record)
        if records is None:  # not rank 0: its own file is written
            return None
        manifest = {"folder": os.path.basename(folder.rstrip("/")), "files": records, "world_size": len(records)}
        return {"outer": outer.state_dict(), **manifest}

    def _global_weights_into(self, state_dict: dict[str, Any], entry: dict[str, Any]) -> None:
        """Replace the (local) weights of a model's ``state_dict`` by the global weights, in their dtype, and leave
        out of the DiLoCo ``entry`` those the ``state_dict`` now holds exactly (fp32): one copy in the file, which
        :meth:`_restore` reads back from the loaded model."""
        outer, saved = self.outer, entry["outer"]["global"]
        for name, g in zip(outer.names, outer.global_params, strict=True):
            if name in state_dict:
                state_dict[name] = g.detach().to("cpu", state_dict[name].dtype, copy=True)
                if state_dict[name].dtype == torch.float32:
                    saved.pop(name, None)

    def _restore(self, entry: dict[str, Any] | None, path: Any, io: FileIO) -> Any:
        """Restore the outer state of a checkpoint's DiLoCo ``entry`` and this rank's own file, once the model holds
        the checkpoint's (global) weights; returns this rank's inner optimizer state (``None``: keep what the
        checkpoint gave). Without an entry (another strategy's checkpoint) a round starts from the model's weights;
        from another number of ranks, from the global weights."""
        outer = self.outer
        if entry is None:
            outer.reset_global()
            return None
        world_size = self.world_size  # type: ignore[attr-defined]
        saved = entry["outer"]["global"]  # the fp32 global weights are the model's, just loaded
        for name, p in zip(outer.names, outer.params, strict=True):
            saved.setdefault(name, p.detach())
        outer.load_state_dict(entry["outer"])
        if entry["world_size"] != world_size:
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint was written by {entry['world_size']} ranks and is resumed by"
                f" {world_size}: a round starts from its global weights, with rank 0's inner optimizer state"
                " and an empty outer exchange memory (the outer momentum is kept)."
            )
            outer.load_local()
            outer.restart_rounds()
            return None
        rank = self.global_rank  # type: ignore[attr-defined]
        state = read_rank_states(entry, [rank], path, io)[rank]
        with torch.no_grad():
            for name, p in zip(outer.names, outer.params, strict=True):
                p.copy_(state["local"][name])
        if outer.exchange_state is not None and state["exchange"] is not None:
            outer.exchange_state.restore_rank_state(state["exchange"], self.root_device)  # type: ignore[attr-defined]
        return state["inner_optimizers"]
