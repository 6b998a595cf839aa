"""The exchange's memory: per-parameter buffers that live across steps, committed once per step.

What an algorithm holds back between steps lives here, per parameter name and *kind*: DGC's
``momentum`` u and ``velocity`` v (momentum correction, Lin et al., 2018: ``u <- m u + g``,
``v <- v + u``; values are selected from v, and what is sent is cleared from v and, with momentum
factor masking, from u), PowerSGD's ``error`` and ``q``, ... Names, not DDP bucket indices, are the
keys: DDP rebuilds its buckets after the first step.

One object owns the whole lifecycle of a step (:class:`ResidualMemory`). An algorithm either writes
the new values into *scratch* buffers and stages them (small buffers), or notes a *replay*: a function
that updates the committed buffers in place, run only at commit, from what the step kept (DGC's and
DEFT's momentum correction replays from the local gradient, PowerSGD's error from the compensated
gradient in the bucket), with the very operations that made what was selected and sent, so that the
result is the same bits and no model-sized scratch buffer is needed. The decode callbacks note their
buckets; one call per optimizer step, :meth:`ResidualMemory.finish_step`, waits for the buckets and
commits (replays, then staged buffers) if the step was finite on every rank, or discards everything: a
skipped step (inf/NaN anywhere, e.g. under a GradScaler) leaves the memory exactly as it was, bit for
bit, so nothing is lost or poisoned. Buffers of a kind an algorithm never writes are never allocated
(no momentum without momentum).

The tensor math on these buffers (momentum correction, clipping) is :mod:`lightning_dgc.tensor_ops.momentum`; handing
the heap's free pages back at the end of a step when they grew, :mod:`lightning_dgc.tensor_ops.heap`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dgc.tensor_ops.heap import trim_after_step, tune_for_steps


def bucket_order_flat(tensor: Tensor) -> Tensor:
    """``tensor`` as a 1-D tensor in the order DDP lays its gradient out in a bucket.

    DDP matches the parameter's memory layout when the parameter is non-overlapping and dense
    (``channels_last`` weights included) and falls back to C order otherwise; so the flat bucket
    segment of a ``channels_last`` weight is in memory order, not in ``reshape(-1)``'s logical order.
    A view where possible (always for dense tensors), else a copy.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    by_stride = tensor.permute(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    if by_stride.is_contiguous():  # non-overlapping and dense: memory order
        return by_stride.view(-1)
    return tensor.reshape(-1)


def write_bucket_order_(tensor: Tensor, flat: Tensor) -> None:
    """Write ``flat`` (bucket order, see :func:`bucket_order_flat`) into ``tensor``; nothing when it is a view of ``flat``."""
    target = bucket_order_flat(tensor)
    if target.data_ptr() == flat.data_ptr() and target.dtype == flat.dtype:
        return  # DDP's gradient_as_bucket_view: the gradient is this part of the bucket
    if target.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():  # a view
        target.copy_(flat)
    else:  # a copy (overlapping or strided layout): C order
        tensor.copy_(flat.view(tensor.shape))


#: A function that applies this step's update of some buffers in place, at commit (``skip(name)``: a
#: parameter unused in the step, whose buffers must stay as they are).
Replay = Callable[[Callable[[str], bool]], None]


def clear_(memory: Tensor, positions: Tensor, sent: Tensor | None = None, unsent: Tensor | None = None) -> None:
    """Clear what was sent from one flat buffer: zero ``memory`` at ``positions`` (only where ``sent``, if given:
    positions are then distinct), or set it to ``unsent`` there (what the wire's rounding left out of each sent
    value, which error feedback keeps)."""
    if unsent is not None:
        memory.index_copy_(0, positions, unsent.to(memory.dtype))
    elif sent is None:
        memory.index_fill_(0, positions, 0.0)
    else:
        memory[positions] = torch.where(sent, 0.0, memory[positions])


class ResidualMemory:
    """Per-parameter buffers by kind, and the step that commits them (see the module docstring).

    ``buffer(kind, name, ...)`` is the committed tensor (zeros when new); ``scratch(kind, name)`` a
    buffer of the same shape that an algorithm writes this step's value into, and ``stage(kind, name)``
    marks it to become the committed tensor at :meth:`commit` (the two swap: no copy, no allocation
    after the first step). The committed tensors are the state: :meth:`state_dict` holds them only.

    :meth:`group` lays the flat buffers of several parameters (a bucket's compressed tensors) out
    contiguously, committed and scratch alike, so that batched work (one kernel over a bucket on the
    GPU) reads and writes one flat tensor; each parameter's buffers are views into it. A group whose
    parameters are all staged swaps its two flat buffers at commit; otherwise the staged views are
    copied. :meth:`flat` is the committed flat alone, for algorithms that commit by :meth:`note_replay`.
    """

    def __init__(self) -> None:
        self.committed: dict[str, dict[str, Tensor]] = {}  # kind -> name -> tensor
        self._scratch: dict[tuple[str, str], Tensor] = {}
        self._staged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # decode callbacks of different buckets may stage at once
        self._futures: list[torch.futures.Future] = []
        self._finite: list[Tensor] = []
        self._groups: dict[
            tuple[str, tuple[str, ...]], list[Tensor]
        ] = {}  # (kind, names) -> [committed, scratch]
        self._group_of: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
        self._replays: list[tuple[tuple[str, ...], Replay]] = []  # applied in place at commit
        self._deliveries: list[Callable[[bool], None]] = []  # run by finish_step after the verdict
        self._skip: set[str] = set()  # names unused this step (unstaged): replays leave them alone
        #: Whether a buffer lives in host memory: each step then ends by handing the heap's free pages
        #: back if they grew since the last time (:func:`lightning_dgc.tensor_ops.heap.trim_after_step`).
        self.on_host = False

    def __getstate__(self) -> dict[str, Any]:  # pickled without the lock, which does not pickle; the copy gets its own
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # -- buffers ---------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the memory holds: its committed buffers and their scratch (each storage once, however many
        views of it the parameters have)."""
        tensors = [t for by_name in self.committed.values() for t in by_name.values()]
        tensors += [t for t in self._scratch.values()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
        return sum(storages.values())

    def has(self, kind: str, name: str) -> bool:
        return name in self.committed.get(kind, {})

    def buffer(self, kind: str, name: str, shape: Sequence[int] | int, device: torch.device) -> Tensor:
        """The committed ``kind`` buffer of ``name`` (fp32), created as zeros of ``shape`` on first use."""
        by_name = self.committed.setdefault(kind, {})
        tensor = by_name.get(name)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if tensor is None or tuple(tensor.shape) != shape or tensor.device != device:
            tensor = by_name[name] = torch.zeros(shape, dtype=torch.float32, device=device)
            self._scratch.pop((kind, name), None)
            self.on_host = self.on_host or tensor.is_cpu
        return tensor

    def group(
        self, kind: str, names: Sequence[str], sizes: Sequence[int], device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """``(committed, scratch)``: flat buffers holding the ``kind`` buffers of ``names`` one after the other.

        Made on first use (what the parameters already hold is copied in, zeros otherwise); from then on
        ``buffer``/``scratch`` of each name are views into these two.
        """
        committed = self.flat(kind, names, sizes, device)
        flats = self._groups[kind, tuple(names)]
        if flats[1] is None:
            flats[1] = torch.empty_like(committed)
            offset = 0
            for name, size in zip(names, sizes, strict=True):
                self._scratch[kind, name] = flats[1][offset : offset + size]
                offset += size
        return committed, flats[1]

    def flat(self, kind: str, names: Sequence[str], sizes: Sequence[int], device: torch.device) -> Tensor:
        """The committed ``kind`` buffers of ``names`` as one flat tensor (:meth:`group` without its scratch).

        What an algorithm that updates its memory in place at commit (:meth:`note_replay`) uses: no
        buffer of the same size is kept beside it.
        """
        key = (kind, tuple(names))
        flats = self._groups.get(key)
        if flats is not None and flats[0].device == device:
            return flats[0]
        total = sum(sizes)
        committed = torch.zeros(total, dtype=torch.float32, device=device)
        self.on_host = self.on_host or committed.is_cpu
        by_name = self.committed.setdefault(kind, {})
        offset = 0
        for name, size in zip(names, sizes, strict=True):
            view = committed[offset : offset + size]
            old = by_name.get(name)
            if old is not None and old.numel() == size:
                view.copy_(old.reshape(-1))
            by_name[name] = view
            self._scratch.pop((kind, name), None)
            previous = self._group_of.pop((kind, name), None)
            if previous is not None:  # the name leaves an older group (DDP rebuilt its buckets)
                self._dissolve(previous)
            self._group_of[kind, name] = key
            offset += size
        self._groups[key] = [committed, None]  # the scratch flat: made by group() when asked for
        return committed

    def _dissolve(self, key: tuple[str, tuple[str, ...]]) -> None:
        """Forget a group: its names keep their views, as separate buffers from now on."""
        if self._groups.pop(key, None) is not None:
            for name in key[1]:
                if self._group_of.get((key[0], name)) == key:
                    del self._group_of[key[0], name]

    def scratch(self, kind: str, name: str) -> Tensor:
        """A buffer shaped like the committed one, to write this step's value into (contents undefined)."""
        committed = self.committed[kind][name]
        tensor = self._scratch.get((kind, name))
        if tensor is None:
            tensor = self._scratch[kind, name] = torch.empty_like(committed)
        return tensor

    def stage(self, kind: str, name: str) -> None:
        """The scratch buffer of ``(kind, name)`` holds this step's value: commit it with the step."""
        with self._lock:
            self._staged.add((kind, name))

    def unstage(self, name: str) -> None:
        """Forget every buffer of ``name`` staged this step (its committed state stays as it is)."""
        with self._lock:
            self._staged = {key for key in self._staged if key[1] != name}
            self._skip.add(name)

    def note_replay(self, names: Sequence[str], replay: Replay) -> None:
        """``replay(skip)`` writes this step's update of the buffers of ``names`` in place at :meth:`commit`.

        The alternative to scratch buffers: nothing of the memory is written before the step is known to
        be finite on every rank, and a skipped step does not run it. ``skip(name)`` is true for a
        parameter unused in the step (its buffers must stay as they are).
        """
        with self._lock:
            self._replays.append((tuple(names), replay))

    def note_delivery(self, deliver: Callable[[bool], None]) -> None:
        """``deliver(finite)`` runs in :meth:`finish_step` once the verdict is known, after the replays and
        before the staged buffers are committed (it may stage more)."""
        with self._lock:
            self._deliveries.append(deliver)

    @property
    def staged_names(self) -> set[str]:
        return {name for _, name in self._staged} | {name for names, _ in self._replays for name in names}

    def commit(self) -> None:
        """Make every staged scratch buffer the committed one (the old committed one becomes scratch)."""
        self._run_replays()
        with self._lock:
            staged, self._staged = self._staged, set()
            self._skip = set()
        for key, flats in list(self._groups.items()):
            kind, names = key
            if flats[1] is not None and all((kind, name) in staged for name in names):  # the whole group: swap the flat buffers
                flats.reverse()
                committed = self.committed[kind]
                for name in names:
                    committed[name], self._scratch[kind, name] = self._scratch[kind, name], committed[name]
                    staged.discard((kind, name))
        for kind, name in staged:
            committed = self.committed[kind]
            if (kind, name) in self._group_of:  # part of a group whose other members stay: copy
                committed[name].copy_(self._scratch[kind, name])
            else:
                committed[name], self._scratch[kind, name] = self._scratch[kind, name], committed[name]

    def _run_replays(self) -> None:
        with self._lock:
            replays, self._replays = self._replays, []
            skip = set(self._skip)
        for _, replay in replays:
            replay(skip.__contains__)

    def discard(self) -> None:
        """Forget everything staged: the committed state stays as it was before the step."""
        with self._lock:
            self._staged = set()
            self._replays = []
            self._skip = set()

    # -- the step ---------------------------------------------------------------------------------------
    def note_bucket(self, future: torch.futures.Future) -> None:
        """The future the hook returned for a bucket (waited on by :meth:`finish_step`)."""
        with self._lock:
            self._futures.append(future)

    def note_finite(self, flag: Tensor) -> None:
        """Whether a decoded bucket was finite (a 0-d bool tensor, identical on every rank)."""
        with self._lock:
            self._finite.append(flag)

    def wait_buckets(self) -> None:
        """Wait for every bucket noted since the last step (re-raises a failed exchange)."""
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            future.wait()

    def finish_step(self, unused: Callable[[str], bool] | None = None, trim: bool = True) -> bool:
        """Close the step: commit if every bucket decoded finite, else discard. Returns finiteness.

        Waits first on every bucket's future, which re-raises a failed exchange and, on CUDA, orders
        this stream after the decode callbacks (the host waits until every callback has run; the
        verdict itself is one more synchronisation). Every rank reaches the same verdict: it is computed from the decoded buckets, identical on all ranks. ``unused(name)``
        says which parameters did not take part in the step: their staged buffers are dropped. For memory on the
        host: glibc's thresholds fixed (:func:`~lightning_dgc.tensor_ops.heap.tune_for_steps`) and, with ``trim``, the heap's
        free pages handed back if they grew (:func:`~lightning_dgc.tensor_ops.heap.trim_after_step`).
        """
        self.wait_buckets()
        with self._lock:
            flags, self._finite = self._finite, []
        finite = bool(torch.stack(flags).all()) if flags else True
        if finite and unused is not None:
            for name in [n for n in self.staged_names if unused(n)]:
                self.unstage(name)
        if finite:  # the in-place updates first: they read what the deliveries overwrite
            self._run_replays()
        with self._lock:
            deliveries, self._deliveries = self._deliveries, []
        for deliver in deliveries:
            deliver(finite)
        if finite and unused is not None:  # what a deferred decode staged (momentum of tensors averaged dense)
            for name in [n for n in self.staged_names if unused(n)]:
                self.unstage(name)
        if finite:
            self.commit()
        else:
            self.discard()
        if self.on_host:
            tune_for_steps()
            if trim:
                trim_after_step()
        return finite

    # -- inspection and checkpoints -------------------------------------------------------------------------
    def residual_norm(self, kind: str) -> float:
        """L2 norm of every committed ``kind`` buffer together (what is held back, for monitoring)."""
        tensors = list(self.committed.get(kind, {}).values())
        if not tensors:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))

    def state_dict(self, copy: bool = True) -> dict[str, dict[str, Tensor]]:
        """The committed buffers only, ``{kind: {name: tensor}}``, on the CPU.

        ``copy=False`` (for a state written out at once, before training goes on): a CPU buffer is returned as
        it is, without a copy, where the buffers returned cover its storage (a flat group's views are written
        as the one storage they share); any other is copied.
        """
        tensors = [t.detach() for by_name in self.committed.values() for t in by_name.values()]
        covered: dict[int, int] = {}
        for t in tensors:
            if t.is_cpu:
                key = t.untyped_storage().data_ptr()
                covered[key] = covered.get(key, 0) + t.numel() * t.element_size()

        def out(t: Tensor) -> Tensor:
            t = t.detach()
            if not copy and t.is_cpu and covered.get(t.untyped_storage().data_ptr()) == t.untyped_storage().nbytes():
                return t
            return t.cpu().clone()

        return {kind: {name: out(t) for name, t in by_name.items()} for kind, by_name in self.committed.items()}

    def load_state_dict(
        self, state: dict[str, dict[str, Tensor]], device: torch.device | None = None
    ) -> None:
        """Restore buffers saved by :meth:`state_dict` (scratch buffers are made again when needed)."""
        self.committed = {
            kind: {
                name: t.to(device if device is not None else t.device, torch.float32).clone()
                for name, t in by_name.items()
            }
            for kind, by_name in state.items()
        }
        self.on_host = any(t.is_cpu for by_name in self.committed.values() for t in by_name.values())
        self._scratch.clear()
        self._groups.clear()
        self._group_of.clear()
        self._deliveries = []
        self.discard()
