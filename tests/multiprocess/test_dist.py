"""Multi-process tests: real ranks (spawned processes, gloo on 127.0.0.1) saving and loading together."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import rank_scenarios as sc
from helpers.ranks import ROW_BYTES, all_ids, ok, run_ranks
from recckpt import verify
from recckpt.format.catalog import committed
from recckpt.storage import open_storage

N_IDS = 60_000


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """'n4' saved by 4 ranks and 'n2' by 2 ranks into one output dir."""
    base = tmp_path_factory.mktemp("dist")
    out = str(base / "run")
    r4 = ok(run_ranks(4, sc.save_sharded, out, "n4", N_IDS, out_dir=str(base / "r4")))
    r2 = ok(run_ranks(2, sc.save_sharded, out, "n2", N_IDS, out_dir=str(base / "r2")))
    return base, out, r4, r2


def test_sharded_save_commits_once_with_every_rank(saved):
    base, out, r4, r2 = saved
    ids = all_ids(N_IDS)
    assert sum(r["rows"] for r in r4) == sum(r["rows"] for r in r2) == ids.numel()
    assert all(r["dedicated_group"] for r in r4 + r2), "coordination must run on its own gloo group"
    assert r2[0]["committed"] == ["n4", "n2"]
    with open(os.path.join(out, "n4", "manifest.json")) as f:
        m = json.load(f)
    assert m["shard_num"] == 4 and m["tables"]["emb"]["rows"] == ids.numel()
    assert m["worker_steps"] == {str(w): 7 for w in range(4)}
    assert sorted(m["io_state"]) == ["0", "1", "2", "3"]
    files = sorted(os.listdir(os.path.join(out, "n4", "sparse")))
    assert [f for f in files if f.endswith(".index.json")] == [f"worker-{w:05d}.index.json" for w in range(4)]
    assert {f.split("-")[1] for f in files if f.endswith(".bin")} == {f"{w:05d}" for w in range(4)}
    # replicated dense state is written once, by rank 0 (the ranks held different values on purpose)
    assert [f for f in os.listdir(os.path.join(out, "n4")) if "dense" in f] == ["dense.safetensors"]
    assert not [n for n in os.listdir(out) if n.startswith(".staging")]


@pytest.fixture(scope="module")
def loaded(saved):
    base, out, _, _ = saved
    tmp = str(base / "loads")
    os.makedirs(tmp)
    res = ok(run_ranks(3, sc.load_everywhere, out, tmp, out_dir=str(base / "r3")))
    return tmp, res


def _union(tmp, tag, world):
    return [np.load(os.path.join(tmp, f"{tag}-{world}-{r}.npy")) for r in range(world)]


@pytest.mark.parametrize("tag,world", [("n4", 3), ("n4", 2), ("n4", 1), ("n2", 3)])
def test_reshard_every_id_exactly_once_reading_only_own_buckets(loaded, tag, world):
    tmp, res = loaded
    ids = all_ids(N_IDS).numpy()
    parts = _union(tmp, tag, world)
    got = np.concatenate(parts)
    assert got.size == ids.size and np.array_equal(np.sort(got), np.sort(ids)), "each id on exactly one rank"
    saved_by = 4 if tag == "n4" else 2
    table_bytes = ids.size * ROW_BYTES
    # what the bound allows beyond a fair share: the bucket-offset block of every segment (the index
    # part of a shard file); here one segment per saving worker
    index_bytes = saved_by * 8 * (4096 + 1)
    for r in range(world):
        info = res[r][f"{tag}-{world}"]
        assert info["rows"] == parts[r].size and info["partition_ok"], f"rank {r} got ids it does not own"
        bound = 1.2 * table_bytes / world + index_bytes
        assert info["bytes_read"] <= bound, f"rank {r} of {world} read {info['bytes_read']} > {bound:.0f}"
        assert info["bytes_read"] >= table_bytes / world * 0.8   # the counter counts real reads


def test_loaded_dense_is_rank0s_and_defaults_come_from_the_process_group(loaded):
    _, res = loaded
    assert [r["n4-3"]["dense"] for r in res] == [0.0, 0.0, 0.0]   # rank 0's copy, on every rank


def test_user_ownership_function_loads_correctly_but_reads_everything(loaded):
    tmp, res = loaded
    ids = all_ids(N_IDS).numpy()
    parts = _union(tmp, "own", 3)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(ids))
    for r, p in enumerate(parts):
        assert (p % 3 == r).all()
        assert res[r]["own-3"]["bytes_read"] >= ids.size * ROW_BYTES   # every row was read


def test_io_state_resize_rule(loaded):
    _, res = loaded
    assert [r["n2-io"] for r in res[:2]] == [0, 100], "same world size: each worker gets its own IO state"
    err = res[0]["io_error"]
    assert err is not None and "4 worker(s)" in err and "on 3" in err and "io_state_on_resize" in err
    assert res[0]["io_untouched_after_error"], "the failed load must leave the model unchanged"
    assert res[0]["io_drop"] == {"dropped": ["reader"], "pos": -1, "rows": res[0]["n4-3"]["rows"]}


def test_failures_never_hang_and_the_next_save_works(tmp_path):
    # the sleeping rank wakes more than twice the timeout after it stopped (4 s past it): the others
    # have given up on that save by then even on a busy machine; 3 s of timeout is ample for a normal save
    timeout, sleep = 3.0, 7.0
    out = str(tmp_path / "run")
    rep = ok(run_ranks(3, sc.failures, out, timeout, sleep, out_dir=str(tmp_path / "r")))
    for rank, r in enumerate(rep):
        r["rank"] = rank
        assert r["ok1"]["error"] is None
        # a rank raising mid-write: every rank raises, quickly, naming the failed rank
        assert "injected failure" in r["raise"]["error"]
        assert r["rank"] == 1 or "rank 1 failed" in r["raise"]["error"], r["raise"]
        assert r["raise"]["seconds"] < timeout, r["raise"]
        assert r["raise"]["committed"] == ["ok1"]
        # a rank sleeping past the timeout: every rank raises, nothing is committed
        assert r["sleep"]["error"] is not None and r["sleep"]["committed"] == ["ok1"]
        assert r["ok2"]["error"] is None and r["ok2"]["committed"] == ["ok1", "ok2"]
    for r in rep[:2]:   # the ranks that kept responding gave up within the timeout (+ start-up slack)
        assert r["sleep"]["seconds"] < timeout + 3.0, r["sleep"]
        assert "timeout" in r["sleep"]["error"]
    assert rep[0]["staging_left"] == []
    assert not os.path.exists(os.path.join(out, "boom")) and not os.path.exists(os.path.join(out, "slow"))


@pytest.mark.parametrize("when,via_snapshot", [("before", False), ("after", False), ("before", True)])
def test_lost_outcome_after_the_handover_never_breaks_the_commit(tmp_path, when, via_snapshot):
    """Rank 0 stalls past the timeout around its commit. Rank 1 has handed its part over: it must not
    remove the staging directory rank 0 commits from, and it reports what it can see: the checkpoint
    committed (a warning, and save() returns) or not yet (CommitOutcomeUnknownError). The incremental
    saves after it never fail on the parent rank 1 did not hear of: every rank learns the others' parent
    before writing."""
    timeout, sleep = 3.0, 6.0   # rank 0 stalls twice the timeout: rank 1 gives up while it still sleeps
    out = str(tmp_path / "run")
    rep = ok(run_ranks(2, sc.stalled_committer, out, timeout, sleep, when, via_snapshot,
                       out_dir=str(tmp_path / "r")))
    assert rep[0]["error"] is None and rep[0]["warnings"] == []
    for r in rep:
        if when == "after":
            assert r["d"] == {"error": None, "parent": "c", "full_reason": None}, r
        elif via_snapshot:   # rank 0's snapshot holds only changes since "c": nobody writes, all say why
            assert "different parents (rank 0: 'c', rank 1: none)" in r["d"]["error"], r
            assert "next save writes a full checkpoint" in r["d"]["error"], r
        else:
            assert r["d"]["error"] is None and r["d"]["parent"] is None, r
        if when == "before" and not via_snapshot and r is rep[0]:
            assert "different parents (rank 0: 'c', rank 1: none)" in r["d"]["full_reason"], r
        assert r["e"]["error"] is None, r
        assert r["e"]["parent"] == (None if via_snapshot else "d"), r
    if when == "before":
        assert rep[1]["error"].startswith("CommitOutcomeUnknownError") and "may still commit" in rep[1]["error"] \
            and "complete or absent" in rep[1]["error"]
        assert rep[1]["warnings"] == []
    else:
        assert rep[1]["error"] is None
        assert len(rep[1]["warnings"]) == 1 and "is committed, so this save succeeded" in rep[1]["warnings"][0]
    # either way rank 0 committed a complete checkpoint
    assert [i for i, _ in committed(open_storage(out))] == (["c", "e"] if via_snapshot else ["c", "d", "e"])
    verify(os.path.join(out, "c")).raise_if_failed()
    assert not [n for n in os.listdir(out) if n.startswith(".staging")]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_manager_builds_on_a_checkpoint_whose_commit_a_rank_did_not_hear_of(tmp_path, async_save):
    """Rank 0 commits ckpt_2 after rank 1 gave up waiting for the outcome (CommitOutcomeUnknownError on
    rank 1). Once ckpt_2 is committed, the manager's next increment builds on it on both ranks. Before, rank 1
    still built on ckpt_1: the ranks' parents differed, so the increment was written full (sync), or not at
    all, a failed save raised in the training loop (async)."""
    out = str(tmp_path / "run")
    rep = ok(run_ranks(2, sc.manager_lost_outcome, out, 3.0, 6.0, async_save, out_dir=str(tmp_path / "r")))
    assert rep[0]["errors"] == [], rep[0]
    assert len(rep[1]["errors"]) == 1 and "CommitOutcomeUnknownError" in rep[1]["errors"][0], rep[1]
    for r in rep:
        assert r["parent"] == "ckpt_2" and r["kinds"].get("ckpt_3") == "incremental", r
        assert r["same_rows"], r
    assert [i for i, _ in committed(open_storage(out))] == ["ckpt_1", "ckpt_2", "ckpt_3"]


@pytest.mark.parametrize("option", ["num_buckets", "chunk_bytes"])
def test_ranks_with_different_layout_options_are_told_which(tmp_path, option):
    """Ranks whose SaveOptions lay rows out differently all refuse before writing, naming the option and
    each rank's value (not a corrupt-index message from the commit), and the next save works."""
    out = str(tmp_path / "run")
    rep = ok(run_ranks(2, sc.mixed_layouts, out, option, out_dir=str(tmp_path / "r")))
    other = {"num_buckets": 1024, "chunk_bytes": 64 << 10}[option]
    first = getattr(sc.OPTS, option)
    for r in rep:
        assert f"SaveOptions.{option} differ (rank 0: {first}, rank 1: {other})" in r["error"], r
        assert r["committed"] == ["y"], r
    assert not [n for n in os.listdir(out) if n.startswith(".staging")]


