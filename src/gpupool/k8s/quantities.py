"""Kubernetes resource quantities (`8000`, `8k`, `8e3`, `20Gi`) read as exact numbers.

The API server stores a pod's resource values in their canonical form, so the webhook and
the extender never see `8000` as written: they see `8k` (and `1000000` as `1M`, `1.5k` as
`1500`). Whatever form a whole number arrives in, it must read as the same number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_LENGTH = 64
"""Longer values are no quantity the API server would have accepted."""
MAX_EXPONENT = 30
"""Beyond 10^±30 no value fits any gpupool range; refusing early keeps the arithmetic small."""

_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exponent>[+-]?[0-9]+)|(?P<decimal>[mkMGTPE]?))$"
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class NotAQuantity(ValueError):
    """The text is not a Kubernetes quantity (or one far outside any range gpupool takes)."""


@dataclass(frozen=True, slots=True)
class Quantity:
    value: Fraction
    binary: bool
    """Written with a binary suffix (Ki, Mi, Gi, ...): the writer counted bytes."""

    def whole(self) -> int | None:
        """The value as an integer, or None when it has a fractional part."""
        return int(self.value) if self.value.denominator == 1 else None


def parse_quantity(text: str) -> Quantity:
    """Read `text` by the API server's grammar (resource.Quantity), exactly."""
    if len(text) > MAX_LENGTH:
        raise NotAQuantity(f"{text[:20]}... is too long for a quantity")
    match = _QUANTITY.match(text)
    if match is None:
        raise NotAQuantity(f"{text!r} is not a Kubernetes quantity")
    number = Fraction(
        match["number"] if not match["number"].startswith(".") else "0" + match["number"]
    )
    if match["sign"] == "-":
        number = -number
    if match["binary"]:
        return Quantity(number * 2 ** _BINARY[match["binary"]], binary=True)
    exponent = (
        int(match["exponent"]) if match["exponent"] is not None else _DECIMAL[match["decimal"]]
    )
    if abs(exponent) > MAX_EXPONENT:
        raise NotAQuantity(f"{text!r} is out of range")
    return Quantity(number * Fraction(10) ** exponent, binary=False)
