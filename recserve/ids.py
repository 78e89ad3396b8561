"""Sparse ids for load generators (``recserve bench``, the locust file, ``recserve predict --random``):
``uniform`` over each table, or ``zipf:ALPHA``, the skew of real traffic, where the row of popularity
rank r (1 = hottest) is drawn with probability proportional to r^-ALPHA.

Hot rows are not clustered at id 0: rank r maps to row (a*r + b) mod rows, a fixed random
permutation per table (a coprime to rows; a and b drawn from the table's position in the model, so
every client process and every run sends the same hot rows). An affine map rather than a stored
permutation: a client of a 26 x 2M-row model keeps no 400 MB of permutation tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from recserve.errors import UserError

SPEC_HELP = "uniform (default) or zipf:ALPHA (e.g. zipf:1.05: skewed ids, hot rows spread over each table)"


@dataclass(frozen=True)
class IdDistribution:
    alpha: float = 0.0  # 0: uniform

    @staticmethod
    def parse(spec: str) -> "IdDistribution":
        if spec == "uniform":
            return IdDistribution()
        kind, _, value = spec.partition(":")
        try:
            alpha = float(value)
        except ValueError:
            alpha = -1.0
        if kind != "zipf" or not 0 < alpha < 10 or math.isnan(alpha):
            raise UserError(f"--id-distribution {spec!r}: use uniform or zipf:ALPHA with 0 < ALPHA < 10")
        return IdDistribution(alpha)

    def __str__(self) -> str:
        return f"zipf:{self.alpha:g}" if self.alpha else "uniform"

    def sample(self, rng: np.random.Generator, rows: int, count: int, table_index: int) -> np.ndarray:
        """``count`` ids in [0, rows) (int64) for the table at ``table_index`` in the model."""
        if not self.alpha:
            return rng.integers(0, rows, size=count, dtype=np.int64)
        ranks = zipf_ranks(rng, rows, count, self.alpha)
        a, b = _permutation(rows, table_index)
        # (a * r + b) mod rows without int64 overflow for rows up to 2^62: Python ints above 2^31 rows
        if rows < 2**31:
            return (ranks * a + b) % rows
        return np.array([(int(r) * a + b) % rows for r in ranks], dtype=np.int64)


UNIFORM = IdDistribution()


def zipf_ranks(rng: np.random.Generator, rows: int, count: int, alpha: float) -> np.ndarray:
    """Popularity ranks in [0, rows), 0 the hottest: the inverse CDF of the continuous power law
    x^-alpha on [1, rows + 1), floored (a bounded Zipf without a per-row table)."""
    u = rng.random(count)
    n1 = float(rows + 1)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(n1))
    else:
        e = 1.0 - alpha
        x = (1.0 + u * (n1 ** e - 1.0)) ** (1.0 / e)
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


def _permutation(rows: int, table_index: int) -> "tuple[int, int]":
    rng = np.random.default_rng([0x1D5, table_index])
    if rows == 1:
        return 1, 0
    while True:
        a = int(rng.integers(1, rows))
        if math.gcd(a, rows) == 1:
            return a, int(rng.integers(0, rows))