def test_an_id_only_one_rank_finds_committed_fails_every_rank_alike_and_the_next_save_works(tmp_path):
    """Another job commits 'c5' between rank 1's check of that id and rank 0's. Before, rank 0 raised
    alone before the ranks met: rank 1 waited for it in `begin` and the next save met it there with
    another id ("the ranks are saving different checkpoints"). Now the finding travels with the plans,
    every rank raises CheckpointExistsError naming the rank that found it, and the next save commits."""
    out = str(tmp_path / "run")
    rep = ok(run_ranks(2, sc.taken_id_seen_by_one_rank, out, out_dir=str(tmp_path / "r")))
    assert rep[0]["c5"].startswith("CheckpointExistsError: ") and "already exists" in rep[0]["c5"], rep
    assert rep[1]["c5"].startswith("CheckpointExistsError: ") and "rank(s) 0 found it already committed" in rep[1]["c5"], rep
    assert rep[1]["c5_s"] < 20, rep        # not the coordination timeout
    for r in rep:
        assert r["c6"] is None, rep
        assert r["committed"] == ["c5", "c6"], rep
    assert not [n for n in os.listdir(out) if n.startswith(".staging")]


def test_a_save_only_rank_0_calls_names_the_group_rendezvous_and_its_real_timeout(tmp_path):
    """The first save builds recckpt's gloo group, a rendezvous bounded by max(coordination timeout,
    groups.RENDEZVOUS_MIN_S). Before, rank 0 waited that long and then blamed the coordination timeout
    ("timeout 1s" after 120 s here)."""
    rep = ok(run_ranks(2, sc.lone_first_save, str(tmp_path / "run"), 4.0, out_dir=str(tmp_path / "r")))
    err = rep[0]["error"]
    assert err is not None and "building recckpt's gloo group" in err and "(timeout 4s;" in err, err
    assert "every rank must call save() together" in err, err
    assert rep[0]["waited_s"] >= 3.5, rep[0]


