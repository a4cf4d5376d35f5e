"""Byte sizes as users write them (``40GiB``, ``1.5GB``) and as lrmoe prints them."""

from __future__ import annotations

import math
import re

from lrmoe.errors import LrmoeError, require

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"40GiB"``, ``"1.5GB"``, ``"123456"``, ``"512 MiB"`` -> bytes.

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T are powers
    of 1024. Case-insensitive. Fractions round to the nearest byte.
    """
    if isinstance(text, bool):
        raise LrmoeError(f"memory size {text!r} is not a size; write e.g. 40GiB or 123456")
    if isinstance(text, int):
        require(text > 0, f"memory size {text} must be a positive number of bytes")
        return text
    m = _BYTES_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise LrmoeError(
            f"memory size {text!r} is not understood; write a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 40GiB or 123456")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value >= 2**63:
        raise LrmoeError(f"memory size {text!r} is too large: it must be below 8 EiB "
                         "(2^63 bytes)")
    require(value >= 1, f"memory size {text!r} must be at least 1 byte")
    return int(round(value))


def fmt_bytes(n: float) -> str:
    """Bytes as a short human string in binary units: ``41.2 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{int(n)} B"
