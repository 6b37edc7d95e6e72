"""Floats as the wire holds them: the proto's temperature, top_p and min_p are float32.

A float32 read back into Python is a double that prints its binary error: 0.3 arrives as
0.30000001192092896. Messages quote what the user sent, so they print the shortest decimal that
reads back as the same float32 (0.3), as a float32-aware language would.
"""
from __future__ import annotations

import math
import struct

from echospec_client.limits import FLOAT32_MAX   # the wire's temperature, top_p and min_p are float32


def as_f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as the wire carries it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_str(v: float) -> str:
    """The shortest decimal (1 to 9 significant digits) that rounds to the float32 ``v``, spelled
    as Python spells that float: 0.30000001192092896 -> '0.3', 1.2999999523162842 -> '1.3',
    100.0 -> '100.0', 1.401298464324817e-45 -> '1e-45'; 'inf', '-inf', 'nan' as str() prints
    them; a value outside float32's range (not from the wire) as repr()."""
    v = float(v)
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        return repr(v) if math.isfinite(v) else str(v)
    target = as_f32(v)
    for digits in range(1, 10):   # 9 significant digits round-trip every float32
        s = f"{v:.{digits}g}"
        try:
            if as_f32(float(s)) == target:
                return repr(float(s))   # Python's float spelling: '100.0', not '1e+02'
        except OverflowError:   # rounded up past float32's largest value
            continue
    return repr(v)
