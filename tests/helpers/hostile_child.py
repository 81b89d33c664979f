"""Child process of the hostile corpus (helpers/hostile.py): runs one action on an attacked output
directory and prints `RESULT <json>`: the error class that escaped (or null), its message and path,
the seconds the action took and how much the peak RSS grew during it."""
from __future__ import annotations

import gc
import json
import logging
import sys
import time
import warnings


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(case):
    from helpers import stress_harness as h
    m, e, r = h.Model(), {}, h.Reader()
    return h.make_saver(case["out_dir"], m, e, r, max_keep=None), m, e, r


def _run(case, detail: dict) -> None:
    """Run the action, recording what it saw in `detail` (kept when it raises)."""
    import os

    import recckpt
    from helpers import stress_harness as h
    action = case["action"]
    if action in ("load", "load_id", "load_id_mmap", "listing"):
        s, m, e, r = _model(case)
        s.load(ckpt_id=case["ckpt_id"] if action.startswith("load_id") else None,
               load_conf={"mmap": True} if action.endswith("_mmap") else None)
        detail["step"] = e.get("step")
        if action == "listing":
            # The rest of what lists the directory keeps working: verify of what is listed, a new save.
            detail["listed"] = s.checkpoints()
            for cid in detail["listed"]:
                recckpt.verify(os.path.join(case["out_dir"], cid)).raise_if_failed()
            h.set_step_state(m, e, r, 9)
            s.save("after")
            detail["after"] = "after" in s.checkpoints()
            if not detail["after"]:
                raise AssertionError("the save after the attack is not listed")
    elif action == "inspect":
        from recckpt.cli.main import _inspect_doc
        _inspect_doc(recckpt.open(os.path.join(case["out_dir"], case["ckpt_id"])), objects=True)
    elif action == "verify":
        rep = recckpt.verify(os.path.join(case["out_dir"], case["ckpt_id"]))
        detail["problems"] = rep.problems
        detail["unlisted"] = rep.unlisted
        rep.raise_if_failed()
    else:
        raise ValueError(f"unknown action {action!r}")


def main() -> None:
    case = json.loads(sys.argv[1])
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    import recckpt  # noqa: F401 - imported before the baseline is taken
    from helpers import stress_harness  # noqa: F401
    # A case bounded against json.loads runs the baseline and its action alternately, 3 times each, in
    # this one process, and compares the best of each: the machine is shared and single runs swing, and
    # alternating gives both the same warm allocator and page cache.
    ratio = case.get("json_ratio") is not None
    rounds = 3 if ratio else 1
    raw = None
    if ratio:
        import os
        with open(os.path.join(case["out_dir"], case["ckpt_id"], "index.json"), "rb") as f:
            raw = f.read()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset the peak RSS (VmHWM) to the current RSS
    base = _rss_bytes("VmRSS")
    seconds = best_json = float("inf")
    rss_growth = 0
    for _ in range(rounds):
        gc.collect()   # what an earlier round left in reference cycles is not this round's memory
        if raw is not None:
            t1 = time.perf_counter()
            json.loads(raw)
            best_json = min(best_json, time.perf_counter() - t1)
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # the action's peak RSS, not the baseline's
        t0 = time.perf_counter()
        err, msg, path, detail = None, "", None, {}
        try:
            _run(case, detail)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts the exact class
            err, msg, path = type(e).__name__, str(e), getattr(e, "path", None)
        seconds = min(seconds, time.perf_counter() - t0)
        rss_growth = max(rss_growth, _rss_bytes("VmHWM") - base)
    if ratio:
        detail["json_loads_seconds"] = best_json
    out = {"error": err, "message": msg[:4000], "path": path, "seconds": seconds,
           "rss_growth": rss_growth, "detail": detail}
    print("RESULT " + json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()
