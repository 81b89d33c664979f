"""Child process of tests/unit/test_storage_locations.py: prune, delete, compact and export into directories
this process cannot write (run without root's permission override); prints one line per tool: the error's
type and message."""
import sys

import recckpt

out = sys.argv[1]
exported = sys.argv[2]
calls = {"prune": lambda: recckpt.prune(output_dir=out, keep=1), "delete": lambda: recckpt.delete(out, ["ckpt_1"]),
         "compact": lambda: recckpt.compact(src=f"{out}/ckpt_2", dst=f"{out}/ckpt_x"),
         "export": lambda: recckpt.export(f"{out}/ckpt_2", exported)}
for name, call in calls.items():
    try:
        call()
        print(name, "OK")
    except Exception as e:  # noqa: BLE001 - the parent checks the type
        print(name, f"{type(e).__module__}.{type(e).__name__}", str(e).replace("\n", " "))
