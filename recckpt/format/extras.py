"""The extras tree (registered objects + sparse-optimizer state): structural validation on read, and the
opt-in pickle path for objects the tree codec cannot represent.

Pickle is never used unless a user registers an object with `allow_pickle=True`, and even then it is
read only through `torch.load(weights_only=True)`, which refuses to build arbitrary classes or call
arbitrary functions: a hostile checkpoint can make such a load fail, never run code. An object saved
this way is loaded only into an object registered with `allow_pickle=True` under the same name; every
other load refuses it without unpickling a byte.
"""
from __future__ import annotations

import io
import re
import sys

import numpy as np

from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from . import tree_codec

#: kinds of an entry of extras["objects"]; the pickled ones carry a uint8 tensor of torch.save bytes.
PLAIN_KINDS = ("state_dict", "value")
PICKLED_PREFIX = "pickled_"
KINDS = PLAIN_KINDS + tuple(PICKLED_PREFIX + k for k in PLAIN_KINDS)
#: Optional key of an entry: the model name of each parameter of an optimizer's numbered state.
PARAM_NAMES = "param_names"


def entry(name: str, kind: str, state, allow_pickle: bool, param_names: list | None = None) -> dict:
    """The tree entry of one registered object. With allow_pickle, state the tree codec refuses is stored
    as torch.save bytes instead (state it can represent never is). `param_names`: for an optimizer that
    numbers its parameters, each one's name in the model (None: not a model parameter), so that a load
    maps its state by name (docs/FORMAT.md, "Optimizer state by parameter name")."""
    out = _entry(name, kind, state, allow_pickle)
    if param_names is not None:
        out[PARAM_NAMES] = list(param_names)
    return out


