"""What a compression algorithm is: its configuration, its per-bucket plan, its steps and its wire cost.

The generic hook (:mod:`lightning_dgc.exchange.hook`) drives one :class:`Algorithm` per run, bucket by bucket:

1. :meth:`Algorithm.plan` once per bucket layout (and whatever :meth:`Algorithm.plan_key` says changes it);
2. :meth:`Algorithm.compensate`: the local gradient plus what the memory holds back (error feedback,
   momentum correction), into a temporary or scratch memory (the memory itself is updated at commit);
3. :meth:`Algorithm.select`: what to send (timed as the selection);
4. :meth:`Algorithm.exchange`: the collectives, through the injected :class:`~lightning_dgc.comm.Collectives`,
   all started from the hook's thread in the same order on every rank;
5. :meth:`Algorithm.decode`: the averaged update, once the collectives are done;

and :meth:`Algorithm.wire_cost` says what a bucket puts on the wire, read by the runtime statistics and
by :mod:`lightning_dgc.perfmodel` alike, so that each formula is written once. An algorithm registers
itself under a name with :func:`register`; ``Trainer(strategy="<name>")`` then works.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_dgc.algorithms.context import ExchangeContext
    from lightning_dgc.comm import Collectives, Pending


@dataclass
class AlgorithmConfig:
    """Base of an algorithm's hyper-parameters: a dataclass, validated (and normalised) on construction.

    Subclasses document every field in their docstring: the one place a hyper-parameter is described.
    Two field names have a meaning outside the algorithm; declare them as fields to opt in:

    * ``density: float``: the fraction of values a step sends, in (0, 1]. ``ExchangeState.density``,
      the strategy's ``density`` and :class:`~lightning_dgc.schedules.warmup.SparsityWarmup` change it, the
      statistics report it, and a new value makes new plans (see :meth:`Algorithm.plan_key`). Without
      the field it is ``None``: the algorithm has no density, and setting one raises an error.
    * ``seed: int``: seeds the per-rank generator (``state.generator``) and the draws shared by every
      rank (``state.draw_generator``, ``state.tensor_generator``: see
      :class:`~lightning_dgc.algorithms.context.ExchangeContext`); 0 without the field.
    """

    # Not annotated, so that they are no dataclass fields here: a subclass's own fields keep their order.
    density = None  # float | None: a subclass declares ``density: float = ...`` as a field
    seed = 0  # int: likewise ``seed: int = ...``

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ``ValueError`` that names the argument and says how to fix it."""

    def fingerprint(self, exclude: tuple[str, ...] = ("density",)) -> str:
        """A short hash of the settings that must agree across ranks (a schedule may change ``density``)."""
        items = {k: v for k, v in asdict(self).items() if k not in exclude}
        return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter of a bucket: where its gradient lies in the bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def layout_of(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorSpec]:
    """The :class:`TensorSpec` of consecutive tensors of these shapes (as DDP packs a bucket)."""
    specs, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        numel = 1
        for size in shape:
            numel *= int(size)
        specs.append(TensorSpec(name, tuple(int(s) for s in shape), offset, numel))
        offset += numel
    return specs


