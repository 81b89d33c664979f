"""Nested Python state (state_dicts of optimizers, schedulers, readers; RNG states; plain values) to
JSON + tensors and back, without pickle.

Supported leaves: None, bool, int, float (NaN/inf included), str, bytes, torch.Tensor, numpy arrays and
scalars (of any dtype's own type: a numpy float64 comes back as one), torch.dtype. Containers: dict (any
keys of those leaf types; collections.Counter and OrderedDict come back as themselves), list, tuple.
Anything else, subclasses of those builtins included (an IntEnum, a namedtuple, torch.Size) and bytearray,
is refused with the key path, so a user learns at save time, not at load time, that state would be lost
or come back as another type.
`decode` takes the tensors as torch tensors or as numpy arrays (safetensors_io.read_arrays: what the
torch-free `recckpt inspect` and `verify` read); torch is imported only where torch objects are made.
"""
from __future__ import annotations

import base64
import collections
import json
import math
import re
from typing import TYPE_CHECKING

import numpy as np

from . import checked_json, dtypes

if TYPE_CHECKING:
    import torch

TREE_KEY = "recckpt.tree"
#: A tree is one metadata value of a safetensors header, whose cap (the library's) bounds it too.
MAX_TREE_BYTES = 100 << 20
_LIMITS = checked_json.JsonLimits(MAX_TREE_BYTES, floats=True)


#: How a non-finite numpy float64 was written until 2026-11-30 (its repr under numpy 2), read back as one.
_OLD_NP_FLOAT = re.compile(r"np\.float64\((nan|inf|-inf)\)")

#: dict subclasses stored as themselves (docs/FORMAT.md, the state tree): [[key, value], ...] under the tag
_DICT_TAGS = {collections.Counter: "__counter__", collections.OrderedDict: "__odict__"}


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, obj, path: str):
        import torch  # saving: torch is loaded already
        if isinstance(obj, (np.str_, np.bytes_)):
            # numpy's string scalars (an element of a string array) are str and bytes: stored as those, as
            # numpy itself gives them back from tolist()
            return self.encode(obj.item(), path)
        if isinstance(obj, np.generic):   # (before float: numpy's float64 is a float, and kept as itself)
            if obj.dtype.kind not in "biufc" or isinstance(obj.item(), np.generic):
                # (a void record; a long double, which has no Python value: decode refuses both)
                raise TypeError(f"{path}: a numpy scalar of dtype {obj.dtype} cannot be stored without pickle; "
                                f"convert it (float(v), int(v), or a plain value per field)")
            return {"__npscalar__": obj.dtype.str, "value": self.encode(obj.item(), path)}
        kind = type(obj)
        if obj is None or kind in (bool, str):
            return obj
        if kind is int:
            return obj if -(1 << 63) <= obj < (1 << 64) else {"__bigint__": str(obj)}
        if kind is float:
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        _refuse_lossy_subclass(obj, path)
        if isinstance(obj, torch.Tensor):
            kind = type(obj).__name__
            if kind in ("ShardedTensor", "DTensor"):   # (even detach() of one raises torch's own error)
                raise TypeError(
                    f"{path}: a {kind} (each rank holds a shard of it) cannot be stored as one registered object's "
                    f"state, which rank 0 writes alone. If this is a TorchRec optimizer combining the tables' fused "
                    f"optimizer (dmp.fused_optimizer, a CombinedOptimizer over it) with a dense one, register only the "
                    f"dense optimizer: recckpt saves the fused optimizer's state as the tables' slots")
            return {"__tensor__": self._add(obj.detach().cpu(), path)}
        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise TypeError(f"{path}: numpy object arrays cannot be stored without pickle")
            if obj.dtype.kind not in "biuf" or obj.dtype.names is not None:
                # (torch.from_numpy's own refusal names no path and no way out)
                raise TypeError(f"{path}: a numpy array of dtype {obj.dtype} cannot be stored without pickle; "
                                f"arrays of booleans, integers and floats can (convert it, e.g. strings to a "
                                f"list, datetimes to int64)")
            return {"__ndarray__": self._add(torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape)), path)}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": dtypes.name_of(obj)}
        if isinstance(obj, bytes):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if type(obj) in _DICT_TAGS:   # (before dict: both are dicts, and a plain one would lose the type)
            return {_DICT_TAGS[type(obj)]: self._pairs(obj, path)}
        if isinstance(obj, dict) and type(obj) is not dict:
            # a defaultdict's factory (or any subclass's own fields) cannot be stored without pickle, and a
            # plain dict coming back would fail the code that relies on the subclass (MultiStepLR's Counter)
            raise TypeError(f"{path}: cannot store a {type(obj).__module__}.{type(obj).__qualname__} (a dict "
                            f"subclass) without pickle; dict, collections.Counter and collections.OrderedDict can "
                            f"be stored: convert it (dict(value)) in state_dict(), or register it with allow_pickle")
        if isinstance(obj, dict):
            if all(type(k) is str and not k.startswith("__") for k in obj):   # (a str subclass key: refused below)
                return {k: self.encode(v, f"{path}.{k}") for k, v in obj.items()}
            return {"__dict__": self._pairs(obj, path)}
        raise TypeError(f"{path}: cannot store a {type(obj).__module__}.{type(obj).__qualname__} without "
                        f"pickle; return tensors, numbers, strings, lists and dicts from state_dict()")

    def _pairs(self, obj: dict, path: str) -> list:
        return [[self.encode(k, f"{path}<key>"), self.encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]

    def _add(self, t: torch.Tensor, path: str) -> str:
        import torch
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"{path}: only dense (strided) tensors can be stored, got {t.layout}")
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.contiguous()
        return key


