"""One of two processes working on one output directory at once (issue 30 item 6), for `seconds`:

- `versions`: rewrites the version file again and again (catalog.write_version_file: a temporary file,
  then a rename), as every save and retention does;
- `recover`: runs start-up recovery again and again, as every new Saver's first save and `gc` do;
- `saves`: saves with a fresh Saver each time (each runs start-up recovery, then commits and rewrites
  the version file);
- `first_saves`: the same, keeping every checkpoint (no retention: what it races must stay);
- `gc`: `recckpt.gc` again and again.

Creates START_FILE.MODE.ready after its first round. Prints one JSON line: {"done": n, "errors": [...]}.
Stops after SECONDS, or earlier once STOP_FILE exists.
Usage: recovery_rival_child.py MODE URL SECONDS START_FILE [STOP_FILE]"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    mode, url, seconds, start = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    stop = sys.argv[5] if len(sys.argv) > 5 else None
    import torch

    import recckpt
    from helpers.shared_dir_child import Model
    from recckpt import SaveOptions, Saver
    from recckpt.format import catalog, recovery
    from recckpt.storage import open_storage
    storage = open_storage(url)
    while not os.path.exists(start):
        time.sleep(0.005)
    done, errors = 0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop and os.path.exists(stop)):
        try:
            if mode == "versions":
                catalog.write_version_file(storage, ["a", f"v{os.getpid()}_{done}"], fsync=True)
            elif mode == "recover":
                recovery.recover(storage)
            elif mode == "gc":
                recckpt.gc(url)
            elif mode in ("saves", "first_saves"):
                m = Model()
                m.t.set_rows(torch.arange(20), {"embedding": torch.full((20, 8), float(done))})
                Saver(m, output_dir=url, max_keep=2 if mode == "saves" else None,
                      options=SaveOptions(num_buckets=16, fsync=True)).save(f"p{os.getpid()}_{done}")
            else:
                raise ValueError(mode)
            done += 1
            if done == 1:   # looping now: the parent may start what these rivals race against
                open(f"{start}.{mode}.ready", "w").close()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which asserts there are none
            errors.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"done": done, "errors": errors[:20]}), flush=True)


if __name__ == "__main__":
    main()
