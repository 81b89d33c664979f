"""Child process of tests/unit/test_storage_locations.py: prune, delete, gc and compact on an output directory
this process cannot write (run without root's permission override); prints one line per tool: the error's
type and message."""
import sys

import recckpt

out = sys.argv[1]
calls = {"prune": lambda: recckpt.prune(out, keep=1), "delete": lambda: recckpt.delete(out, ["ckpt_1"]),
         "compact": lambda: recckpt.compact(f"{out}/ckpt_2", f"{out}/ckpt_x")}
for name, call in calls.items():
    try:
        call()
        print(name, "OK")
    except Exception as e:  # noqa: BLE001 - the parent checks the type
        print(name, f"{type(e).__module__}.{type(e).__name__}", str(e).replace("\n", " "))
