'''HashTable pickles made before recckpt/state/hashtable.py became a package still load.

Users torch.save a model that holds a table, or its state_dict (the table is its own extra state), and
load it later with a newer recckpt. The three files in tests/fixtures/ were written by the code of
commit f960feb (hashtable.py in one module) with the script below, run from the repository root:

    import torch
    from recckpt import HashTable
    from recckpt.state import initializers
    from recckpt.state.eviction import EvictionPolicy
    from recckpt.state.optim import SparseAdagrad


    def continue_training(model):
        """One more step, as a user resumes: the same batch, a new optimizer, a seeded init for new ids."""
        users = model["users"]
        torch.manual_seed(1)
        users.step = 5
        model["mlp"](users(torch.tensor([2, 7, 200, 2]))).sum().backward()
        SparseAdagrad(model, lr=0.1).step()
        return {k: users.slot(k).clone() for k in users.slot_names}


    torch.manual_seed(0)
    users = HashTable("users", 4, counters=True, initializer=initializers.uniform(-0.1, 0.1))
    users.add_slot("bias", torch.float32, (), init=0.5)
    model = torch.nn.ModuleDict({"users": users, "mlp": torch.nn.Linear(4, 1)})
    opt = SparseAdagrad(model, lr=0.1)
    for step, batch in enumerate([[1, 2, 3, 2], [4, 5, 9, -2**63, 2**63 - 1], [1, 6, 7, 8, 4, -2**63, 2**63 - 1]], start=1):
        users.step = step
        model["mlp"](users(torch.tensor(batch))).sum().backward()
        opt.step()
    mark = users.mark_changes()
    users.step = 4
    model["mlp"](users(torch.tensor([100, 101, 2]))).sum().backward()
    opt.step()
    users.remove_ids(torch.tensor([3]))
    assert users.evict(EvictionPolicy(max_idle_steps=1)) == 2      # 5 and 9, last written at step 2
    expected = {
        "ids": users.ids(), "step": users.step, "mark": mark, "state_keys": sorted(users.__getstate__()),
        "slots": {k: users.slot(k).clone() for k in users.slot_names},
        "changed_ids": torch.cat([i for i, _ in users.export_changes(mark, ["embedding"], 4).chunks]),
        "removed_ids": users.export_changes(mark, ["embedding"], 4).removed,
    }
    sd = model.state_dict()
    torch.save(model, "tests/fixtures/hashtable_pre_split.pt")              # as users save a model
    torch.save(sd, "tests/fixtures/hashtable_pre_split_state_dict.pt")  # and its state_dict
    expected["after_one_step"] = continue_training(model)
    torch.save(expected, "tests/fixtures/hashtable_pre_split_expected.pt")

The files are loaded with weights_only=True and an explicit allow-list, which also proves that the
pickles name no class but these (the table's helpers must never appear in a pickle).
'''
import io
import os
import pickle
import pickletools

import torch

import recckpt
from recckpt.state import initializers
from recckpt.state.hashtable import HashTable
from recckpt.state.optim import SparseAdagrad
from recckpt.state.protocol import SlotSpec

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
#: Every class a pickled model of the fixture names, and nothing of recckpt but the table's public class.
ALLOWED = [torch.nn.ModuleDict, torch.nn.Linear, HashTable, initializers.uniform, SlotSpec]


def _load(name):
    with torch.serialization.safe_globals(ALLOWED):
        return torch.load(os.path.join(FIXTURES, name), weights_only=True)


def _expected():
    return torch.load(os.path.join(FIXTURES, "hashtable_pre_split_expected.pt"), weights_only=True)


def _continue_training(model):
    """The fixture script's `continue_training`, unchanged."""
    users = model["users"]
    torch.manual_seed(1)
    users.step = 5
    model["mlp"](users(torch.tensor([2, 7, 200, 2]))).sum().backward()
    SparseAdagrad(model, lr=0.1).step()
    return {k: users.slot(k).clone() for k in users.slot_names}


