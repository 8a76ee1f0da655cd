"""Statistics and plain-text tables shared by the bench scripts."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence


def percentile(samples: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[int] = (0,)) -> None:
    """A fixed-width table: the columns in ``left`` left-aligned (text), the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i in left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(f"\n{title}")
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))
