"""Save policies, their composition and validation, and the keep policy as a pure function."""
from __future__ import annotations

import pytest

from recckpt import AtSteps, EphemeralEveryNSteps, EveryNSeconds, EveryNSteps, KeepPolicy
from recckpt.api.policies import EPHEMERAL, PERMANENT, CkptEntry, SaveSchedule


def decisions(schedule, steps, seconds=0.0, agree=None):
    return {s: d for s in range(1, steps + 1) if (d := schedule.decide(s, seconds, agree)) is not None}


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
    assert s.decide(1, 4.9) is None
    assert s.decide(2, 5.0) == PERMANENT
    # rank 0 said no: a worker whose own clock says yes must not save (and vice versa)
    assert s.decide(3, 9.0, agree=lambda mine: False) is None
    assert s.decide(4, 0.0, agree=lambda mine: True) == PERMANENT
    seen = []
    SaveSchedule([EveryNSteps(2)], KeepPolicy()).decide(2, 0.0, agree=lambda m: seen.append(m) or m)
    assert seen == []  # step-based policies need no collective


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
    (lambda: SaveSchedule(["every 10"], KeepPolicy()), "save policy must be"),
])
def test_invalid_policies_fail_at_construction_with_the_reason(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
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