def test_a_restore_whose_other_rank_is_killed_says_what_this_rank_loaded(tmp_path):
    """Rank 1 is SIGKILLed in the middle of CheckpointManager.restore(). Rank 0 finishes its load; the
    agreement on the outcome then fails, and its error says that this rank loaded the checkpoint and that
    the ranks may now differ (before, the bare agreement error said nothing of what was applied)."""
    rdir = str(tmp_path / "r")
    rep = run_ranks(2, sc.restore_with_a_rank_killed, str(tmp_path / "run"), rdir, out_dir=rdir)
    assert rep[1]["result"] == {"killed": True}, rep[1]
    got = ok(rep[:1])[0]
    assert got.get("error", "").startswith("CoordinationError: restoring "), got
    assert "ckpt_1 (global step 1): this rank loaded it, but the ranks could not agree on the outcome" in got["error"], \
        got
    assert "restart every rank and restore again" in got["error"], got
    assert got["loaded"] is True, got
    # the agreement's error within it names the rank that never arrived (the store can tell)
    assert "ranks that did not reach comparing outcomes" in got["error"] and "rank 1 (last reached: " in got["error"], got


def test_a_save_whose_other_rank_is_killed_names_that_rank(tmp_path):
    """Rank 1 is SIGKILLed inside a save. Rank 0's error said only that "another rank failed, stopped
    responding or did not call save"; it now names rank 1 and the last step rank 1 reached."""
    rdir = str(tmp_path / "r")
    rep = run_ranks(3, sc.save_with_a_rank_killed, str(tmp_path / "run"), rdir, out_dir=rdir)
    assert rep[1]["result"] == {"killed": True}, rep[1]
    for got in ok([rep[0], rep[2]]):
        err = got.get("error", "")
        assert "checkpoint 'b'" in err and "ranks that did not reach " in err, got
        assert "rank 1 (last reached: " in err and "rank 0 (" not in err and "rank 2 (" not in err, got
        # The next save rebuilds the dropped save group: it waited RENDEZVOUS_MIN_S (120 s) for the dead
        # rank whatever the coordination timeout (10 s here), and a process whose async writer was in it
        # could not exit for that long (a helper's 2-rank crash attack).
        assert "building recckpt's gloo group" in got.get("next_error", ""), got
        assert got["next_s"] < 40, got