#: Builtin types whose subclasses would come back as the base type, with how to convert one.
_PLAIN_BASES = ((int, "int(v)"), (float, "float(v)"), (str, "str(v)"), (bytes, "bytes(v)"),
                (tuple, "tuple(v), or v._asdict() for a namedtuple"), (list, "list(v)"))


def _refuse_lossy_subclass(obj, path: str) -> None:
    """Refuse a value the tree would store as another type: an IntEnum as an int, a namedtuple or torch.Size
    as a tuple, a bytearray as bytes. Code that reads the state back (`.name`, `.epoch`, a mutation) would
    fail only at resume, far from the save."""
    kind = type(obj)
    lossy = [(b.__name__, how) for b, how in _PLAIN_BASES if isinstance(obj, b) and kind is not b]
    if kind is bytearray:
        lossy = [("bytes", "bytes(v)")]
    if lossy:
        base, how = lossy[0]
        raise TypeError(f"{path}: cannot store a {kind.__module__}.{kind.__qualname__} without pickle: it would load "
                        f"back as a plain {base}. Convert it in state_dict() ({how}), or register the object "
                        f"with allow_pickle and allow the class with torch.serialization.add_safe_globals")


def encode(obj, root: str) -> tuple[str, dict[str, torch.Tensor]]:
    """(JSON text of the tree, tensors it refers to by key)."""
    enc = _Encoder()
    tree = enc.encode(obj, root)
    try:  # refuse at save time what a load would refuse (checked_json's depth and key rules)
        checked_json.check_tree(tree)
    except checked_json.JsonRuleError as e:
        raise ValueError(f"{root}: cannot be stored: {e}") from None
    return json.dumps(tree, allow_nan=False, separators=(",", ":")), enc.tensors


def decode(text: str, tensors: dict[str, torch.Tensor] | dict[str, np.ndarray], where: str):
    def dec(node):
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__ndarray__" in node:
            t = tensors[node["__ndarray__"]]
            if isinstance(t, np.ndarray):   # read_arrays gives BF16 as uint16 bits already
                return t
            import torch
            return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        if "__npscalar__" in node:
            dt = np.dtype(node["__npscalar__"]) if isinstance(node["__npscalar__"], str) else None
            # Only numbers: a hostile 'V<huge>' or object dtype must not allocate or build anything.
            if dt is None or dt.kind not in "biufc" or dt.itemsize > 16:
                raise ValueError(f"unsupported numpy scalar dtype {node['__npscalar__']!r:.40}")
            return dt.type(dec(node["value"]))
        if "__float__" in node:
            text = node["__float__"]
            old = _OLD_NP_FLOAT.fullmatch(text) if isinstance(text, str) else None
            if old is not None:   # written by recckpt before 2026-11-30 for a non-finite numpy float64
                return np.float64(old.group(1))
            return float(text)
        if "__bigint__" in node:
            return int(node["__bigint__"])
        if "__dtype__" in node:
            return dtypes.torch_dtype(node["__dtype__"])
        if "__bytes__" in node:
            return base64.b64decode(node["__bytes__"])
        if "__tuple__" in node:
            return tuple(dec(v) for v in node["__tuple__"])
        if "__dict__" in node:
            return {_hashable(dec(k)): dec(v) for k, v in _pairs_of(node, "__dict__")}
        for kind, tag in _DICT_TAGS.items():
            if tag in node:
                # (built from a dict: Counter(pairs) would count the pairs)
                return kind({_hashable(dec(k)): dec(v) for k, v in _pairs_of(node, tag)})
        return {k: dec(v) for k, v in node.items()}

    try:
        if not isinstance(text, str):
            raise TypeError(f"the tree is a {type(text).__name__}, not JSON text")
        tree = checked_json.parse(text, where, _LIMITS)
        return dec(tree)
    except (KeyError, ValueError, TypeError, RecursionError, OverflowError) as e:
        from ..errors import CorruptCheckpointError
        raise CorruptCheckpointError(f"{where}: invalid state tree ({e!r})", where) from None


def _pairs_of(node: dict, tag: str) -> list:
    """The [key, value] pairs under `tag`; anything else (a string would unpack into two characters) is a
    corrupt tree."""
    pairs = node[tag]
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError(f"{tag} is not a list of [key, value] pairs")
    return pairs


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k
