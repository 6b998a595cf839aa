"""A performance model of data-parallel training with DDP, DGC and DEFT: what speedup at N workers?

Our machines hold two workers; users run 8 to 256. Like the performance model behind the DGC paper
(Lin et al., ICLR 2018, Figure 6, after Wen et al., NeurIPS 2017), this module answers "what speedup
at N workers on links of bandwidth B" from what one node *measures* (a :class:`Profile`, written by
:class:`lightning_dgc.front.profiler.ExchangeProfiler`): the compute time of a step, the top-k selection
time, and the exact bytes every bucket puts on the wire, while communication is modelled
analytically. No process group and no Lightning: every function can be checked by hand.

Units: bytes for sizes, **bits per second** for bandwidths, seconds for times. ``L`` is a message step's latency:
gloo's step waits for the receiver to be ready, so on a network link it is about a round trip.

Collectives (flat network, ``n`` workers, bandwidth ``B``, latency ``L`` per message step):

* ring all-reduce of ``S`` bytes (dense DDP; DGC's and DEFT's small dense tensors; DEFT's vectors):
  every worker sends and receives ``2 (n-1)/n S`` bytes in ``2 (n-1)`` steps::

      T_allreduce(S) = 2 (n-1) L + 2 (n-1)/n * 8 S / B

* ring all-gather of a fixed-size payload ``P`` per worker (DGC's sparse exchange): every worker
  receives the ``n-1`` other payloads in ``n-1`` steps::

      T_allgather(P) = (n-1) L + (n-1) * 8 P / B

* sparse all-reduce, worst case (the paper's argument against it, section 2): recursive doubling in
  ``ceil(log2 n)`` steps where the density doubles at every step (the partners' indices never
  overlap), capped at the dense size ``D``::

      T_sparse_worst(P) = sum_{i < ceil(log2 n)} [ L + 8 min(2^i P, D) / B ]

Hierarchical network (:class:`Network` with ``gpus_per_node = G > 1``): ``g = min(G, n)`` workers
per node on a local bus (``local_bandwidth``, ``local_latency``), ``m = ceil(n / g)`` nodes on the
slow links. Every collective becomes *reduce within the node, exchange across nodes, broadcast within
the node*, with the bandwidth-optimal (Rabenseifner / van de Geijn) costs on the local bus::

    T_reduce(S, g)    = 2 (g-1) l + 2 (g-1)/g * 8 S / b      (reduce-scatter + gather)
    T_broadcast(S, g) = 2 (g-1) l + 2 (g-1)/g * 8 S / b      (scatter + all-gather)
    T_gather(P, g)    = (g-1) l + (g-1) * 8 P / b
    all-reduce:  T_reduce(S, g) + T_allreduce(S, m) + T_broadcast(S, g)
    all-gather:  T_gather(P, g) + T_allgather(g P, m) + T_broadcast(n P, g)
    worst case:  the first log2 g doubling steps on the local bus, the other ones on the slow links

With ``G = 1`` every local term vanishes and the flat formulas come back.

``Network(algorithm="best")`` lets every all-reduce and all-gather take the cheaper of the ring
and recursive doubling (``ceil(log2 n)`` steps; all-reduce ``log2 n * 8 S / B``, all-gather
``(n-1) * 8 P / B``), as MPI and NCCL pick short-message algorithms; the default is the ring.

What each method sends per bucket comes from the algorithm itself
(:meth:`lightning_dgc.algorithms.Algorithm.wire_cost`, the formula the runtime statistics use too):
a list of collectives (all-reduce or all-gather of so many bytes) in the order the hook issues them, some
*blocking* (the hook waits for them before it can go on, e.g. DEFT's norms and union indices, PowerSGD's P). ``ddp`` is one all-reduce of the bucket; ``sparse_allreduce`` is
DGC's payload exchanged by the worst-case sparse all-reduce above, plus the dense all-reduce (a bound,
not an implementation). The selection time of the profile (DGC's top-k over the whole gradient) is
charged as the algorithm says (:meth:`~lightning_dgc.algorithms.Algorithm.selection_share`): DGC in
full, DEFT split among the workers, PowerSGD not at all.

Step time of one worker: ``C`` compute (forward + backward + optimizer, measured), ``W`` the part of it that
communication can hide behind (the backward pass when the profile measured it), ``X`` the exchange's own work on the
host (the profile's measured ``exchange_s`` of the method, or else its top-k selection: DGC's in full, DEFT's split
among the workers), and the collectives on a timeline:

* a collective takes the longer of its latency steps and its bytes plus one step (a ring's steps overlap its
  bytes): ``max(steps L, 8 V / B + L)``, ``V`` its volume; a small message pays its steps, a large one its bytes;
* every compressing exchange first runs the settings check (an all-gather of 16 bytes over every worker, which the
  hook waits for: :data:`~lightning_dgc.perfmodel.step.SETTINGS_CHECK_BYTES`);
* the backward pass makes every bucket but the last ready at its start, the last at its end; each bucket's hook
  issues the algorithm's collectives in order (:meth:`~lightning_dgc.algorithms.Algorithm.wire_cost`); they run on
  ``Network.concurrency`` channels, each as soon as one is free (gloo: 2 threads per process group; NCCL: 1), and a
  blocking one (DEFT's norms and indices, PowerSGD's ``P``; the two-level exchange's reduce-scatter and exchange
  across nodes on the CPU) holds the hook, and the rest of the backward pass, until it ends;
* the step's bytes share one link: the last collective ends no sooner than the first began plus all their bytes;

then ``T = C + X + (held) + max(0, end - W - held)``, ``held`` what the hooks waited for, ``end`` when the last
collective ends. With one channel, no latency and nothing blocking this is ``C + X + max(0, c - c_last - W) +
c_last``, ``c`` the communication of all buckets and ``c_last`` the last bucket's, so overlap is never slower. With
one worker nothing is exchanged: ``T(1) = C`` for every method, so ``speedup(1) = 1`` and ``speedup(n) = n C /
T(n)``; throughput is ``n * batch_size / T(n)``.
"""

from __future__ import annotations

from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume
from lightning_dgc.perfmodel.collectives import (
    allgather_time,
    broadcast_time,
    doubling_allgather_time,
    doubling_allreduce_time,
    gather_time,
    reduce_time,
    ring_allreduce_time,
    sparse_allreduce_worst_time,
    sparse_allreduce_worst_volume,
)
from lightning_dgc.perfmodel.network import Network
from lightning_dgc.perfmodel.prediction import BANDWIDTHS, WORKERS, Prediction, predict, validate
from lightning_dgc.perfmodel.profile import BucketProfile, Profile, flattened_matrices, gradient_bytes
from lightning_dgc.perfmodel.step import METHODS, NODE_METHODS, StepTime, speedup, step_time, wire_bytes

__all__ = [
    "BANDWIDTHS",
    "METHODS",
    "NODE_METHODS",
    "WORKERS",
    "BucketProfile",
    "Network",
    "Prediction",
    "Profile",
    "StepTime",
    "allgather_time",
    "allgather_volume",
    "broadcast_time",
    "doubling_allgather_time",
    "doubling_allreduce_time",
    "flattened_matrices",
    "gather_time",
    "gradient_bytes",
    "predict",
    "reduce_time",
    "ring_allreduce_time",
    "ring_allreduce_volume",
    "sparse_allreduce_worst_time",
    "sparse_allreduce_worst_volume",
    "speedup",
    "step_time",
    "validate",
    "wire_bytes",
]