def test_duplicate_ids_across_ranks(tmp_path):
    import torch

    from helpers.ranks import SPEC, DictTable, Holder, rows_for
    from recckpt import Saver
    from recckpt.errors import DuplicateIdsError
    out = str(tmp_path / "run")
    ok(run_ranks(2, sc.save_duplicates, out, out_dir=str(tmp_path / "r")))

    def load(ckpt, **conf):
        t = DictTable("emb", SPEC)
        Saver(Holder(t), output_dir=out).load(ckpt_id=ckpt, load_conf={"load": ["sparse", "sparse_opt"], **conf})
        return t

    with pytest.raises(DuplicateIdsError, match=r"table 'emb' stores 2 id\(s\) more than once") as e:
        load("dup")
    assert "dup" in str(e.value) and "newest" in str(e.value)
    t = load("dup", duplicates="newest")
    got = dict(zip(t.ids.tolist(), t.cols["embedding"][:, 0].tolist()))
    assert sorted(got) == [5, 6, 100, 101, 200, 201]
    want = rows_for(torch.tensor([5, 6]), salt=1000.0)["embedding"][:, 0].tolist()   # rank 1's copy
    assert [got[5], got[6]] == want
    with pytest.raises(DuplicateIdsError, match="steps are equal"):
        load("dup_tie", duplicates="newest")