def ring_allreduce_volume(nbytes: float, n: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``: ``2 (n-1)/n S``."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def allgather_volume(payload: float, n: int) -> float:
    """Bytes each worker receives in an all-gather of ``payload`` bytes per worker: ``(n-1) P``."""
    return (n - 1) * payload if n > 1 else 0.0


@dataclass(frozen=True)
class Message:
    """One collective a bucket's exchange runs per step: what this rank contributes to it.

    ``role``: ``"payload"`` (the compressed gradient: values, indices, factors), ``"dense"`` (tensors
    averaged uncompressed) or ``"control"`` (what ranks exchange to agree on a plan). ``blocking``: the
    hook waits for it before the bucket's next step, so it cannot overlap with the backward pass.
    """

    collective: Literal["all_reduce", "all_gather"]
    nbytes: int
    role: Literal["payload", "dense", "control"]
    blocking: bool = False


@dataclass(frozen=True)
class WireCost:
    """What one bucket puts on the wire per step and rank.

    ``k``: values the algorithm selects (0 when it does not select values); ``values_sent``: values
    this rank's messages carry in all; ``padding_bytes``: alignment bytes inside the payload.
    """

    messages: tuple[Message, ...]
    dense_bytes: int  # what plain DDP would all-reduce for the bucket
    numel: int
    k: int = 0
    values_sent: int = 0
    padding_bytes: int = 0

    def bytes_of(self, role: str) -> int:
        return sum(m.nbytes for m in self.messages if m.role == role)

    @property
    def bytes_sent(self) -> int:
        return sum(m.nbytes for m in self.messages)

    def link_bytes(self, world_size: int) -> float:
        """Bytes each worker's link carries per step (in each direction) when every collective is a
        ring: what a slow network pays, unlike :attr:`bytes_sent` (what this rank hands to the
        collectives), since an all-gather forwards every rank's payload to every other."""
        volume = {"all_reduce": ring_allreduce_volume, "all_gather": allgather_volume}
        return sum(volume[m.collective](m.nbytes, world_size) for m in self.messages)


@dataclass
class BucketPlan:
    """The least a plan holds (the hook and the statistics read both); an algorithm's plan may subclass
    it (its own fields then need defaults, or ``@dataclass(kw_only=True)``), or declare both itself."""

    layout: list[TensorSpec]  # the bucket's tensors, in bucket order
    dense_bytes: int  # what plain DDP would all-reduce for the bucket (numel * the bucket's element size)


@dataclass
class BucketWork:
    """What one hook call carries from step to step (an algorithm subclasses it for its own tensors).

    ``keep``: tensors made on the hook's stream that the decode reads. On CUDA the decode runs on
    another stream; every tensor in ``keep`` is recorded on it, so that the caching allocator does
    not reuse its memory before the decode's kernels ran. The hook adds ``flat`` when it is a copy of
    a non-fp32 bucket, and every collective's output; an algorithm adds whatever else it makes in
    steps 2-4 and reads in step 5. Buffers that live across steps (memory, plan buffers) are made
    before the collectives start (in :meth:`Algorithm.plan` or :meth:`Algorithm.compensate`), never
    in the decode.

    ``stats``: measured extras for ``compression_stats()``, all optional: ``"rank_selected"`` (values
    this rank selected), ``"union_values"`` (distinct indices of all ranks' selections, set only when
    ``state.measures_buildup``; it gives ``buildup_factor``), ``"rank_selection_ms"``, ``"plan"``.
    """

    grads: list[Tensor]  # per tensor of the plan: the local gradient, fp32, flat views of one buffer
    flat: Tensor  # the bucket's local gradient, fp32 (``grads`` are views of it)
    keep: list[Tensor] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # measured extras for compression_stats()
    # 0, or NaN when this rank's gradient is not finite (set by the hook after step 2). An algorithm that
    # does not send every value adds it to what it sends, so that every rank decodes a non-finite bucket.
    poison: Tensor | None = None
    selection_s: float | None = None  # set by an algorithm that selects outside step 3 (DEFT)


ConfigT = TypeVar("ConfigT", bound=AlgorithmConfig)
PlanT = TypeVar("PlanT")
WorkT = TypeVar("WorkT", bound=BucketWork)


class Algorithm(ABC, Generic[ConfigT, PlanT, WorkT]):
    """One run's compression algorithm, driven by the generic hook (see the module docstring).

    Class attributes:
        name: the registered name (also ``Trainer(strategy=name)``).
        config_class: its hyper-parameters.
        takes_over_momentum: whether SGD's momentum, Nesterov and weight decay are applied inside the
            exchange (set to 0 in the optimizer while ``fit`` runs), as DGC's momentum correction does.
            Such an algorithm applies them once per optimizer step: in a backward pass that adds to a step an
            earlier pass already exchanged, ``state.continues(name)`` is true, and the pass's gradient is
            added without a second momentum decay or weight decay
            (:func:`lightning_dgc.tensor_ops.momentum.continuation_factors`).
        memory_kinds: the per-parameter buffers it keeps (the checkpoint's ``"memory"`` keys).
        residual_kind: the memory kind that holds back gradient not yet sent (DGC's ``"velocity"``,
            an error-feedback algorithm's ``"error"``): ``state.residual_norm()`` reports its norm.
            ``None`` (the default): the algorithm holds nothing back, and the norm is not reported.
        state_settings: configuration fields that shape the memory: a checkpoint saved with other values
            of them is refused on resume (PowerSGD's ``matrix_approximation_rank``).
        dense_is_ddp: whether a step at density 1 sends every residual whole and is otherwise DDP + SGD, its
            momentum (if taken over) in ``"momentum"`` buffers with the top-k algorithms' convention
            (:mod:`lightning_dgc.algorithms.sparse`), so that the steps after it may be DDP's own
            (:func:`~lightning_dgc.exchange.passthrough.enter_passthrough`). DGC and DEFT: true; default false.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[AlgorithmConfig]]
    memory_kinds: ClassVar[tuple[str, ...]] = ()
    residual_kind: ClassVar[str | None] = None
    state_settings: ClassVar[tuple[str, ...]] = ()
    dense_is_ddp: ClassVar[bool] = False

    def __init__(self, config: ConfigT, state: ExchangeContext) -> None:
        self.config = config
        #: The exchange as this algorithm sees it (:class:`~lightning_dgc.algorithms.context.ExchangeContext`).
        self.state = state

    @property
    def takes_over_momentum(self) -> bool:
        return False

    # -- helpers for step 2 ------------------------------------------------------------------------------
    def error_feedback(self, layout: Sequence[TensorSpec], flat: Tensor, kind: str | None = None) -> Tensor:
        """Error feedback in one call: the gradient plus what was held back, in a flat fp32 buffer.

        ``layout``: the tensors to compensate (often the plan's whole ``layout``); ``flat``: their
        gradients one after the other (``flat`` of :meth:`compensate` when ``layout`` is the bucket's).
        Returns ``residual + flat`` in the scratch buffer of the memory ``kind`` (default
        :attr:`residual_kind`), staged: whatever the algorithm leaves in it is held back for the next
        step. So subtract what you send from it (in :meth:`select` or :meth:`decode`), e.g.
        ``residual[idx] = 0`` after sending ``residual[idx]``. It is committed with the step, or
        discarded on every rank if the step is skipped (inf/NaN); checkpoints save it per rank.
        Call it in :meth:`compensate` (on the hook's stream: the buffers are made there).
        """
        kind = kind if kind is not None else self.residual_kind
        if kind is None:
            raise ValueError(
                f"{type(self).__name__}.error_feedback() needs a memory kind: pass `kind=` or set the class"
                ' attribute `residual_kind` (e.g. `residual_kind = "error"`, listed in `memory_kinds`).'
            )
        memory = self.state.memory
        names = [spec.name for spec in layout]
        sizes = [spec.numel for spec in layout]
        if sum(sizes) != flat.numel():
            raise ValueError(
                f"error_feedback(): `flat` holds {flat.numel()} values but the tensors of `layout` {sum(sizes)};"
                " pass the gradients of exactly these tensors, one after the other."
            )
        committed, scratch = memory.group(kind, names, sizes, flat.device)
        torch.add(committed, flat.reshape(-1), out=scratch)
        for name in names:
            memory.stage(kind, name)
        return scratch

    # -- the plan --------------------------------------------------------------------------------------
    def plan_key(self) -> tuple[Any, ...]:
        """What, besides the bucket layout, the plan depends on (a new value makes a new plan)."""
        return ()

    @abstractmethod
    def plan(self, layout: list[TensorSpec], buffer: Tensor) -> PlanT:
        """What the algorithm decides once per bucket layout (``buffer``: the bucket's gradients, for their
        device and dtype): which tensors it compresses, its buffers, ... The plan must have ``layout``
        and ``dense_bytes`` (what plain DDP would send for the bucket) attributes: subclass
        :class:`BucketPlan`, or declare both."""

    # -- the step --------------------------------------------------------------------------------------
    @abstractmethod
    def compensate(self, plan: PlanT, grads: list[Tensor], flat: Tensor) -> WorkT:
        """Step 2: add what the memory holds back to the local gradient, into scratch memory."""

    @abstractmethod
    def select(self, plan: PlanT, work: WorkT) -> None:
        """Step 3: decide what to send (may stage what was sent for the memory)."""

    @abstractmethod
    def exchange(self, plan: PlanT, work: WorkT, collectives: Collectives) -> list[Pending]:
        """Step 4: start the collectives (in the same order on every rank); the decode waits for the
        returned ones. An exchange of several rounds waits for a round with ``Pending.wait()``. What
        is sent must carry ``work.poison`` (see :class:`BucketWork`) unless it is every value."""

    @abstractmethod
    def decode(self, plan: PlanT, work: WorkT) -> Tensor:
        """Step 5: the averaged update of the bucket, fp32, flat in bucket order (runs in a callback)."""

    def decoded_finite(self, plan: PlanT, work: WorkT) -> Tensor | None:
        """Whether what every rank sent for the bucket is finite (a 0-d bool tensor, identical on every rank),
        known before :meth:`decode` runs; ``None`` when the algorithm cannot tell before decoding.

        An algorithm that answers lets the decode wait until :meth:`ExchangeState.finish_step` when
        ``state.finish_writes_grads`` is set: the hook then hands DDP the bucket as it is and the averaged
        update is written into the parameters' gradients after the memory was committed, so that the local
        gradient the commit replays from needs no copy (see :mod:`lightning_dgc.exchange.hook`).
        """
        return None

    # -- the cost ----------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def wire_cost(
        cls, config: ConfigT, layout: list[TensorSpec], world_size: int, dense_bytes: int
    ) -> WireCost:
        """What a bucket of this layout puts on the wire per (compressing) step, at ``world_size`` ranks."""

    @classmethod
    def selection_share(cls, world_size: int) -> float:
        """The part of a DGC-style top-k over the whole gradient each rank runs per step (for the
        performance model): 1 for DGC, ``1 / world_size`` for DEFT, 0 for an algorithm that selects nothing."""
        return 0.0

    def cost(self, plan: PlanT) -> WireCost:
        """This step's :meth:`wire_cost` for ``plan`` (an algorithm may vary it, e.g. before compressing)."""
        layout: list[TensorSpec] = plan.layout  # type: ignore[attr-defined]
        return self.wire_cost(self.config, layout, self.state.world_size, plan.dense_bytes)  # type: ignore[attr-defined]

    # -- statistics and checkpoints ------------------------------------------------------------------------
    def memory_shape(self, kind: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of the ``kind`` buffer this run keeps for parameter ``name`` (of ``shape``), or ``None``
        if it keeps none; checkpoints are checked against it. Default: flat, one value per gradient value."""
        numel = 1
        for size in shape:
            numel *= int(size)
        return (numel,) if kind in self.memory_kinds else None

    def extra_state(self) -> dict[str, Any]:
        """Algorithm state beside the memory to keep in checkpoints (``weights_only``-loadable)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""


_REGISTRY: dict[str, type[Algorithm[Any, Any, Any]]] = {}
#: Called with every algorithm registered from outside the package (the front doors add strategy names for it).
_LISTENERS: list[Callable[[type], None]] = []

A = TypeVar("A", bound=type)


def register(cls: A) -> A:
    """Class decorator: register an :class:`Algorithm` under its ``name``.

    ``Trainer(strategy="<name>")`` (and ``"<name>_spawn"``, every form DDP's names have) then works whatever the
    import order: if ``lightning.pytorch`` is already imported the strategy names are registered at once, else as
    soon as it is (see :mod:`lightning_dgc`).
    """
    name = cls.name  # type: ignore[attr-defined]
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(
            f"an algorithm named {name!r} is already registered ({_REGISTRY[name].__qualname__})"
        )
    _REGISTRY[name] = cls  # type: ignore[assignment]
    if not cls.__module__.startswith("lightning_dgc."):  # the package's own are registered with it
        for listener in _LISTENERS:
            listener(cls)
    return cls


def on_register(listener: Callable[[type], None]) -> None:
    """Call ``listener`` with every algorithm registered from outside the package from now on (once per
    listener: :mod:`lightning_dgc.front.registration` adds the strategy names of each)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def registered() -> dict[str, type[Algorithm[Any, Any, Any]]]:
    """Every registered algorithm by name (importing this module imports :mod:`lightning_dgc.algorithms`
    first, which imports every algorithm module of the package)."""
    return dict(_REGISTRY)


def config_of(algorithm: str | AlgorithmConfig, options: dict[str, Any] | None = None) -> AlgorithmConfig:
    """A strategy's configuration: ``algorithm`` itself if it is one, else the registered algorithm's
    configuration class filled with ``options`` (validated there)."""
    if isinstance(algorithm, AlgorithmConfig):
        if options:
            raise ValueError("pass either a configuration object or `options`, not both")
        return algorithm
    return get(algorithm).config_class(**(options or {}))


def get(name: str) -> type[Algorithm[Any, Any, Any]]:
    """The algorithm registered as ``name``; a ``ValueError`` lists the names there are."""
    known = registered()
    if name not in known:
        raise ValueError(f"no compression algorithm named {name!r}; registered: {sorted(known)}")
    return known[name]


def algorithm_for(config: AlgorithmConfig) -> type[Algorithm[Any, Any, Any]]:
    """The registered algorithm whose configuration class is ``type(config)``."""
    for cls in registered().values():
        if cls.config_class is type(config):
            return cls
    raise ValueError(f"no registered algorithm takes a {type(config).__name__}")
