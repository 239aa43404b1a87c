"""What a benchmark prints and keeps: a table of its rows, and the run as JSON."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence


def print_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns as wide as their widest cell; numbers right-aligned, text left."""
    cells = [list(map(str, header))] + [[f"{c:.3f}" if isinstance(c, float) and abs(c) < 10 else
                                         f"{c:.1f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def dump(path: Optional[str], args: Any, **results: Any) -> None:
    """The run's arguments and results as JSON at `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)