def _entry(name: str, kind: str, state, allow_pickle: bool) -> dict:
    if allow_pickle:
        try:
            tree_codec.encode(state, f"extras[{name!r}]")
        except TypeError:
            import torch  # saving: torch is loaded already
            buf = io.BytesIO()
            torch.save(state, buf)
            check_loadable(name, buf.getvalue())
            return {"kind": PICKLED_PREFIX + kind,
                    "state": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    return {"kind": kind, "state": state}


def check_loadable(name: str, data: bytes) -> None:
    """Refuse (ValueError) pickled state that the load's torch.load(weights_only=True) would refuse: saved, it
    would commit a checkpoint no load can apply."""
    import torch  # saving: torch is loaded already
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only refuses with UnpicklingError, RuntimeError, ...
        raise ValueError(
            f"extras[{name!r}]: the object's state needs pickle (allow_pickle=True), and "
            f"torch.load(weights_only=True), which every load uses, refuses it ({_refusal(exc)}). Allow its "
            f"classes with torch.serialization.add_safe_globals([...]) in the saving and the loading process, or "
            f"return plain values from state_dict()") from None


def _refusal(exc: BaseException) -> str:
    """What weights_only refused, from torch's long message (its advice to load unsafely left out)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"Unsupported global: [^\n]*?(?= was not an allowed global|$)", text, re.M)
    return found.group(0) if found else f"{type(exc).__name__}: {' '.join(text.split())[:300]}"


def _is_byte_vector(x) -> bool:
    """A 1-D uint8 tensor (or numpy array, as the torch-free readers decode trees)."""
    if isinstance(x, np.ndarray):
        return x.dtype == np.uint8 and x.ndim == 1
    torch = sys.modules.get("torch")  # no tensor exists unless torch is loaded
    return torch is not None and isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.dim() == 1


def _not_numbered_optimizer_state(state, n: int) -> str | None:
    """Why `state` is not a torch.optim state_dict of `n` parameters numbered 0..n-1 (None: it is): the form
    whose parameters a save names in PARAM_NAMES (docs/FORMAT.md, "Extras")."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) \
            or not isinstance(state.get("param_groups"), list):
        return "is not {'state': {...}, 'param_groups': [...]}"
    params = []
    for g in state["param_groups"]:
        if not isinstance(g, dict) or not isinstance(g.get("params", []), list):
            return "has a param group that is not an object with a 'params' list"
        params += g.get("params", [])
    if not all(type(p) is int for p in params) or sorted(params) != list(range(len(params))):
        return "numbers its parameters otherwise than 0, 1, ... once each"
    if len(params) != n:
        return f"holds {len(params)} parameters for {n} names"
    if not all(0 <= k < n for k in state["state"] if type(k) is int):   # (other keys: an optimizer's own)
        return "holds state of a parameter its groups do not number"
    return None


def _check_numbered(state, names: list, what: str, bad) -> None:
    why = _not_numbered_optimizer_state(state, len(names))
    if why:
        bad(f"{what} records '{PARAM_NAMES}' (an optimizer's), but its state {why}")


def validate(tree, where: str) -> dict:
    """Check the shape of a decoded extras tree before anything in it is used."""
    def bad(problem):
        raise CorruptCheckpointError(f"{where}: invalid extras tree: {problem}", where)

    if not isinstance(tree, dict) or set(tree) - {"objects", "sparse_optimizer"}:
        bad("expected an object with keys 'objects' and 'sparse_optimizer'")
    objects = tree.get("objects", {})
    if not isinstance(objects, dict):
        bad("'objects' is not an object")
    for name, e in objects.items():
        if not isinstance(name, str) or not isinstance(e, dict) or not (
                {"kind", "state"} <= set(e) <= {"kind", "state", PARAM_NAMES}):
            bad(f"entry {name!r:.80} is not {{'kind', 'state'[, '{PARAM_NAMES}']}}")
        names = e.get(PARAM_NAMES, [])
        if not isinstance(names, list) or not all(n is None or isinstance(n, str) for n in names):
            bad(f"entry {name!r:.80}: '{PARAM_NAMES}' is not a list of strings and nulls")
        if PARAM_NAMES in e and not e["kind"].startswith(PICKLED_PREFIX):   # (a pickled one: once unpickled)
            _check_numbered(e["state"], names, f"entry {name!r:.80}", bad)
        if e["kind"] not in KINDS:
            bad(f"entry {name!r:.80} has unknown kind {e['kind']!r:.40}")
        if e["kind"].startswith(PICKLED_PREFIX) and not (
                _is_byte_vector(e["state"])):
            bad(f"pickled entry {name!r:.80} does not hold a uint8 byte tensor")
    sp = tree.get("sparse_optimizer")
    if sp is not None and not isinstance(sp, dict):
        bad("'sparse_optimizer' is neither null nor an object")
    return {"objects": objects, "sparse_optimizer": sp}


def unpickle_allowed(tree: dict, wanted: dict[str, bool], where: str) -> dict:
    """Replace pickled entries of the objects in `wanted` (name -> registered with allow_pickle) by their
    plain form. Refuses (IncompatibleCheckpointError) a pickled entry whose object does not allow pickle,
    and a payload that torch.load(weights_only=True) rejects. Entries of names
    not in `wanted` are left as they are and never unpickled."""
    objects = dict(tree["objects"])
    for name, allowed in wanted.items():
        e = objects.get(name)
        if e is None or not e["kind"].startswith(PICKLED_PREFIX):
            continue
        if not allowed:
            raise IncompatibleCheckpointError(
                f"{where}: object {name!r} was saved with pickle (allow_pickle=True) and the object "
                f"registered under that name does not allow pickle. If you trust this checkpoint, register "
                f"it with register_for_checkpointing({name!r}, obj, allow_pickle=True); it is then read "
                f"with torch.load(weights_only=True). Nothing was loaded.")
        data = np.asarray(e["state"]).tobytes()
        import torch  # loading into a model: torch is loaded already
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only raises UnpicklingError, RuntimeError, ... on refusal
            # The file's bytes passed their checksum, so this is what was saved: a class this process has not
            # allowed (a setup problem, which restore() must not take for a corrupt checkpoint and skip), or
            # an untrusted writer's payload. Nothing is built either way.
            raise IncompatibleCheckpointError(
                f"{where}: object {name!r}: its pickled state was refused by torch.load(weights_only=True) "
                f"({_refusal(exc)}). If the state holds your own classes (or torch "
                f"classes weights_only does not allow), allow them with torch.serialization.add_safe_globals "
                f"before the load; if you do not trust the checkpoint, do not. Nothing was loaded",
                path=where) from None
        if PARAM_NAMES in e:
            def bad(problem):
                raise CorruptCheckpointError(f"{where}: invalid extras tree: {problem}", where)
            _check_numbered(state, e[PARAM_NAMES], f"entry {name!r:.80} (unpickled)", bad)
        objects[name] = dict(e, kind=e["kind"][len(PICKLED_PREFIX):], state=state)
    return {"objects": objects, "sparse_optimizer": tree["sparse_optimizer"]}
