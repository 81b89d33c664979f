"""Every ```python block of README.md and docs/*.md is code users paste: it must run as written.

The blocks of one file run in order in one namespace (a later block may use what an earlier one
defined), in a fresh temporary working directory. An HTML comment right before a block changes that:

    <!-- doc-test: setup NAME -->      run the fixture NAME below first (it creates the files and
                                       objects the block assumes, e.g. other runs' checkpoints)
    <!-- doc-test: skip (REASON) -->   do not run the block; the reason is required

Fixtures live here, not in the markdown, so the docs show only what a user types.
"""
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

_BLOCK = re.compile(r"(?:<!--\s*doc-test:\s*(?P<directive>.*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)
_SKIP = re.compile(r"skip \((?P<reason>[^)]+)\)$")
_SETUP = re.compile(r"setup (?P<name>\w+)$")


class _Reader:
    """A data reader with IO state, as the README's training loop expects."""

    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def __iter__(self):
        while self.pos < self.batches:
            self.pos += 1
            yield self.pos

    def dump_io_state(self):
        return {"pos": self.pos}

    def load_io_state(self, state):
        self.pos = state["pos"]


def _setup_model_bank_runs(ns):
    """Two earlier runs for the README's model bank (the quick start's `Model` and `saver` exist):
    runs/base/ckpt_90000 with the same tables, runs/item_tower whose item table is named item_v2."""
    import recckpt
    recckpt.Saver(ns["Model"](), output_dir="runs/base").save("ckpt_90000")

    class ItemTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.item_v2 = recckpt.HashTable("item_v2", dim=16)

    tower = ItemTower()
    tower.item_v2(torch.arange(50))   # a lookup inserts the ids
    recckpt.Saver(tower, output_dir="runs/item_tower").save("ckpt_5")
    ns["saver"] = recckpt.Saver(ns["Model"](), output_dir="run_with_manager")
    ns["reader"] = _Reader(batches=3)
    ns["train_step"] = lambda batch: None
    ns["_bank_item_rows"] = len(tower.item_v2)


def _setup_incremental_model(ns):
    """docs/INCREMENTAL.md: a model with a change-tracking table, its optimizer, a `train_step()` that
    changes a few rows, and the names the page's blocks use."""
    import recckpt

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = recckpt.HashTable("emb", dim=8)

    model = Model()
    model.emb(torch.arange(100))
    opt = recckpt.SparseAdam([model.emb], lr=0.01)

    def train_step():
        model.emb(torch.randint(0, 200, (20,))).sum().backward()
        opt.step()
        opt.zero_grad()

    ns.update(model=model, opt=opt, train_step=train_step, recckpt=recckpt, Saver=recckpt.Saver,
              CheckpointManager=recckpt.CheckpointManager, IncrementPolicy=recckpt.IncrementPolicy)


def _setup_reader_runs(ns):
    """docs/CLI.md's reader example: runs/a/ckpt_1000, a table 'user' of 64-wide embeddings, dense
    weights, a registered object and IO state, saved by 4 workers (the example reads worker 0's share)."""
    import recckpt

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = recckpt.HashTable("user", dim=64)
            self.mlp = torch.nn.Linear(64, 8)

    for w in range(4):
        tower = Tower()
        tower.user(torch.arange(w * 100, (w + 1) * 100))   # a lookup inserts the ids
        saver = recckpt.Saver(tower, output_dir="runs/a")
        saver.register_for_checkpointing("lr", 0.01)
        saver.register_io_state("reader", _Reader(batches=3))
        saver.save("ckpt_1000", step=1000, shard_id=w, shard_num=4)


SETUPS = {"model_bank_runs": _setup_model_bank_runs, "incremental_model": _setup_incremental_model,
          "reader_runs": _setup_reader_runs}


def _check_readme(ns, cwd):
    assert (cwd / "ckpts" / "ckpt_10" / "manifest.json").is_file()
    assert (cwd / "ckpts" / "checkpoint").read_text().split() == ["ckpt_10"]
    # the model bank ran: its second source names the checkpoint's table (item_v2), else it raises
    assert ns["_bank_item_rows"] > 0


def _check_cli(ns, cwd):
    # the example ran to its end: the loop saw worker 0's share of the table, all of it 64 wide
    assert ns["view"].tables["user"].rows == 400 and ns["view"].step == 1000
    assert ns["ids"].dtype.name == "int64" and ns["cols"]["embedding"].shape[1] == 64


def _check_incremental(ns, cwd):
    import json
    inc = json.loads((cwd / "ckpts" / "step_2000" / "manifest.json").read_text())
    full = json.loads((cwd / "ckpts" / "step_2000_full" / "manifest.json").read_text())
    assert inc["parent"]["ckpt_id"] == "step_1000" and inc["tables"]["emb"]["changes"]
    assert "parent" not in full and full["tables"]["emb"]["rows"] == len(ns["model"].emb)
    assert ns["mgr"].increments.full_every == 10


CHECKS = {"README.md": _check_readme, os.path.join("docs", "INCREMENTAL.md"): _check_incremental,
          os.path.join("docs", "CLI.md"): _check_cli}


def blocks(path):
    """[(directive or None, code)] of one markdown file."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return [(m.group("directive"), m.group("code")) for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("path", [p for p in DOC_FILES if blocks(p)])
def test_doc_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "doc_block"}
    ran = 0
    for i, (directive, code) in enumerate(blocks(path)):
        if directive is not None and _SKIP.match(directive):
            continue
        if directive is not None:
            SETUPS[_SETUP.match(directive).group("name")](ns)
        exec(compile(code, f"{path} block {i + 1}", "exec"), ns)
        ran += 1
    if not ran:
        pytest.skip(f"{path}: every block is marked doc-test: skip (see the reasons in the file)")
    if path in CHECKS:
        CHECKS[path](ns, tmp_path)


@pytest.mark.parametrize("path", DOC_FILES)
def test_doc_test_directives_are_known(path):
    for directive, _ in blocks(path):
        if directive is None:
            continue
        skip, setup = _SKIP.match(directive), _SETUP.match(directive)
        assert skip or (setup and setup.group("name") in SETUPS), (
            f"{path}: unknown doc-test directive {directive!r}; use 'setup NAME' with NAME in "
            f"{sorted(SETUPS)} or 'skip (reason)'")


def test_readme_and_sparse_state_have_blocks():
    """The extraction itself works: the files known to hold examples yield them."""
    assert len(blocks("README.md")) >= 2
    assert len(blocks(os.path.join("docs", "SPARSE_STATE.md"))) >= 1
