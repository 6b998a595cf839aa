"""What the sharded front doors share: the model as FSDP2 shards it inside the node, read, checked and hooked.

The sharded strategies (:mod:`lightning_dgc.front.hsdp`, :mod:`lightning_dgc.front.hsdp_fabric`) shard the model with
FSDP2 over the processes of each node (``mesh["data_parallel"]``, :func:`lightning_dgc.comm.mesh.sharded_mesh`) and
run the compressed exchange across the nodes on each FSDP group's gradient shard, from the group's all-reduce hook
(:func:`lightning_dgc.exchange.sharded.exchange_shard`). Here: the wrapping of given module classes
(:func:`shard_modules`), the checks that every trainable parameter is sharded the way the exchange reads it
(:func:`check_sharded`), each group's layout as this rank holds it (:func:`group_shard`), and the switch of
gradient synchronisation for accumulation (:func:`set_gradient_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_dgc import comm
from lightning_dgc.comm.mesh import mesh_topology, shard_group_ranks, sharded_mesh
from lightning_dgc.exchange.sharded import GroupShard

__all__ = [
    "CONFIGURE_MODEL_LINES", "check_nodes_on_hosts", "check_reduce", "check_sharded", "fsdp_modules", "group_shard", "node_mesh",
    "no_gradient_sync", "not_sharded", "set_gradient_sync", "shard_and_check", "shard_modules",
]  # fmt: skip

#: The lines a LightningModule adds to shard itself over the node (shown by the error for a module without them).
CONFIGURE_MODEL_LINES = (
    "    def configure_model(self):\n"
    "        from torch.distributed.fsdp import fully_shard\n"
    "        for block in self.blocks:  # the repeated layers (a transformer's blocks)\n"
    '            fully_shard(block, mesh=self.device_mesh["data_parallel"])\n'
    '        fully_shard(self, mesh=self.device_mesh["data_parallel"])'
)


def fsdp_modules(module: nn.Module) -> list[Any]:
    """The FSDP2 modules under ``module`` (itself included), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def param_group(module: Any) -> Any:
    """An FSDP2 module's parameter group (``None`` when it manages no parameter of its own)."""
    return module._get_fsdp_state()._fsdp_param_group


