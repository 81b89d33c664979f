"""Child process of tests/unit/test_manager.py: SIGTERM must end the process after one preemption
checkpoint (exit by SIGTERM; "alive" printed if it did not), in the orders of managers a training script
uses (argv[2]):
  dropped: a manager with preemption=True used for a phase and dropped without close(), then a second one;
  shared:  one PreemptionHandler given to a new manager per phase, the old one dropped as the name is rebound;
  close:   the signal arrives after the last step, before close();
  two, two-reversed: two live managers of one process (output dirs a/ and b/), stepped in the order they
           were made or the other way round: both must save before the process ends."""
import os
import signal
import sys

from helpers.training_child import make_job, train_step
from recckpt import PreemptionHandler

out, mode = sys.argv[1], sys.argv[2]
shared = PreemptionHandler()


def phase(steps):
    model, sopt, dopt, reader, mgr = make_job(out, interval=100, preemption=shared if mode == "shared" else True)
    mgr.restore()
    for _ in range(steps):
        train_step(model, sopt, dopt, reader)
        mgr.step()
    mgr.wait()
    return model, sopt, dopt, reader, mgr


if mode.startswith("two"):
    a = make_job(os.path.join(out, "a"), interval=100, preemption=True)
    b = make_job(os.path.join(out, "b"), interval=100, preemption=True)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(3):
        for model, sopt, dopt, reader, mgr in ((b, a) if mode == "two-reversed" else (a, b)):
            train_step(model, sopt, dopt, reader)
            mgr.step()
    print("alive", a[4].global_step, b[4].global_step, flush=True)
    sys.exit(0)
job = phase(3)          # dropped without close(), as a per-phase helper function would
job = phase(0)          # (rebinding the name frees the first manager)
model, sopt, dopt, reader, mgr = job
if mode == "close":
    train_step(model, sopt, dopt, reader)
    mgr.step()
    os.kill(os.getpid(), signal.SIGTERM)   # after the last step: no step() serves it
    mgr.close()
else:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(3):
        train_step(model, sopt, dopt, reader)
        mgr.step()
print("alive", mgr.global_step, flush=True)
