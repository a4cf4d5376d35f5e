"""Plain aligned text columns, as the commands print their tables."""

from __future__ import annotations


def fmt(v, spec: str = ".4f", none: str = "never") -> str:
    """``v`` in ``spec``, ``none`` for ``None``."""
    return none if v is None else format(v, spec)


def aligned(heads: list[list[str]], rows: list[list[str]], left: set[int]) -> str:
    """``heads`` then ``rows`` in columns two spaces apart: ``left`` columns
    left-justified, the others right."""
    width = [max(len(x) for x in col) for col in zip(*heads, *rows)]
    lines = []
    for row in heads + rows:
        cells = [c.ljust(w) if i in left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, width))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