def _assert_rows(table, exp):
    assert torch.equal(table.ids(), exp["ids"])
    assert table.slot_names == list(exp["slots"]) == ["embedding", "freq", "last_step", "bias", "adagrad.acc"]
    for k, v in exp["slots"].items():
        assert torch.equal(table.slot(k), v), k
    assert table.lookup(exp["ids"]).tolist() == list(range(len(exp["ids"])))


def _globals(blob: bytes):
    """(module, name) of every class or function a pickle names."""
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(io.BytesIO(blob)):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            out.add(tuple(arg.split(" ", 1)))
    return out


def test_the_public_class_path_is_the_one_pickles_name():
    assert HashTable.__module__ == "recckpt.state.hashtable" and HashTable.__qualname__ == "HashTable"
    assert recckpt.HashTable is HashTable and recckpt.state.HashTable is HashTable
    t = HashTable("t", 2, counters=True)
    t(torch.arange(3))
    names = {g for g in _globals(pickle.dumps(t)) if g[0].startswith("recckpt")}
    assert names == {("recckpt.state.hashtable", "HashTable"), ("recckpt.state.protocol", "SlotSpec"),
                     ("recckpt.state.initializers", "normal")}


def test_a_model_pickled_before_the_split_loads_and_trains_on():
    exp = _expected()
    model = _load("hashtable_pre_split.pt")
    users = model["users"]
    assert type(users) is HashTable and users.name == "users" and users.dim == 4
    _assert_rows(users, exp)
    assert users.step == exp["step"] == 4
    # change marks survive: the rows written since the mark and the ids removed since it
    ch = users.export_changes(exp["mark"], ["embedding"], 4)
    assert torch.equal(torch.cat([i for i, _ in ch.chunks]), exp["changed_ids"])
    assert torch.equal(ch.removed, exp["removed_ids"]) and exp["removed_ids"].tolist() == [3, 5, 9]
    mark = users.mark_changes()
    assert mark == exp["mark"] + 1
    after = _continue_training(model)  # counters count, the optimizer updates, a new id is inserted
    assert list(after) == list(exp["after_one_step"])
    for k, v in exp["after_one_step"].items():
        assert torch.equal(after[k], v), k
    assert len(users) == len(exp["ids"]) + 1
    ch = users.export_changes(mark, ["embedding"], 8)
    assert sorted(torch.cat([i for i, _ in ch.chunks]).tolist()) == [2, 7, 200]


def test_a_state_dict_pickled_before_the_split_loads_into_a_new_model():
    exp = _expected()
    sd = _load("hashtable_pre_split_state_dict.pt")
    _assert_rows(sd["users._extra_state"], exp)
    users = HashTable("users", 4, counters=True, initializer=initializers.uniform(-0.1, 0.1))
    users.add_slot("bias", torch.float32, (), init=0.5)
    model = torch.nn.ModuleDict({"users": users, "mlp": torch.nn.Linear(4, 1)})
    model.load_state_dict(sd)
    _assert_rows(users, exp)
    users.add_slot("adagrad.acc", torch.float32, (4,), exist_ok=True)   # what SparseAdagrad would do
    after = _continue_training(model)
    for k, v in exp["after_one_step"].items():
        assert torch.equal(after[k], v), k


def test_new_pickles_keep_the_layout_old_code_reads():
    """A pickle made now has the same attributes as one made before the split, so a recckpt from
    before the split can read it, and it names no class of the package's modules."""
    exp = _expected()
    users = _load("hashtable_pre_split.pt")["users"]
    assert sorted(users.__getstate__()) == exp["state_keys"]
    buf = io.BytesIO()
    torch.save(torch.nn.ModuleDict({"users": users}), buf)
    buf.seek(0)
    with torch.serialization.safe_globals(ALLOWED):
        again = torch.load(buf, weights_only=True)["users"]
    _assert_rows(again, exp)
    ch = again.export_changes(exp["mark"], ["embedding"], 4)
    assert torch.equal(ch.removed, exp["removed_ids"])
