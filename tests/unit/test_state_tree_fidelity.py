"""Registered objects' and IO state's plain values come back as they were saved, or the save refuses them:
a save that commits what no load can read loses every checkpoint of a run (restore() skips each as
corrupt)."""
from __future__ import annotations

import collections
import dataclasses
import enum
import math
import struct
import warnings

import numpy as np
import pytest
import torch

import recckpt
from recckpt import CheckpointManager, Saver
from recckpt.errors import CheckpointSaveError, CorruptCheckpointError, IncompatibleCheckpointError
from recckpt.format import safetensors_io


class Holder:
    """A registered object (state_dict) and an IO-state provider (dump_io_state) holding one value."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]

    def dump_io_state(self):
        return {"value": self.value}

    def load_io_state(self, state):
        self.value = state["value"]


def _same(a, b) -> bool:
    """Same type and same bits (NaN payloads included)."""
    return type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("value", [np.float64("nan"), np.float64("-inf"), np.float64(0.25), np.float32("nan"),
                                   float("nan"), np.int64(-3)], ids=repr)
@pytest.mark.parametrize("where", ["object", "io_state"])
def test_numpy_scalars_nan_and_inf_included_round_trip_with_their_type(tmp_path, value, where):
    """A NaN np.float64 (a metric of an empty batch) used to commit as 'np.float64(nan)', which every load
    then refused: restore() skipped each checkpoint of the run as corrupt."""
    mgr = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=2), save_interval=1)
    src = Holder(value)
    (mgr.register_for_checkpointing if where == "object" else mgr.register_io_state)("h", src)
    mgr.step()
    mgr.step()
    assert recckpt.verify(tmp_path / "ckpt_2").ok
    dst = Holder()
    mgr2 = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path), save_interval=1)
    (mgr2.register_for_checkpointing if where == "object" else mgr2.register_io_state)("h", dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no checkpoint skipped as corrupt
        assert mgr2.restore() == 2
    assert _same(dst.value, value), (dst.value, value)


@pytest.mark.parametrize("value,back", [(np.str_("part-00003.parquet"), "part-00003.parquet"),
                                        ({np.str_("file"): np.int64(3)}, {"file": np.int64(3)}),
                                        (np.bytes_(b"ab"), b"ab")], ids=["str_", "str_-key", "bytes_"])
def test_numpy_string_scalars_round_trip_as_their_plain_values(tmp_path, value, back):
    """An element of a numpy string array (a reader's current file name) is a str; stored as a numpy
    scalar of dtype '<U..' it committed a checkpoint no load could read."""
    mgr = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path), save_interval=1)
    mgr.register_io_state("reader", Holder(value))
    mgr.step()
    dst = Holder()
    mgr2 = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path), save_interval=1)
    mgr2.register_io_state("reader", dst)
    assert mgr2.restore() == 1 and mgr2.restore_skipped == []
    assert dst.value == back and type(dst.value) is type(back)


@pytest.mark.parametrize("value", [np.void(b"ab"), np.longdouble(1.5)], ids=["void", "longdouble"])
def test_numpy_scalars_without_a_plain_value_are_refused_at_save(tmp_path, value):
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s.register_for_checkpointing("h", Holder(value))
    with pytest.raises((CheckpointSaveError, TypeError), match=r"numpy scalar of dtype .* cannot be stored"):
        s.save("c")
    assert s.checkpoints() == []


def test_a_non_finite_numpy_float64_written_by_the_old_encoding_loads():
    """Until this fix a NaN np.float64 was written as {"__float__": "np.float64(nan)"}: runs that saved one
    can load those checkpoints now."""
    from recckpt.format import tree_codec
    got = tree_codec.decode('{"a":{"__float__":"np.float64(nan)"},"b":{"__float__":"np.float64(-inf)"}}', {}, "w")
    assert type(got["a"]) is np.float64 and math.isnan(got["a"]) and got["b"] == np.float64("-inf")


Point = collections.namedtuple("Point", "epoch batch")


class Phase(enum.IntEnum):
    WARMUP = 1


class Mode(str, enum.Enum):
    TRAIN = "train"


@pytest.mark.parametrize("value,kind", [
    (Point(3, 7), "Point"), (Phase.WARMUP, "Phase"), (Mode.TRAIN, "Mode"), (torch.Size([2, 3]), "Size"),
    (bytearray(b"ab"), "bytearray"), ({Mode.TRAIN: 1}, "Mode"), ([Point(1, 2)], "Point"),
], ids=lambda v: type(v).__name__)
def test_values_that_would_load_back_as_their_base_type_are_refused_at_save(tmp_path, value, kind):
    """An IntEnum stored as an int, a namedtuple as a tuple: the resumed run fails on `.name` or
    `.epoch`, far from the save. The save refuses them, naming the value's type and how to convert it;
    the checkpoint before stays as it was."""
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=None)
    h = Holder(1)
    s.register_for_checkpointing("h", h)
    s.save("good")
    h.value = value
    with pytest.raises((CheckpointSaveError, TypeError, ValueError), match=rf"{kind}.*would load back as a plain"):
        s.save("bad")
    assert s.checkpoints() == ["good"] and recckpt.verify(tmp_path / "good").ok


def test_plain_builtins_still_round_trip_exactly(tmp_path):
    value = {"i": 2 ** 70, "f": -0.0, "s": "x", "b": b"\x00", "t": (1, [2, (3,)]), "n": None, "ok": True,
             7: "int key", (1, 2): "tuple key", "c": collections.Counter({"a": 2}),
             "o": collections.OrderedDict(z=1, a=2)}
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s.register_for_checkpointing("h", Holder(value))
    s.save("c")
    dst = Holder()
    s2 = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s2.register_for_checkpointing("h", dst)
    s2.load()
    assert dst.value == value and type(dst.value["c"]) is collections.Counter
    assert type(dst.value["o"]) is collections.OrderedDict and math.copysign(1, dst.value["f"]) == -1


def test_a_state_over_the_header_cap_is_refused_at_save_not_found_unloadable_later(tmp_path):
    """80 MB of bytes in IO state becomes a 107 MB header, over the 100 MiB every reader enforces: the
    save committed it before, and every load then said the file was corrupt."""
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=None)
    h = Holder(b"")
    s.register_io_state("reader", h)
    s.save("good")
    h.value = bytes(80 << 20)
    with pytest.raises((CheckpointSaveError, ValueError), match=r"over the 104857600-byte limit.*numpy"):
        s.save("bad")
    assert s.checkpoints() == ["good"]
    h.value = np.zeros(80 << 20, dtype=np.uint8)   # what the message advises: tensor data, not the header
    s.save("as_array")
    dst = Holder()
    s2 = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
    s2.register_io_state("reader", dst)
    s2.load(ckpt_id="as_array")
    assert isinstance(dst.value, np.ndarray) and dst.value.shape == (80 << 20,) and not dst.value.any()


def test_a_header_length_over_the_cap_is_named_as_such(tmp_path):
    n = safetensors_io.MAX_HEADER_BYTES + 8
    data = struct.pack("<Q", n) + b" " * n
    for parse in (safetensors_io.parse, safetensors_io.read):
        with pytest.raises(CorruptCheckpointError, match=r"over the 104857600-byte limit"):
            parse(data, "x.safetensors")
    with pytest.raises(CorruptCheckpointError, match=r"header length 64 does not fit the 16-byte file"):
        safetensors_io.parse(struct.pack("<Q", 64) + b" " * 8, "x.safetensors")


@dataclasses.dataclass
class Best:
    step: int
    auc: float


def test_pickled_state_weights_only_refuses_fails_the_save_and_loads_once_allowed(tmp_path):
    """allow_pickle state that torch.load(weights_only=True) refuses used to commit; restore() then called
    the checkpoint corrupt, restored the one before, and the next step's save collided with it."""
    s = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=None)
    h = Holder(None)
    s.register_for_checkpointing("tracker", h, allow_pickle=True)
    s.save("plain")
    h.value = Best(3, 0.8)
    refused = r"'tracker'.*weights_only=True.*Unsupported global: GLOBAL .*Best\)\..*add_safe_globals"
    with pytest.raises((CheckpointSaveError, ValueError), match=refused):
        s.save("refused")
    assert s.checkpoints() == ["plain"]
    with torch.serialization.safe_globals([Best]):
        s.save("allowed")
        dst = Holder()
        s2 = Saver(torch.nn.Linear(2, 2), output_dir=tmp_path)
        s2.register_for_checkpointing("tracker", dst, allow_pickle=True)
        s2.load(ckpt_id="allowed")
    assert dst.value == Best(3, 0.8)


