"""Save policies, their composition and validation, and the keep policy as a pure function."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from recckpt import (
    AnySavePolicy,
    AtSteps,
    EphemeralEveryNSteps,
    EveryNSeconds,
    EveryNSteps,
    IncrementPolicy,
    KeepPolicy,
    PreemptionHandler,
)
from recckpt.errors import InvalidArgumentError
from recckpt.train.policies import EPHEMERAL, PERMANENT, CkptEntry, SaveContext, SaveSchedule


def ctx(seconds=0.0):
    return SaveContext(seconds_since_save=seconds)


def decisions(schedule, steps, seconds=0.0, agree=None):
    return {s: d for s in range(1, steps + 1) if (d := schedule.decide(s, ctx(seconds), agree)) is not None}


def test_every_n_steps_and_fixed_steps_compose():
    s = SaveSchedule([EveryNSteps(10), AtSteps([3, 25, 10])], KeepPolicy())
    got = decisions(s, 40)
    assert set(got) == {3, 10, 20, 25, 30, 40}
    assert set(got.values()) == {PERMANENT}


def test_ephemeral_fills_the_gaps_and_regular_wins_on_shared_steps():
    s = SaveSchedule([EveryNSteps(10), EphemeralEveryNSteps(4)], KeepPolicy())
    got = decisions(s, 24)
    assert {k for k, v in got.items() if v == PERMANENT} == {10, 20}
    assert {k for k, v in got.items() if v == EPHEMERAL} == {4, 8, 12, 16, 24}  # 20 is regular


def test_time_policy_uses_elapsed_seconds_and_rank0_agreement():
    s = SaveSchedule([EveryNSeconds(5.0)], KeepPolicy())
    assert s.needs_agreement
    assert s.decide(1, ctx(4.9)) is None
    assert s.decide(2, ctx(5.0)) == PERMANENT
    # rank 0 said no: a worker whose own clock says yes must not save (and vice versa)
    assert s.decide(3, ctx(9.0), agree=lambda mine: False) is None
    assert s.decide(4, ctx(0.0), agree=lambda mine: True) == PERMANENT
    seen = []
    step_based = SaveSchedule([EveryNSteps(2)], KeepPolicy())
    step_based.decide(2, ctx(), agree=lambda m: seen.append(m) or m)
    assert seen == [] and not step_based.needs_agreement  # step-based policies need no collective


@pytest.mark.parametrize("make,match", [
    (lambda: EveryNSteps(0), "EveryNSteps.n"),
    (lambda: EveryNSteps(True), "EveryNSteps.n"),
    (lambda: EveryNSeconds(0), "seconds"),
    (lambda: EveryNSeconds(float("nan")), "seconds"),
    (lambda: AtSteps([0, 5]), "AtSteps"),
    (lambda: AtSteps(5), "AtSteps.steps must be an iterable"),
    (lambda: EphemeralEveryNSteps(-1), "EphemeralEveryNSteps.n"),
    (lambda: KeepPolicy(max_keep=0), "max_keep must be an integer >= 1"),
    (lambda: KeepPolicy(keep_every_n_steps=0), "keep_every_n_steps"),
    (lambda: SaveSchedule([EveryNSteps(10), EphemeralEveryNSteps(10)], KeepPolicy()), "more often"),
    (lambda: SaveSchedule([EveryNSteps(10), EveryNSteps(4), EphemeralEveryNSteps(5)], KeepPolicy()),
     "more often"),
    (lambda: SaveSchedule([EphemeralEveryNSteps(2), EphemeralEveryNSteps(3)], KeepPolicy()), "at most one"),
    (lambda: SaveSchedule(["every 10"], KeepPolicy()), "should_save"),
    (lambda: AnySavePolicy([EveryNSteps(3), 7]), "should_save"),
    (lambda: IncrementPolicy(full_every=2.5), r"IncrementPolicy.full_every must be an int >= 1 or None, got 2.5"),
    (lambda: IncrementPolicy(full_every="3"), r"IncrementPolicy.full_every must be an int >= 1 or None, got '3'"),
    (lambda: IncrementPolicy(full_every=True), "IncrementPolicy.full_every"),
    (lambda: PreemptionHandler(signals=(99999,)), r"PreemptionHandler.signals: \[99999\] are not signals"),
    (lambda: PreemptionHandler(signals=("TERM",)), "'TERM' is not a signal number"),
    (lambda: PreemptionHandler(signals=(True,)), "True is not a signal number"),   # was taken as SIGHUP
    (lambda: PreemptionHandler(signals="SIGTERM"), "must be signal numbers"),
    (lambda: AnySavePolicy(EveryNSteps(3)), "takes a list of save policies"),    # bare TypeErrors before
    (lambda: AnySavePolicy(None), "takes a list of save policies"),
])
def test_invalid_policies_fail_at_construction_with_the_reason(make, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make()


def E(i, step, eph=False):
    return CkptEntry(i, step, eph)


def test_keep_newest_n_plus_every_kth():
    entries = [E(f"c{s}", s) for s in range(10, 110, 10)]
    doomed = KeepPolicy(max_keep=2, keep_every_n_steps=40).doomed(entries)
    kept = [e.ckpt_id for e in entries if e.ckpt_id not in doomed]
    assert kept == ["c40", "c80", "c90", "c100"]
    assert KeepPolicy(max_keep=None).doomed(entries) == []


def test_ephemeral_only_newest_kept_and_not_counted_in_max_keep():
    entries = [E("c10", 10), E("e12", 12, True), E("e14", 14, True), E("c20", 20), E("e22", 22, True)]
    doomed = KeepPolicy(max_keep=2).doomed(entries)
    assert sorted(doomed) == ["e12", "e14"]  # e22 is the newest; c10 and c20 are the 2 regular ones
    entries.append(E("c30", 30))
    assert sorted(KeepPolicy(max_keep=2).doomed(entries)) == ["c10", "e12", "e14", "e22"]


def test_newest_and_restore_point_survive():
    entries = [E("c10", 10), E("e12", 12, True)]
    assert KeepPolicy(max_keep=1).doomed(entries, restored_from="e12") == []
    # the restore point goes only once something newer is committed
    assert KeepPolicy(max_keep=1).doomed(entries + [E("c20", 20)], restored_from="e12") == ["c10", "e12"]
    assert KeepPolicy(max_keep=1).doomed([E("x", None)]) == []


# ------------------------------------------------------------------------------- the open protocol
@dataclass(frozen=True)
class OnLossSpike:
    """A user's own policy: nothing in recckpt knows it."""
    losses: dict

    def should_save(self, step, context):
        return self.losses.get(step, 0.0) > 2.0


