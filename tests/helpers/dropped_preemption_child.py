"""Child process of tests/unit/test_manager.py: a CheckpointManager(preemption=True) used for a phase and
dropped without close(), then a second one; SIGTERM to the process must save once and end the process
(exit by SIGTERM), not be swallowed by the first manager's handler. Prints "alive" if it is not."""
import gc
import os
import signal
import sys

from helpers.training_child import make_job, train_step

out = sys.argv[1]


def phase(steps):
    model, sopt, dopt, reader, mgr = make_job(out, interval=100, preemption=True)
    mgr.restore()
    for _ in range(steps):
        train_step(model, sopt, dopt, reader)
        mgr.step()
    mgr.wait()
    return model, sopt, dopt, reader, mgr


phase(3)         # dropped without close(), as a per-phase helper function would
gc.collect()
model, sopt, dopt, reader, mgr = phase(0)
os.kill(os.getpid(), signal.SIGTERM)
for _ in range(3):
    train_step(model, sopt, dopt, reader)
    mgr.step()
print("alive", mgr.global_step, flush=True)