def test_a_weights_only_refusal_at_load_is_not_taken_for_corruption_by_restore(tmp_path):
    """Saved where the class was allowed, restored where it is not: a setup problem. restore() raises
    it on the newest checkpoint instead of skipping to an older one as if the newest were corrupt."""
    mgr = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path, max_keep=None), save_interval=1)
    h = Holder(None)
    mgr.register_for_checkpointing("tracker", h, allow_pickle=True)
    mgr.step()
    h.value = Best(2, 0.5)
    with torch.serialization.safe_globals([Best]):
        mgr.step()
    mgr2 = CheckpointManager(Saver(torch.nn.Linear(2, 2), output_dir=tmp_path), save_interval=1)
    mgr2.register_for_checkpointing("tracker", Holder(), allow_pickle=True)
    with pytest.raises(IncompatibleCheckpointError, match=r"ckpt_2.*'tracker'.*\(Unsupported global: GLOBAL .*Best\)\..*add_safe_globals"):
        mgr2.restore()
    assert mgr2.restore_skipped == []


def _sched_run(decay_first: bool, kind: str):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    dec = {"params": [m.weight], "lr": 0.1, "weight_decay": 0.01}
    nod = {"params": [m.bias], "lr": 0.001, "weight_decay": 0.0}
    opt = torch.optim.SGD([dec, nod] if decay_first else [nod, dec], momentum=0.9)
    if kind == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9 ** e)
    elif kind == "lambda_objects":   # callables with state: LambdaLR saves each one's __dict__, by group
        peaks = (2.0, 8.0) if decay_first else (8.0, 2.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [_Warm(p) for p in peaks])
    elif kind == "cyclic":
        lo, hi = ([0.1, 0.001], [0.5, 0.005]) if decay_first else ([0.001, 0.1], [0.005, 0.5])
        sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=lo, max_lr=hi, step_size_up=2)
    else:
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e),
                                                            torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.8 ** e)],
                                                      milestones=[2])
    return m, opt, sched