@dataclass(frozen=True)
class EveryNSecondsByRank0:
    seconds: float
    rank0_decides = True

    def should_save(self, step, context):
        return context.seconds_since_save >= self.seconds


def test_a_users_own_policy_needs_no_change_inside_recckpt():
    s = SaveSchedule([EveryNSteps(10), OnLossSpike({3: 5.0, 4: 0.1, 17: 3.0})], KeepPolicy())
    assert set(decisions(s, 20)) == {3, 10, 17, 20}
    assert not s.needs_agreement


def test_a_users_clock_policy_is_decided_by_rank0():
    s = SaveSchedule([EveryNSecondsByRank0(1.0)], KeepPolicy())
    assert s.needs_agreement
    assert s.decide(1, ctx(5.0), agree=lambda mine: False) is None     # rank 0's clock wins
    assert s.decide(2, ctx(0.0), agree=lambda mine: True) == PERMANENT


def test_any_save_policy_composes_and_carries_rank0_decides():
    any_ = AnySavePolicy([AtSteps([2]), EveryNSteps(5)])
    assert [s for s in range(1, 11) if any_.should_save(s, ctx())] == [2, 5, 10]
    assert not any_.rank0_decides and AnySavePolicy([EveryNSeconds(1), AtSteps([1])]).rank0_decides
    nested = SaveSchedule([AnySavePolicy([AtSteps([3]), EveryNSeconds(100)])], KeepPolicy())
    assert nested.needs_agreement
    assert nested.decide(3, ctx(), agree=lambda mine: mine) == PERMANENT
    assert nested.decide(4, ctx(200.0), agree=lambda mine: False) is None


def test_keep_entries_come_from_manifest_metadata():
    assert CkptEntry.from_metadata("c", {"recckpt.global_step": "12", "recckpt.ephemeral": "1"}) == \
        CkptEntry("c", 12, True)
    assert CkptEntry.from_metadata("x", {}) == CkptEntry("x", None, False)
    assert CkptEntry.from_metadata("y", {"recckpt.global_step": "²"}) == CkptEntry("y", None, False)
    # a Saver.save(step=...) records worker steps only: its step is the newest of them, as a restart ranks it
    assert CkptEntry.from_metadata("w", {}, {0: 7, 1: 9}) == CkptEntry("w", 9, False)


