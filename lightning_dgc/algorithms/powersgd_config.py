"""PowerSGD's settings (:class:`PowerSGDConfig`) and which of a bucket's matrices it compresses, at what rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dgc.algorithms.base import AlgorithmConfig, TensorSpec
from lightning_dgc.algorithms.checks import flag, real_number, whole_number

VALUE_BYTES = 4  # the factors and the uncompressed tensors travel in fp32


@dataclass
class PowerSGDConfig(AlgorithmConfig):
    """Hyper-parameters of PowerSGD, identical on every rank; the defaults are torch's hook's.

    matrix_approximation_rank: ``r``, the rank of the factors ``P`` (``n x r``) and ``Q`` (``m x r``).
    start_iter: optimizer steps of plain all-reduce before compression starts; at least 2 with error
        feedback or warm start (DDP rebuilds its buckets after the first step).
    min_compression_rate: a matrix is compressed only when ``(n + m) r * rate < n m``.
    use_error_feedback: add what the approximation missed to the next step's gradient.
    warm_start: start each step's power iteration from the previous step's ``Q``.
    orthogonalization_epsilon: added to the column norms in Gram-Schmidt (0: exactly as QR).
    seed: of the random initial ``Q`` (the same on every rank, a new draw per bucket).
    """

    matrix_approximation_rank: int = 1
    start_iter: int = 1_000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        self.matrix_approximation_rank = whole_number(
            self.matrix_approximation_rank, "matrix_approximation_rank"
        )
        if self.matrix_approximation_rank < 1:
            raise ValueError(
                f"`matrix_approximation_rank` must be >= 1, got {self.matrix_approximation_rank}."
            )
        self.start_iter = whole_number(self.start_iter, "start_iter")
        self.use_error_feedback = flag(self.use_error_feedback, "use_error_feedback")
        self.warm_start = flag(self.warm_start, "warm_start")
        if (self.use_error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(
                f"`start_iter` must be >= 2 with error feedback or warm start, got {self.start_iter}: DDP rebuilds"
                " its buckets after the first step, and the memory must start on the final buckets."
            )
        self.min_compression_rate = real_number(self.min_compression_rate, "min_compression_rate")
        if not math.isfinite(self.min_compression_rate) or self.min_compression_rate < 1:
            raise ValueError(
                f"`min_compression_rate` must be a finite number >= 1, got {self.min_compression_rate}: a matrix"
                " is compressed only when its factors are that many times smaller than it (torch's default is"
                " 2; 1 compresses every matrix whose factors are smaller at all)."
            )
        self.orthogonalization_epsilon = real_number(
            self.orthogonalization_epsilon, "orthogonalization_epsilon"
        )
        if self.orthogonalization_epsilon < 0:
            raise ValueError(
                f"`orthogonalization_epsilon` must be >= 0, got {self.orthogonalization_epsilon}."
            )
        self.seed = whole_number(self.seed, "seed")
        if not 0 <= self.seed < 2**32:
            raise ValueError(
                f"`seed` must lie in [0, 2**32 - 1] (it seeds numpy's RandomState), got {self.seed}."
            )


def matrix_shape(spec: TensorSpec) -> tuple[int, int]:
    """The gradient of ``spec`` as a matrix: ``shape[0] x (numel / shape[0])`` (a 0-d tensor: ``1 x 1``)."""
    rows = spec.shape[0] if spec.shape else 1
    return rows, spec.numel // rows if rows else 0


def compressed_rank(spec: TensorSpec, config: PowerSGDConfig) -> int:
    """The rank ``spec``'s matrix is approximated with, or 0 when it travels uncompressed."""
    n, m = matrix_shape(spec)
    r = min(n, m, config.matrix_approximation_rank)
    return r if (n + m) * r * config.min_compression_rate < n * m else 0
