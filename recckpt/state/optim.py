"""Sparse optimizers for :class:`~recckpt.state.hashtable.HashTable`.

Per-id optimizer state lives in the tables as slots of category ``"sparse_opt"`` (so it is saved,
loaded, resharded and grown with the ids); the optimizer object keeps only small scalar state
(per-table step counts and hyper-parameters), exposed by ``state_dict()`` as plain JSON-serialisable
values.

``step()`` consumes each table's pending gradient (recorded by ``backward()``), sums duplicate rows,
and updates only those rows, in vectorised tensor ops. Updates are computed in the table's
``compute_dtype`` (float32, or float64 for a float64 table) and written back in the slot dtypes, so
bfloat16/float16 embeddings get float32 arithmetic and float32 optimizer state. Optimizer slots are
created in the compute dtype: float32, except float64 for a float64 table.

Numerics follow torch: :class:`SparseAdagrad` matches ``torch.optim.Adagrad`` on an equivalent dense
weight for the rows that receive gradients, and :class:`SparseAdam` matches ``torch.optim.SparseAdam``
on ``nn.Embedding(sparse=True)``. Like torch, a table's step count advances on every ``step()`` in
which the table has a pending gradient (one count per table, not per row).

Updates are pure torch ops on the rows the table hands out (``read_rows``/``write_rows``), so they run
where the table's slots live: on the CPU, or on a CUDA device for ``HashTable(device="cuda")``; the
row numbers come from the host id map and are moved to that device by the table.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from recckpt.state.hashtable import EMBEDDING, HashTable

from ..errors import InvalidArgumentError

__all__ = ["SparseOptimizer", "SparseAdagrad", "SparseAdam"]


def _collect_tables(tables: Union[nn.Module, Iterable[HashTable]]) -> List[HashTable]:
    if isinstance(tables, nn.Module):
        found = [m for m in tables.modules() if isinstance(m, HashTable)]
    else:
        found = []
        for t in tables:
            if not isinstance(t, HashTable):
                raise InvalidArgumentError(f"expected HashTable instances, got {type(t).__name__}")
            found.append(t)
    out: List[HashTable] = []
    seen = set()
    names: Dict[str, HashTable] = {}
    for t in found:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.name in names:
            raise InvalidArgumentError(f"two different tables named {t.name!r}; table names must be unique")
        names[t.name] = t
        out.append(t)
    if not out:
        raise InvalidArgumentError("optimizer got no HashTable to optimize")
    return out


def _check_float(name: str, value: Any, lo: float = 0.0, hi: Optional[float] = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not (value >= lo) or (hi is not None and not value < hi) or math.isnan(value):
        raise InvalidArgumentError(f"invalid {name}: {value}")
    return value


class SparseOptimizer:
    """Base class: table discovery, step counting, ``zero_grad`` and ``state_dict``.

    Subclasses define ``_hyperparams()``, ``_set_hyperparams(d)``, ``_ensure_slots(table)`` and
    ``_update(table, rows, grad, step)``.
    """

    def __init__(self, tables: Union[nn.Module, Iterable[HashTable]]) -> None:
        self.tables: List[HashTable] = _collect_tables(tables)
        self._steps: Dict[str, int] = {t.name: 0 for t in self.tables}

    # -- to override
    def _hyperparams(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _set_hyperparams(self, d: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _ensure_slots(self, table: HashTable) -> None:
        raise NotImplementedError

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    # -- public
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Apply every table's pending gradient and clear it. Returns ``closure()`` if given
        (evaluated first, with grad enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for t in self.tables:
                if not t.has_grad():
                    continue
                rows, grad = t.pop_sparse_grad()
                self._steps[t.name] += 1
                if rows.numel():
                    self._update(t, rows, grad, self._steps[t.name])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every table's pending gradient."""
        for t in self.tables:
            t.zero_grad(set_to_none=set_to_none)

    def steps(self) -> Dict[str, int]:
        """Step count of each table, by table name."""
        return dict(self._steps)

    @property
    def steps_matter(self) -> bool:
        """Whether updates depend on the step counts (bias correction, a decaying learning rate): then
        optimizer slots loaded without the counts they were saved with would be stepped wrongly, and a
        strict load refuses them (docs/LOADING.md). True unless a subclass knows better."""
        return True

    def state_dict(self) -> Dict[str, Any]:
        """Small scalar state only (per-id state is in the tables' ``sparse_opt`` slots)::

            {"optimizer": "SparseAdagrad", "hyperparams": {...}, "tables": {name: {"step": int}}}

        Every value is an int, float, str, list or dict: JSON-serialisable, no tensors.
        """
        return {
            "optimizer": type(self).__name__,
            "hyperparams": self._hyperparams(),
            "tables": {name: {"step": s} for name, s in self._steps.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore hyper-parameters and step counts from :meth:`state_dict` output.

        With ``strict`` (default) the set of table names must match this optimizer's exactly;
        otherwise tables missing from ``state_dict`` keep their step and unknown ones are ignored.
        Raises ``ValueError`` on a wrong optimizer type or malformed entries (nothing changed then).
        """
        kind = state_dict.get("optimizer")
        if kind != type(self).__name__:
            raise InvalidArgumentError(f"{type(self).__name__}.load_state_dict: state is for {kind!r}")
        tables = state_dict.get("tables")
        if not isinstance(tables, Mapping):
            raise InvalidArgumentError(f"{type(self).__name__}.load_state_dict: 'tables' must be a dict")
        if strict:
            mine, theirs = set(self._steps), set(tables)
            if mine != theirs:
                raise InvalidArgumentError(
                    f"{type(self).__name__}.load_state_dict: tables differ; missing in state: "
                    f"{sorted(mine - theirs)}, unexpected in state: {sorted(theirs - mine)}"
                )
        new_steps = dict(self._steps)
        for name, entry in tables.items():
            if name not in new_steps:
                continue
            step = entry.get("step") if isinstance(entry, Mapping) else None
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise InvalidArgumentError(
                    f"{type(self).__name__}.load_state_dict: table {name!r}: bad step {step!r}"
                )
            new_steps[name] = int(step)
        hp = state_dict.get("hyperparams")
        if not isinstance(hp, Mapping):
            raise InvalidArgumentError(f"{type(self).__name__}.load_state_dict: 'hyperparams' must be a dict")
        try:
            self._set_hyperparams(hp)
        except KeyError as e:
            raise InvalidArgumentError(
                f"{type(self).__name__}.load_state_dict: missing hyperparameter {e.args[0]!r}"
            ) from None
        self._steps = new_steps
        for t in self.tables:
            self._ensure_slots(t)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self._hyperparams().items())
        return f"{type(self).__name__}({hp}, tables={[t.name for t in self.tables]})"


class SparseAdagrad(SparseOptimizer):
    """Adagrad over the rows of HashTables (``torch.optim.Adagrad`` numerics).

    Per id: slot ``adagrad.acc`` (shape ``(dim,)``, category ``"sparse_opt"``, dtype float32 -- float64
    for a float64 table -- initialised to ``initial_accumulator_value``). For each row with gradient ``g`` at table step ``k``::

        clr = lr / (1 + (k - 1) * lr_decay)
        acc += g * g
        w   -= clr * g / (sqrt(acc) + eps)

    Args:
        tables: a module (every HashTable inside it) or an iterable of HashTables.
    """

    ACC = "adagrad.acc"

    def __init__(
        self,
        tables: Union[nn.Module, Iterable[HashTable]],
        lr: float = 0.01,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        lr_decay: float = 0.0,
    ) -> None:
        super().__init__(tables)
        self._set_hyperparams(
            dict(lr=lr, eps=eps, initial_accumulator_value=initial_accumulator_value, lr_decay=lr_decay)
        )
        for t in self.tables:
            self._ensure_slots(t)

    def _hyperparams(self) -> Dict[str, Any]:
        return {
            "lr": self.lr,
            "eps": self.eps,
            "initial_accumulator_value": self.initial_accumulator_value,
            "lr_decay": self.lr_decay,
        }

    def _set_hyperparams(self, d: Mapping[str, Any]) -> None:
        lr = _check_float("lr", d["lr"])
        eps = _check_float("eps", d["eps"])
        iav = _check_float("initial_accumulator_value", d["initial_accumulator_value"])
        lr_decay = _check_float("lr_decay", d["lr_decay"])
        self.lr, self.eps, self.initial_accumulator_value, self.lr_decay = lr, eps, iav, lr_decay

    @property
    def steps_matter(self) -> bool:
        """Only a decaying learning rate reads the step count."""
        return self.lr_decay != 0

    def _ensure_slots(self, table: HashTable) -> None:
        table.add_slot(self.ACC, table.compute_dtype, (table.dim,), init=self.initial_accumulator_value,
                       category="sparse_opt", exist_ok=True)

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        cd = table.compute_dtype
        g = grad.to(cd)
        clr = self.lr / (1 + (step - 1) * self.lr_decay)
        acc = table.read_rows(self.ACC, rows, cd)
        acc.addcmul_(g, g, value=1)
        std = acc.sqrt().add_(self.eps)
        w = table.read_rows(EMBEDDING, rows, cd)
        w.addcdiv_(g, std, value=-clr)
        table.write_slots(rows, {self.ACC: acc, EMBEDDING: w})


class SparseAdam(SparseOptimizer):
    """Adam over the rows of HashTables (``torch.optim.SparseAdam`` numerics).

    Per id: slots ``adam.m`` and ``adam.v`` (shape ``(dim,)``, category ``"sparse_opt"``, dtype float32 --
    float64 for a float64 table -- initialised to 0). One step
    count per table (as torch keeps one per parameter), used for bias correction. For each row with
    gradient ``g`` at table step ``k``::

        m += (1 - beta1) * (g - m)
        v += (1 - beta2) * (g * g - v)
        w -= lr * sqrt(1 - beta2**k) / (1 - beta1**k) * m / (sqrt(v) + eps)

    Rows without a gradient in a step are not touched (lazy Adam).

    Args:
        tables: a module (every HashTable inside it) or an iterable of HashTables.
    """

    M = "adam.m"
    V = "adam.v"

    def __init__(
        self,
        tables: Union[nn.Module, Iterable[HashTable]],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(tables)
        self._set_hyperparams(dict(lr=lr, betas=betas, eps=eps))
        for t in self.tables:
            self._ensure_slots(t)

    def _hyperparams(self) -> Dict[str, Any]:
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps}

    def _set_hyperparams(self, d: Mapping[str, Any]) -> None:
        lr = _check_float("lr", d["lr"])
        eps = _check_float("eps", d["eps"])
        betas = d["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise InvalidArgumentError(f"betas must be a pair, got {betas!r}")
        b1 = _check_float("beta1", betas[0], 0.0, 1.0)
        b2 = _check_float("beta2", betas[1], 0.0, 1.0)
        self.lr, self.betas, self.eps = lr, (b1, b2), eps

    def _ensure_slots(self, table: HashTable) -> None:
        for name in (self.M, self.V):
            table.add_slot(name, table.compute_dtype, (table.dim,), init=0.0, category="sparse_opt",
                           exist_ok=True)

    def _update(self, table: HashTable, rows: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        # Same operation order as torch.optim._functional.sparse_adam.
        cd = table.compute_dtype
        b1, b2 = self.betas
        g = grad.to(cd)
        m_old = table.read_rows(self.M, rows, cd)
        v_old = table.read_rows(self.V, rows, cd)
        m_upd = g.sub(m_old).mul_(1 - b1)
        v_upd = g.pow(2).sub_(v_old).mul_(1 - b2)
        m_new = m_upd.add_(m_old)
        v_new = v_upd.add_(v_old)
        denom = v_new.sqrt().add_(self.eps)
        bias_correction1 = 1 - b1**step
        bias_correction2 = 1 - b2**step
        step_size = self.lr * math.sqrt(bias_correction2) / bias_correction1
        w = table.read_rows(EMBEDDING, rows, cd)
        w.add_(m_new.div(denom).mul_(-step_size))   # -step_size * (m / denom), as torch rounds it
        table.write_slots(rows, {self.M: m_new, self.V: v_new, EMBEDDING: w})