def shard_modules(module: nn.Module, classes: Iterable[type], mesh: Any, **fully_shard_kwargs: Any) -> int:
    """``fully_shard`` every submodule of one of ``classes`` over ``mesh``, innermost first, then ``module`` itself
    (what holds the rest); returns how many submodules were sharded."""
    from torch.distributed.fsdp import fully_shard

    classes = tuple(classes)
    found = [m for m in module.modules() if m is not module and isinstance(m, classes)]
    for submodule in reversed(found):  # children before their parents
        fully_shard(submodule, mesh=mesh, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    return len(found)


def check_sharded(module: nn.Module, node_ranks: list[int], owner: str) -> None:
    """A ``ValueError`` naming the fix unless every trainable parameter of ``module`` is sharded the way the exchange
    reads it: by FSDP2 (``fully_shard``), over the processes of this rank's node (``node_ranks``, the global ranks
    of ``mesh["data_parallel"]``), on dim 0, kept on the device (no CPU offload), with no tensor parallelism and
    no HSDP of FSDP's own (which would all-reduce across the nodes itself)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    fix = (
        " Shard the model over the node's processes only: in `configure_model`, `fully_shard(...,"
        ' mesh=self.device_mesh["data_parallel"])` on each block and on the module itself.'
    )
    grouped: dict[int, str] = {}
    for fsdp_module in fsdp_modules(module):
        group = param_group(fsdp_module)
        if group is None:
            continue
        where = type(fsdp_module).__name__
        if isinstance(group.mesh_info, DDPMeshInfo):
            raise ValueError(
                f"{owner}: a module ({where}) was sharded on a mesh of two dimensions (HSDP), whose own all-reduce"
                f" across the nodes would run at every step besides the strategy's own exchange.{fix}"
            )
        ranks = shard_group_ranks(group.mesh_info.shard_process_group)
        if ranks != node_ranks:
            raise ValueError(
                f"{owner}: a module ({where}) was sharded over the processes {ranks}, but this process's node is"
                f" {node_ranks}: the exchange runs across the nodes on each node's shards, so the model must be"
                f" sharded over exactly the node's processes, in their order.{fix}"
            )
        for fsdp_param in group.fsdp_params:
            if fsdp_param.offload_to_cpu:
                raise ValueError(
                    f"{owner} does not support FSDP2's CPU offload (`offload_policy=CPUOffloadPolicy()`): the"
                    " exchange reads and writes each gradient shard on the device, before FSDP moves it. Drop"
                    " the offload policy (the exchange keeps one shard's buffers per process), or train with"
                    " Lightning's ModelParallelStrategy without compression."
                )
            if fsdp_param.fsdp_placement.dim != 0 or fsdp_param.is_dtensor:
                raise ValueError(
                    f"{owner} exchanges each parameter's row block (FSDP2's `Shard(0)`); a parameter of {where} is"
                    f" {'tensor-parallel' if fsdp_param.is_dtensor else 'sharded on dim ' + str(fsdp_param.fsdp_placement.dim)}."
                    " Drop `shard_placement_fn` and tensor parallelism (not supported with compression)."
                )
            grouped[id(fsdp_param.sharded_param)] = where
    left = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in grouped]
    if left:
        shown = ", ".join(f"`{n}`" for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(
            f"{owner}: {len(left)} trainable parameter(s) are not sharded by FSDP2 ({shown}), so no process would"
            " average their gradients. Apply `fully_shard` to the module itself after its blocks, which takes"
            " every parameter not yet sharded:\n" + CONFIGURE_MODEL_LINES
        )


def check_reduce(module: nn.Module, owner: str) -> None:
    """A ``ValueError`` naming the fix unless every FSDP group hands its all-reduce hook the node's mean gradient:
    FSDP2 averages in the reduce-scatter itself for fp32 and bf16 reduces, but scales an fp16 reduce (or one with
    ``set_gradient_divide_factor``, or sums only) before and after it, the second time after the hook."""
    import torch

    for fsdp_module in fsdp_modules(module):
        group = param_group(fsdp_module)
        if group is None:
            continue
        reduces = {p.mp_policy.reduce_dtype or p.mp_policy.param_dtype or p.sharded_param.dtype
                   for p in group.fsdp_params if p.sharded_param.requires_grad}  # FSDP2's rule, before its lazy init
        reduce = next(iter(reduces), torch.float32)
        if (reduce not in (torch.float32, torch.bfloat16) or group.gradient_divide_factor is not None
                or group.force_sum_reduction_for_comms):  # fmt: skip
            raise ValueError(
                f"{owner}: a module ({type(fsdp_module).__name__}) reduces its gradients in {reduce}"
                " or with a divide factor of its own, which FSDP2 applies after the exchange's hook. Reduce in"
                " fp32 or bf16: `MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)` in `fully_shard`,"
                " and leave `set_gradient_divide_factor` and `set_force_sum_reduction_for_comms` unset."
            )


def node_mesh(strategy: Any, owner: str) -> tuple[Any, comm.Topology]:
    """The ``(replicate, data_parallel, tensor_parallel)`` mesh of a sharded door's nodes
    (:func:`~lightning_dgc.comm.mesh.sharded_mesh`) and this rank's view of it, once the ranks are checked: numbered
    node by node, each node's processes on one host. ``strategy`` has Lightning's ``num_nodes``, ``global_rank``,
    ``node_rank``, ``local_rank`` and ``root_device``; every rank calls this once its process group is up."""
    nodes = strategy.num_nodes
    ranks = comm.all_gather_object((strategy.global_rank, strategy.node_rank, strategy.local_rank))
    per_node = comm.check_node_layout(ranks, nodes, f"{owner} (FSDP2 inside each node)", "")  # type: ignore[arg-type]
    check_nodes_on_hosts(comm.all_gather_object(comm.host_key()), per_node, owner)  # type: ignore[arg-type]
    mesh = sharded_mesh(nodes, per_node, strategy.root_device.type)
    return mesh, mesh_topology(mesh)


def not_sharded(model: nn.Module, lightning_module: Any, sharded_modules: tuple[type, ...], owner: str) -> None:
    """A ``TypeError`` that shows the lines to add when the Trainer's ``model`` was not sharded by its
    ``configure_model`` and no ``sharded_modules`` are given to shard it."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if fsdp_modules(model) or sharded_modules:
        return
    where = "its configure_model" if is_overridden("configure_model", lightning_module) else "it"
    raise TypeError(
        f"{owner} shards the model over each node's processes with FSDP2, but {type(lightning_module).__name__} was"
        f" not sharded: add to {where}\n{CONFIGURE_MODEL_LINES}\nor pass the classes to shard:"
        f" {owner}(..., sharded_modules={{YourBlock}})."
    )


def shard_and_check(
    module: nn.Module, mesh: Any, owner: str, sharded_modules: tuple[type, ...] = (), mp_policy: Any = None,
    shard: Callable[[nn.Module, Any], nn.Module] | None = None,
) -> nn.Module:  # fmt: skip
    """``module`` sharded over ``mesh["data_parallel"]`` (the node) and checked (:func:`check_sharded`): by
    ``shard(module, mesh)`` (the user's), by ``sharded_modules`` (with ``mp_policy``), or already (a
    ``configure_model``). FSDP1 modules are refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    node = mesh["data_parallel"]
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError(f"{owner} shards with FSDP2 (`fully_shard`); the model holds FSDP1 modules.")
    if shard is not None:
        module = shard(module, mesh)
    elif not fsdp_modules(module) and sharded_modules:
        kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
        shard_modules(module, sharded_modules, node, **kwargs)
    check_sharded(module, shard_group_ranks(node.get_group()), owner)
    return module


def check_nodes_on_hosts(host_keys: list[float], per_node: int, owner: str) -> None:
    """A ``ValueError`` when the processes of one node (global ranks ``n * per_node`` to ``(n + 1) * per_node - 1``)
    run on more than one host (:func:`lightning_dgc.comm.host_key` of every rank, in rank order)."""
    for start in range(0, len(host_keys), per_node):
        if len(set(host_keys[start : start + per_node])) > 1:
            raise ValueError(
                f"{owner} shards the model over each node's processes, but those of node {start // per_node} (global"
                f" ranks {start} to {start + per_node - 1}) run on different hosts or network namespaces: FSDP's"
                " reduce-scatter and all-gather would cross a network link in every step, uncompressed. Launch each"
                " node's processes on one machine: Trainer(num_nodes=<machines>, devices=<processes on each>)."
            )


def group_shard(group: Any, name_of: Callable[[torch.Tensor], str]) -> GroupShard:
    """The layout of an FSDP2 parameter group's gradient shard on this rank (what its all-reduce hook receives): its
    trainable parameters in FSDP's order, each one's local row block and the values it takes, padding included."""
    names, shapes, slots = [], [], []
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.sharded_param
        if not param.requires_grad:
            continue
        names.append(name_of(param))
        shapes.append(tuple(fsdp_param.sharded_size))
        slots.append(fsdp_param.padded_sharded_param_size.numel())
    return GroupShard(tuple(names), tuple(shapes), tuple(slots))


def grads_alias_shard(group: Any, shard: torch.Tensor) -> bool:
    """Whether FSDP2 will make the group's sharded ``.grad`` views of ``shard`` (its reduce-scatter output), which it
    does when no parameter of the group holds a gradient yet (else it adds into it) and the shard is in the
    parameters' gradient dtype (else it casts a copy)."""
    return all(
        fsdp_param.sharded_param.grad is None and _grad_dtype_takes(fsdp_param, shard.dtype)
        for fsdp_param in group.fsdp_params
        if fsdp_param.sharded_param.requires_grad
    )


def _grad_dtype_takes(fsdp_param: Any, dtype: torch.dtype) -> bool:
    """Whether FSDP2 keeps a reduced gradient of ``dtype`` as it is for this parameter: torch 2.15 casts to the
    parameter's ``sharded_grad_dtype`` (``None``: any dtype), earlier releases to the parameter's own dtype."""
    if hasattr(fsdp_param, "sharded_grad_dtype"):
        return fsdp_param.sharded_grad_dtype in (None, dtype)
    return fsdp_param.orig_dtype == dtype


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync`` on every FSDP module under ``module``: off, a backward pass accumulates
    unsharded gradients and runs neither the reduce-scatter nor the exchange (gradient accumulation)."""
    for fsdp_module in fsdp_modules(module):
        fsdp_module.set_requires_gradient_sync(enabled, recurse=False)


@contextmanager
def no_gradient_sync(module: nn.Module | None) -> Iterator[None]:
    """Gradient sync off inside the block (:func:`set_gradient_sync`), on again after it: a sharded door's
    ``block_backward_sync``, which Lightning enters for the micro-steps of gradient accumulation (``module`` without
    FSDP2 modules, or ``None``: nothing)."""
    if module is None or not fsdp_modules(module):
        yield
        return
    set_gradient_sync(module, False)
    try:
        yield
    finally:
        set_gradient_sync(module, True)


def hooked_groups(module: nn.Module) -> Iterator[tuple[Any, Any]]:
    """Every FSDP2 module under ``module`` that manages parameters, with its parameter group."""
    for fsdp_module in fsdp_modules(module):
        group = param_group(fsdp_module)
        if group is not None:
            yield fsdp_module, group
