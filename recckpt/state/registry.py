"""What a checkpoint holds besides the model: objects registered by name ("extras") and per-worker IO
state. One `Registry` per Saver; the save path reads it, the load path applies to it, and nothing else
reaches into its dictionaries."""
from __future__ import annotations

from typing import Any, Iterator

from ..errors import InvalidArgumentError


def _check_name(name, registry: dict, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{what}: name must be a non-empty string, got {name!r}")
    if name in registry:
        raise InvalidArgumentError(f"{what}: {name!r} is already registered")


class Registry:
    """Registered objects and IO-state providers, by name."""

    def __init__(self):
        self._objects: dict[str, Any] = {}
        self._pickle_allowed: set[str] = set()
        self._io: dict[str, Any] = {}
        self._io_optional: set[str] = set()

    # ------------------------------------------------------------------------------ registering
    def add_object(self, name: str, obj: Any, *, allow_pickle: bool = False) -> None:
        """See `Saver.register_for_checkpointing`."""
        _check_name(name, self._objects, "register_for_checkpointing")
        if not isinstance(allow_pickle, bool):
            raise InvalidArgumentError(f"register_for_checkpointing({name!r}): allow_pickle must be a bool")
        self._objects[name] = obj
        if allow_pickle:
            self._pickle_allowed.add(name)

    def add_io_state(self, name: str, obj: Any, *, optional: bool = False) -> None:
        """See `Saver.register_io_state`."""
        _check_name(name, self._io, "register_io_state")
        if not isinstance(optional, bool):
            raise InvalidArgumentError(f"register_io_state({name!r}): optional must be a bool")
        if not (callable(getattr(obj, "dump_io_state", None)) and callable(getattr(obj, "load_io_state", None))):
            raise InvalidArgumentError(f"register_io_state({name!r}): {type(obj).__name__} needs dump_io_state() and "
                            f"load_io_state(state) methods")
        self._io[name] = obj
        if optional:
            self._io_optional.add(name)

    # ---------------------------------------------------------------------------------- reading
    def object(self, name: str) -> Any:
        if name not in self._objects:
            raise InvalidArgumentError(f"no object is registered as {name!r}; registered: {list(self._objects)}")
        return self._objects[name]

    def object_names(self) -> list[str]:
        return list(self._objects)

    def allows_pickle(self, name: str) -> bool:
        return name in self._pickle_allowed

    def io_names(self) -> list[str]:
        return list(self._io)

    def io_optional(self, name: str) -> bool:
        """Whether a checkpoint without IO state `name` loads (leaving the object as it is)."""
        return name in self._io_optional

    def io_items(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self._io.items()))

    # ------------------------------------------------------------------------------- save side
    def object_states(self) -> Iterator[tuple[str, str, Any, bool]]:
        """`(name, kind, state, allow_pickle)` of every registered object, as a save captures it: kind
        "state_dict" (its `state_dict()`) for objects with `state_dict`/`load_state_dict`, else "value"."""
        for name, obj in self._objects.items():
            kind = "state_dict" if (callable(getattr(obj, "state_dict", None))
                                    and callable(getattr(obj, "load_state_dict", None))) else "value"
            yield name, kind, (obj.state_dict() if kind == "state_dict" else obj), name in self._pickle_allowed

    def io_tree(self) -> dict | None:
        """Every IO-state provider's `dump_io_state()`, or None when none is registered."""
        return {name: obj.dump_io_state() for name, obj in self._io.items()} if self._io else None

    # ------------------------------------------------------------------------------- load side
    def refusal(self, name: str, kind: str, state: Any) -> str | None:
        """Why registered object `name` cannot take `state` saved as `kind` (None: it can). A dict or list
        is updated in place, so a caller's reference to it stays the loaded value; state of another type
        would have to replace it and leave that reference stale, and an object with load_state_dict
        given a plain value would be replaced by it: both are refused, before anything is applied."""
        obj = self._objects[name]
        stateful = callable(getattr(obj, "load_state_dict", None))
        if stateful and kind != "state_dict":
            return (f"registered object {name!r} is a {type(obj).__name__} (it has load_state_dict), but the "
                    f"checkpoint holds a plain {type(state).__name__} under that name")
        if not stateful:
            for container in (dict, list):
                if isinstance(obj, container) and not isinstance(state, container):
                    return (f"registered object {name!r} is a {container.__name__}, updated in place on load, but "
                            f"the checkpoint holds a {type(state).__name__} under that name")
        return None

    def apply_object(self, name: str, kind: str, state: Any) -> None:
        """Give registered object `name` its loaded state: `load_state_dict` for stateful objects, in place
        for dicts, lists and a tensor of the saved shape and dtype (not an inference tensor), else the value
        replaces the registered one (see `object`)."""
        obj = self._objects[name]
        if kind == "state_dict" and callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(state)
        elif isinstance(obj, dict) and isinstance(state, dict):
            obj.clear()
            obj.update(state)
        elif isinstance(obj, list) and isinstance(state, list):
            obj[:] = state
        elif _copies_into(obj, state):
            import torch
            with torch.no_grad():   # (a Parameter too: as load_state_dict copies into it)
                obj.copy_(state)
        else:
            self._objects[name] = state


def _copies_into(obj, state) -> bool:
    """Whether loaded `state` is copied into registered tensor `obj` (same shape and dtype, `obj` not an
    inference tensor); otherwise it replaces `obj`, as any other value does."""
    return (_is_tensor(obj) and _is_tensor(state) and obj.shape == state.shape and obj.dtype == state.dtype
            and not obj.is_inference())


def _is_tensor(x) -> bool:
    import sys
    torch = sys.modules.get("torch")   # (no tensor exists unless torch is loaded)
    return torch is not None and isinstance(x, torch.Tensor)


__all__ = ["Registry"]
