"""Row initializers for :class:`~recckpt.state.hashtable.HashTable`.

An initializer is any callable ``init(t) -> None`` that fills the tensor ``t`` in place, exactly like
the ``torch.nn.init`` functions (``lambda t: torch.nn.init.normal_(t, std=0.01)`` is one). The table
calls it once per batch of new rows with a ``[k, dim]`` tensor (a view of its storage or a scratch
tensor) in the embedding's dtype; its return value is ignored. Random initializers draw from
torch's global generator.

The factories here return such callables with a readable ``repr`` (shown by the table's
``extra_repr``).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import InvalidArgumentError

__all__ = ["Initializer", "zeros", "constant", "normal", "uniform", "DEFAULT_STD", "default"]

Initializer = Callable[[torch.Tensor], object]

#: Standard deviation of the default initializer (``normal(0.0, DEFAULT_STD)``).
DEFAULT_STD = 0.01


class _Init:
    """A callable initializer that remembers the factory call that made it (for repr and pickle)."""

    __slots__ = ("_fn", "_factory", "_args")

    def __init__(self, fn: Callable[[torch.Tensor], object], factory: Callable, args: tuple) -> None:
        self._fn = fn
        self._factory = factory
        self._args = args

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self._fn(t)
        return t

    def __repr__(self) -> str:
        return f"{self._factory.__name__}({', '.join(repr(a) for a in self._args)})"

    def __reduce__(self):
        return (self._factory, self._args)


def zeros() -> Initializer:
    """Fill with 0."""
    return _Init(lambda t: t.zero_(), zeros, ())


def constant(value: float) -> Initializer:
    """Fill with ``value``."""
    value = float(value)
    return _Init(lambda t: t.fill_(value), constant, (value,))


def normal(mean: float = 0.0, std: float = DEFAULT_STD) -> Initializer:
    """Draw from N(mean, std^2) (``torch.nn.init.normal_``)."""
    mean, std = float(mean), float(std)
    if std < 0:
        raise InvalidArgumentError(f"normal: std must be >= 0, got {std}")
    return _Init(lambda t: torch.nn.init.normal_(t, mean=mean, std=std), normal, (mean, std))


def uniform(a: float = -0.01, b: float = 0.01) -> Initializer:
    """Draw from U(a, b) (``torch.nn.init.uniform_``)."""
    a, b = float(a), float(b)
    if not a <= b:
        raise InvalidArgumentError(f"uniform: need a <= b, got a={a}, b={b}")
    return _Init(lambda t: torch.nn.init.uniform_(t, a=a, b=b), uniform, (a, b))


def default() -> Initializer:
    """The initializer a table uses when given ``None``: ``normal(0.0, 0.01)``."""
    return normal(0.0, DEFAULT_STD)
