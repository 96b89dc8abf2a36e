"""train.budget's grammar: what a run may spend, in seconds, tokens or FLOPs."""

from __future__ import annotations

import re
from typing import NamedTuple

_UNITS = {"s": ("seconds", 1.0), "min": ("seconds", 60.0), "h": ("seconds", 3600.0),
          "tokens": ("tokens", 1.0), "flops": ("flops", 1.0)}
_BUDGET = re.compile(r"^\s*(?P<amount>\d+(?:\.\d*)?(?:[eE][+]?\d+)?)\s*(?P<unit>s|min|h|tokens|flops)\s*$")

class Budget(NamedTuple):
    """train.budget, parsed: kind is seconds, tokens or flops."""
    kind: str
    amount: float

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """'2min', '90s', '1.5h', '2e7tokens', '1e15flops' → Budget; a clear error otherwise."""
        match = _BUDGET.match(text)
        if not match:
            raise ValueError(f"budget {text!r}: expected a positive number and a unit, one of "
                             f"{', '.join(_UNITS)} (e.g. 2min, 90s, 2e7tokens, 1e15flops)")
        kind, scale = _UNITS[match["unit"]]
        amount = float(match["amount"]) * scale
        if amount <= 0:
            raise ValueError(f"budget {text!r} must be positive")
        return cls(kind, amount)
