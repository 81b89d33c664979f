"""When the CheckpointManager writes an increment and when a full checkpoint (docs/INCREMENTAL.md)."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class IncrementPolicy:
    """Write increments between full checkpoints: a full one once the current chain holds
    `full_every` increments, or once its increments' sparse bytes pass `max_chain_fraction` of its full
    base's. Both bound how many links a restore reads and how much retention must keep; either may be
    None (no bound of that kind), not both."""

    full_every: int | None = 10
    max_chain_fraction: float | None = 1.0

    def __post_init__(self):
        if self.full_every is not None:
            try:
                if isinstance(self.full_every, bool):
                    raise TypeError
                object.__setattr__(self, "full_every", operator.index(self.full_every))
            except TypeError:
                raise InvalidArgumentError(f"IncrementPolicy.full_every must be an int >= 1 or None, got "
                                           f"{self.full_every!r}") from None
            if self.full_every < 1:
                raise InvalidArgumentError(f"IncrementPolicy.full_every must be >= 1, got {self.full_every}")
        f = self.max_chain_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0):
            raise InvalidArgumentError(f"IncrementPolicy.max_chain_fraction must be a number > 0 or None, got {f!r}")
        if self.full_every is None and f is None:
            raise InvalidArgumentError("IncrementPolicy needs full_every or max_chain_fraction: an unbounded chain grows "
                             "every restore and everything retention keeps")

    def incremental(self, chain: tuple[int, int, int] | None) -> bool:
        """Whether the next checkpoint should be an increment on a chain with (increments, their bytes,
        the base's bytes); None (no committed parent known): a full one."""
        if chain is None:
            return False
        incs, inc_bytes, base_bytes = chain
        if self.full_every is not None and incs >= self.full_every:
            return False
        if self.max_chain_fraction is not None and inc_bytes > self.max_chain_fraction * max(base_bytes, 1):
            return False
        return True
