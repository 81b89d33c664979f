"""Plugin registry: adapters that map other libraries' models onto the `SparseState` protocol.

This is the one place where recckpt names an integration. An adapter is imported only when a model
holds a module of its library AND that library is already imported (a model cannot hold a TorchRec
module otherwise), so the rest of recckpt, and any model without such modules, pays nothing.

An adapter module provides:
- ``model_state_dict(model, state_dict, objects) -> dict``: the model's state_dict with each table it
  manages replaced by a `SparseState` object (its storage keys removed), so that
  `split_sparse_dense_state_dict` sees the tables as sparse; `objects` are the registered objects (a
  table's optimizer state may live in one);
- ``saved_object_state(model, obj, state)`` / ``loaded_object_state(model, obj, state, loaded_tables, rename)``:
  a registered object's state as a save writes it / as a load gives it (what the tables hold moved out /
  back; `loaded_tables` maps each checkpoint table whose optimizer slots the load applies to its model
  table);
- ``manifest_metadata(model) -> dict[str, str]``: what the manifest records about the library (versions,
  sharding plan);
- ``dense_load_dict(model, dense) -> dict``: what to give `model.load_state_dict(..., strict=False)` to
  load the dense entries `dense` (some libraries' load hooks need their tables' entries present).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Sequence

#: module-class prefix -> (the library's top-level module, the adapter's import path)
PLUGINS: Dict[str, tuple] = {
    "torchrec.": ("torchrec", "recckpt.integrations.torchrec"),
}


def _modules_of(model: Any) -> Iterator[Any]:
    modules = getattr(model, "modules", None)
    if callable(modules):
        try:
            yield from modules()
        except TypeError:
            return


def adapters_for(model: Any) -> List[Any]:
    """The adapter modules that apply to `model` (usually none), each imported on first use."""
    wanted = {prefix: lib for prefix, (lib, _) in PLUGINS.items() if lib in sys.modules}
    if not wanted:
        return []
    found = []
    for m in _modules_of(model):
        name = type(m).__module__ + "."
        for prefix in wanted:
            if name.startswith(prefix) and prefix not in found:
                found.append(prefix)
        if len(found) == len(wanted):
            break
    return [importlib.import_module(PLUGINS[p][1]) for p in found]


def model_state_dict(model: Any, objects: Sequence[Any] = ()) -> Dict[str, Any]:
    """`model.state_dict()`, with the tables of every applicable adapter as `SparseState` values.
    `objects`: the registered objects (an adapter may find table state there, e.g. a dense optimizer's)."""
    sd = model.state_dict()
    for adapter in adapters_for(model):
        sd = adapter.model_state_dict(model, sd, objects)
    return sd


def saved_object_state(model: Any, obj: Any, state: Any) -> Any:
    """Registered object `obj`'s state as a save writes it (an adapter may leave out what its tables hold)."""
    for adapter in adapters_for(model):
        state = adapter.saved_object_state(model, obj, state)
    return state


def loaded_object_state(model: Any, obj: Any, state: Any, loaded_tables: Mapping[str, str] | None = None,
                        rename: Callable[[str], str] | None = None) -> Any:
    """The checkpoint's `state` of registered object `obj` as a load gives it (an adapter may add what
    its tables hold, so that the object does not refuse it). `loaded_tables`: checkpoint table -> model
    table, for the tables whose optimizer slots the load applies; `rename`: a saved parameter name -> the
    model's (the state stays keyed by saved names)."""
    for adapter in adapters_for(model):
        state = adapter.loaded_object_state(model, obj, state, loaded_tables, rename)
    return state


def manifest_metadata(model: Any) -> Dict[str, str]:
    """What the applicable adapters record in a checkpoint's manifest metadata (empty for most models)."""
    out: Dict[str, str] = {}
    for adapter in adapters_for(model):
        out.update(adapter.manifest_metadata(model))
    return out


def load_dense(model: Any, dense: Dict[str, Any]) -> None:
    """`model.load_state_dict(dense, strict=False)`, with what the applicable adapters add (a copy is
    passed: some models' load_state_dict mutates the dict it is given)."""
    sd = dict(dense)
    for adapter in adapters_for(model):
        sd = adapter.dense_load_dict(model, sd)
    model.load_state_dict(sd, strict=False)
