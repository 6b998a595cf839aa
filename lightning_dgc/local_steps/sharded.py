"""DiLoCo on a sharded model (FSDP2 inside each node, the outer step across the nodes), without Lightning: the outer
step on each process's parameter shard (:class:`ShardedOuterStep`), and the parts of a checkpoint that are not the
model's and the optimizer's (:func:`plain_optimizer_state`, :func:`momentum_dtensors`).

Inside a node, the ``G`` processes shard every parameter with FSDP2 (``Shard(0)``: each holds a row block) and train
as FSDP2 does (reduce-scatter of the gradients, all-gather of the weights); nothing crosses the nodes between outer
steps. Each process runs :class:`~lightning_dgc.local_steps.outer.OuterStep` on its own shard, across the ``N``
nodes, with the processes that hold the same shard (one per node: ``mesh["replicate"]``):

1. pseudo-gradient: this process's global shard minus its local shard;
2. its mean across the nodes: one all-reduce (``"dense"``) or any algorithm, whose memory is one shard's;
3. the outer SGD step of the global shard; its momentum is one shard too;
4. local shard := global shard.

So a process's outer state (global weights, outer momentum, exchange memory) is ``1/G`` of a replicated DiLoCo's,
and the model crosses the nodes once per outer step, in ``G`` pieces that travel side by side. Two things are agreed
over every process: whether the outer step is taken (a shard whose mean is not finite skips it on every process of
every node, so that no shard moves without the others), and the floating-point buffers (FSDP2 leaves buffers whole
on every process: they are averaged over all of them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.comm import Collectives
from lightning_dgc.exchange.params import local_shard
from lightning_dgc.local_steps.outer import OuterStep
from lightning_dgc.local_steps.rounds import InFlight, OuterSettings

__all__ = [
    "ShardedOuterStep", "load_plain_optimizer_state", "momentum_dtensors", "outer_state_bytes", "plain_optimizer_state",
]  # fmt: skip


class ShardedOuterStep(OuterStep):
    """:class:`~lightning_dgc.local_steps.outer.OuterStep` on this process's shards (see the module).

    Args:
        settings, config: as for ``OuterStep``.
        named_shards: ``(name, local shard)`` of every trained parameter this process holds values of: views of
            FSDP2's sharded parameters, which the outer step reads and writes in place.
        named_buffers: the model's buffers (each process holds them whole).
        across: the collectives of the processes that hold the same shards, one per node.
        node: those of this process's node.
    """

    def __init__(
        self,
        settings: OuterSettings,
        config: AlgorithmConfig | None,
        named_shards: Iterable[tuple[str, Tensor]],
        named_buffers: Iterable[tuple[str, Tensor]],
        across: Collectives,
        node: Collectives,
    ) -> None:
        super().__init__(settings, config, named_shards, named_buffers, collectives=across)
        #: The node's processes: the outer step's verdict and the buffers are agreed with them too.
        self.shard_node = node

    @staticmethod
    def trains(param: Tensor) -> bool:
        """Every shard given takes part (the caller picked those of the trained parameters: a ``DTensor``'s local
        tensor does not itself require a gradient)."""
        return True

    def _start(self, members: list[int], merge_in: int, buffers: bool, fragment: int = -1) -> InFlight:
        """``OuterStep``'s start; the buffers, averaged across the nodes there, are then averaged inside the node,
        so that every process holds the mean over all processes (equal node sizes)."""
        flight = super()._start(members, merge_in, buffers, fragment)
        size = self.shard_node.world_size
        if buffers and self.buffers and size > 1:
            for buffer in self.buffers:
                self.shard_node.all_reduce(buffer.data, "DiLoCo: the buffers inside the node").wait()
                buffer.data.div_(size)
        return flight

    def _average(self, flight: InFlight, numel: int) -> tuple[Tensor, bool, int, float]:
        """``OuterStep``'s mean of this shard across the nodes, with the verdict agreed inside the node: the outer
        step is taken only if every shard's mean is finite (the processes across the nodes already agree on
        their shard's). The exchange's memory of a shard whose mean was finite is committed all the same."""
        average, finite, sent, link = super()._average(flight, numel)
        flag = torch.tensor([0.0 if finite else 1.0], device=self.device)
        flag = self.shard_node.all_reduce(flag, "DiLoCo: the outer step's verdict inside the node").wait()
        return average, bool(flag.item() == 0.0), sent, link


def outer_state_bytes(outer: OuterStep) -> int:
    """Bytes of the state this process keeps across outer steps: its global weights, the outer optimizer's state
    (the momentum) and the outer exchange's committed memory (residuals, error feedback)."""
    total = sum(g.numel() * g.element_size() for g in outer.global_params)
    for state in outer.outer_optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, Tensor))
    if outer.exchange_state is not None:
        for by_name in outer.exchange_state.memory.committed.values():
            total += sum(t.numel() * t.element_size() for t in by_name.values())
    return total


# -- checkpoints ---------------------------------------------------------------------------------------------------
def plain_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every tensor as this process holds it (a ``DTensor``'s local shard), on the
    host: the inner optimizer's state of this process alone (``torch.load(weights_only=True)``-loadable)."""
    saved = optimizer.state_dict()
    with torch.no_grad():
        state = {
            index: {k: local_shard(v).detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in s.items()}
            for index, s in saved["state"].items()
        }  # fmt: skip
    return {"state": state, "param_groups": saved["param_groups"]}


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], owner: str) -> None:
    """Copy :func:`plain_optimizer_state` into ``optimizer``'s state, in place (its tensors, ``DTensor`` or not, exist
    already: ``torch.distributed.checkpoint`` loaded them); a ``RuntimeError`` says what does not fit."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        for index, values in saved["state"].items():
            current = optimizer.state[params[int(index)]] if int(index) < len(params) else {}
            for key, value in values.items():
                if not isinstance(value, Tensor):
                    current[key] = value
                    continue
                target = current.get(key)
                if not isinstance(target, Tensor) or tuple(local_shard(target).shape) != tuple(value.shape):
                    raise RuntimeError(
                        f"{owner}: this process's inner optimizer state ({key!r} of parameter {index}) does not fit"
                        " the optimizer the checkpoint loaded: resume with the optimizer that saved it."
                    )
                local_shard(target).copy_(value)


def momentum_dtensors(outer: OuterStep, trained: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The outer momentum of every trained parameter as a ``DTensor`` laid out as the parameter (FSDP2's): what
    ``torch.distributed.checkpoint`` saves once per shard (the nodes hold the same) and loads into another layout.
    A parameter without momentum yet, or with no values on this process, gets zeros (SGD's first step puts the
    gradient into a zero buffer: the same step)."""
    from torch.distributed.tensor import DTensor

    buffers = {
        name: outer.outer_optimizer.state.get(g, {}).get("momentum_buffer")
        for name, g in zip(outer.names, outer.global_params, strict=True)
    }
    out = {}
    with torch.no_grad():
        for name, param in trained:
            shard = local_shard(param)
            buffer = buffers.get(name)
            local = buffer.detach().to(shard.device, copy=True) if buffer is not None else torch.zeros_like(shard, dtype=torch.float32)
            out[name] = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )  # fmt: skip
    return out