class _Warm:
    """A per-group schedule with state of its own (saved in LambdaLR's lr_lambdas)."""

    def __init__(self, peak):
        self.peak, self.calls = peak, 0

    def __call__(self, epoch):
        self.calls += 1
        return min(self.peak, 1.0 + epoch) / self.peak


def _sched_steps(m, opt, sched, n):
    for _ in range(n):
        opt.zero_grad()
        m(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()
        sched.step()


def _lr_of(m, opt):
    return {("weight" if g["params"][0] is m.weight else "bias"): g["lr"] for g in opt.param_groups}


@pytest.mark.parametrize("kind", ["lambda", "lambda_objects", "cyclic", "sequential"])
def test_a_scheduler_follows_its_optimizers_groups_when_they_are_matched_in_another_order(tmp_path, kind):
    """The optimizer's groups are matched by parameter name, so a new run may list them in another order; the
    scheduler's per-group lists (base_lrs, max_lrs, nested schedulers') were kept by position, and a LambdaLR
    then gave the weights the bias's learning rate at the next step, silently."""
    ref = _sched_run(True, kind)
    _sched_steps(*ref, 6)
    src = _sched_run(True, kind)
    _sched_steps(*src, 3)
    s = Saver(src[0], output_dir=tmp_path)
    s.register_for_checkpointing("opt", src[1])
    s.register_for_checkpointing("sched", src[2])
    s.save("c")
    dst = _sched_run(False, kind)   # the same model; its groups listed the other way round
    s2 = Saver(dst[0], output_dir=tmp_path)
    s2.register_for_checkpointing("opt", dst[1])
    s2.register_for_checkpointing("sched", dst[2])
    s2.load()
    _sched_steps(*dst, 3)
    assert _lr_of(dst[0], dst[1]) == _lr_of(ref[0], ref[1])
    assert torch.equal(dst[0].weight, ref[0].weight) and torch.equal(dst[0].bias, ref[0].bias)
