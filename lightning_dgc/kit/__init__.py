"""The authors' kit: check_algorithm() for any algorithm, ours and users', and its replay."""

from lightning_dgc.kit.check import DEFAULT_SHAPES, CountingCollectives, check_algorithm

__all__ = ["DEFAULT_SHAPES", "CountingCollectives", "check_algorithm"]