def test_retention_and_prune_keep_the_restore_point_of_saver_steps(tmp_path):
    """Checkpoints saved with Saver.save(step=...) (no manager): a compaction of an older link, committed
    last, holds an older step. Retention (max_keep) and `recckpt prune --keep 1` took such checkpoints as
    stepless and deleted the newest restore point, keeping the older compacted state: a restart rewound.
    Now they rank steps as a restart does (a helper's attack on S3 found it)."""
    import torch

    from recckpt import HashTable, Saver, compact
    from recckpt.cli.main import main as cli

    def run(out, max_keep, incremental):
        m = torch.nn.Module()
        m.t = HashTable("t", dim=4)
        s = Saver(m, output_dir=str(out), max_keep=max_keep)
        m.t(torch.arange(10))
        s.save("a", step=1)
        m.t(torch.arange(10, 20))
        s.save("b", step=2, incremental=incremental)
        return m, s

    m, s = run(tmp_path / "keep2", 2, False)
    compact(str(tmp_path / "keep2" / "a"), str(tmp_path / "keep2" / "a_full"))   # step 1, committed after b
    m.t(torch.arange(20, 30))
    s.save("c", step=3)
    assert s.checkpoints() == ["b", "c"], s.checkpoints()   # not a_full (step 1) over b (step 2)

    m, s = run(tmp_path / "prune", None, True)
    m.t(torch.arange(20, 30))
    s.save("c", step=3)
    compact(str(tmp_path / "prune" / "b"), str(tmp_path / "prune" / "bc"))     # step 2, committed last
    assert cli(["prune", str(tmp_path / "prune"), "--keep", "1"]) == 0
    assert sorted(s.checkpoints()) == ["bc", "c"] and s.latest_checkpoint() == "c", s.checkpoints()


def test_a_manager_restores_the_newest_step_of_a_saver_save_in_its_directory(tmp_path):
    """A job that also saves with Saver.save(step=...) into the manager's directory: its restore ranked only
    the manager's own global steps, so after `recckpt prune --keep 1` (which, as retention, ranks the
    Saver's steps too) it restored a compaction of step 2 over the step-50 checkpoint (a helper's attack)."""
    import torch

    from recckpt import CheckpointManager, HashTable, Saver, compact
    from recckpt.cli.main import main as cli

    def job():
        m = torch.nn.Module()
        m.t = HashTable("t", dim=4)
        s = Saver(m, output_dir=str(tmp_path), max_keep=None)
        return m, s, CheckpointManager(s, save_interval=1, keep=None, save_rng=False)

    m, s, mgr = job()
    for _ in range(3):
        m.t(torch.arange(mgr.global_step * 5, mgr.global_step * 5 + 5))
        mgr.step()                                  # ckpt_1 .. ckpt_3
    m.t(torch.arange(100, 110))
    s.save("w40", step=40)
    m.t(torch.arange(110, 120))
    s.save("w50", step=50, incremental=True)
    compact(str(tmp_path / "ckpt_2"), str(tmp_path / "c2c"))   # step 2, committed last
    _, _, fresh = job()
    assert fresh.restore() == 50 and fresh.restored_from == "w50"
    assert cli(["prune", str(tmp_path), "--keep", "1"]) == 0
    m2, _, fresh = job()
    assert fresh.restore() == 50 and fresh.restored_from == "w50"
    assert sorted(m2.t.ids().tolist()) == sorted(m.t.ids().tolist())


def test_one_signal_and_one_composite_policy_are_taken_as_lists_of_one(tmp_path):
    import signal

    import torch

    from recckpt import CheckpointManager, HashTable, Saver
    assert PreemptionHandler(signals=signal.SIGUSR1).signals == (signal.SIGUSR1,)
    m = torch.nn.Module()
    m.t = HashTable("t", dim=4)
    mgr = CheckpointManager(Saver(m, output_dir=str(tmp_path)), policies=AnySavePolicy([AtSteps([2])]))
    assert [mgr.step() is not None for _ in range(3)] == [False, True, False]
    mgr.close()
