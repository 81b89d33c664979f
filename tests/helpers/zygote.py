"""A process that imports torch, TorchRec and recckpt once, then forks a fresh child for each script the
TorchRec tests run (tests/torchrec_tests/harness.py `run_script`).

Each of those scripts used to start in a new interpreter whose ranks imported TorchRec again: about 7 s of
CPU per rank, most of a small job's run time, and the biggest share of the suite's time on a 2-core CI
machine. A forked child starts with the imports done; its ranks are forked from it in turn
(`rank_procs.START_METHOD`). The ranks are still separate processes on gloo, each with its own address
space; only the import work is shared. Fork is safe here because this process starts no process group
and runs no operator: it only imports. (Importing numpy starts OpenBLAS's worker threads; OpenBLAS
stops them around a fork itself.)

Protocol, one JSON object per line. The harness writes a request to stdin:
    {"script": path | null, "code": str | null, "argv": [...], "cwd": dir, "env": {the whole environment},
     "stdout": path, "stderr": path}
and reads two replies from stdout: {"pid": child} when the child is forked (the child leads a process group
of its own, so that a harness that times out can kill it and its ranks), then {"rc": exit status}. End of
stdin (the harness exited) ends this process."""
from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import rank_procs  # noqa: E402  (this directory is sys.path[0] when run as a script)


def _preload() -> None:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch  # noqa: F401
        import torchrec  # noqa: F401
        import torchrec.distributed  # noqa: F401

        import recckpt  # noqa: F401
        import recckpt.integrations.torchrec  # noqa: F401


def _child(req: dict, reply_fd: int) -> None:
    """In the forked child: run the request's script or code as __main__, exit with its status."""
    os.setpgrp()
    os.close(reply_fd)   # the replies are the zygote's alone
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)   # the request pipe stays the zygote's alone
    os.close(null)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    rank_procs.START_METHOD = "fork"   # the ranks start from these imports too
    rc = 0
    try:
        if req.get("script"):
            sys.argv = [req["script"], *req["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
            runpy.run_path(req["script"], run_name="__main__")
        else:
            sys.argv = ["-c", *req["argv"]]
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> None:
    # Replies go to the harness through the original stdout alone: whatever the imports (or a child
    # before its redirection) print on fd 1 lands in the zygote's log instead.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload()
    sys.stdout.flush()   # nothing the imports printed is left in a buffer the children would inherit
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, reply.fileno())   # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
