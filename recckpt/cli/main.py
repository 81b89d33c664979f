"""Argument parsing, the verbs, exit codes and error reporting of the `recckpt` command.

Exit codes: 0 ok; 1 a problem found (corrupt or missing checkpoint, differences for `diff`, a failed
operation); 2 usage (unknown verb or option, an option value that cannot be valid). Errors are one line
on stderr naming the file or option; `--debug` shows the traceback instead."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import recckpt
from recckpt.errors import InvalidArgumentError, InvalidCheckpointIdError, RecckptError
from recckpt.tools.reader import lookup_ids, unless_damaged

from . import render

log = logging.getLogger("recckpt")
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
#: What a shell reports for a command killed by SIGTERM / SIGPIPE (128 + the signal), which the command
#: instead turns into a clean stop.
EXIT_TERMINATED, EXIT_BROKEN_PIPE = 128 + signal.SIGTERM, 128 + signal.SIGPIPE


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _storage_options(text: str) -> dict:
    """--storage-options: a JSON object of fsspec keywords (s3fs: endpoint_url, key, secret, profile, ...)."""
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"endpoint_url\": \"http://127.0.0.1:9000\"}}': {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of fsspec keywords, got {type(v).__name__}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _progress(total: int, what: str, enabled: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr when it is a terminal (and not --json); else nothing."""
    if not enabled or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm
    bar = tqdm(total=total, unit="rows", unit_scale=True, desc=what, file=sys.stderr, leave=False)
    return bar.update, bar.close


# ---------------------------------------------------------------------------------------------- verbs
def cmd_ls(a) -> int:
    listing = recckpt.list_checkpoints(a.output_dir, a.storage_options, check=a.check)
    # A listing exits 0 whatever it lists; `--check` is a health check: what cannot be loaded fails it
    verdict = EXIT_PROBLEM if a.check and (listing.damaged or listing.broken) else EXIT_OK
    if a.json:
        print(render.dumps(listing))
        return verdict
    rows = [[c.ckpt_id, "-" if c.step is None else str(c.step), c.kind, render.human_bytes(c.size_bytes),
             c.created.strftime("%Y-%m-%d %H:%M:%S UTC")] for c in listing.checkpoints]
    print(f"{listing.output_dir}: {len(listing.checkpoints)} committed checkpoint(s), oldest first")
    if rows:
        print(render.table(rows, ["ID", "STEP", "KIND", "SIZE", "CREATED"]))
    for name, what in listing.leftovers:
        print(f"leftover: {name} (left by {what}; `recckpt gc` removes it)")
    for name, why in listing.strays:
        print(f"stray: {name} ({why})")
    for name, why in listing.damaged:
        print(f"damaged: {name} (its manifest does not verify: {why}; never loaded; "
              f"recckpt.delete(output_dir, [{name!r}]) frees its id)")
    for name, why in listing.broken:
        print(f"broken: {name} (cannot be loaded: {why})")
    for name, what in listing.unfound:
        print(f"unfound: {name} (the version file lists it, but it is {what}: not a checkpoint; "
              f"`recckpt gc` rewrites the version file)")
    if listing.output_dirs_below:
        print("output directories below it (pass one of these):")
        for d in listing.output_dirs_below:
            print(f"  {listing.output_dir.rstrip('/')}/{d}")
    return verdict


def _inspect_doc(view, objects: bool, damaged: list[str] | None = None) -> dict:
    """What inspect shows. With `damaged` (what `files_problems` found), a part that cannot be read for that
    damage is left out and its error joins the list, instead of failing the whole report."""
    doc = {"path": view.path, "ckpt_id": view.ckpt_id, "step": view.step, "kind": view.kind,
           "created": view.created, "workers": view.workers, "num_buckets": view.num_buckets,
           "format_version": view.format_version, "parent": view.parent, "links": list(view.links),
           "writer": view.writer,
           "size_bytes": unless_damaged(damaged, lambda: view.size_bytes, None), "metadata": dict(view.metadata),
           "tables": unless_damaged(damaged, lambda: {t.name: {"rows": t.rows,
                                            "slots": {s.name: {"dtype": s.dtype, "shape": list(s.shape),
                                                               "category": s.category}
                                                      for s in t.slots.values()}}
                                   for t in view.tables.values()}, {}),
           "dense": unless_damaged(damaged, lambda: {d.key: {"dtype": d.dtype, "shape": list(d.shape)} for d in view.dense.values()},
                         {})}
    if objects:
        tree = view.objects(arrays=True)   # numpy arrays: inspect does not import torch
        doc["objects"] = {n: {"kind": e["kind"], "state": render.summary(e["state"])}
                          for n, e in tree["objects"].items()}
        doc["sparse_optimizer"] = render.summary(tree["sparse_optimizer"])
        doc["io_state"] = {w: render.summary(view.io_state(w, arrays=True)) for w in view.io_state_workers}
    else:   # not read (--no-objects, or a damaged checkpoint): the same keys, null, for one JSON shape
        doc.update(objects=None, sparse_optimizer=None, io_state=None)
    return doc


def cmd_inspect(a) -> int:
    view = recckpt.open(a.ckpt, a.storage_options)
    damaged = view.files_problems()   # what a load would meet, said here rather than there
    doc = _inspect_doc(view, objects=not a.no_objects and not damaged, damaged=damaged)
    doc["damaged"] = damaged
    status = EXIT_PROBLEM if damaged else EXIT_OK
    if a.json:
        print(render.dumps(doc))
        return status
    print(f"{doc['path']}")
    for problem in damaged:
        print(f"! damaged: {problem}")
    if damaged:
        print(f"! it cannot be loaded; `recckpt verify {doc['path']}` checks every byte (objects not shown)")
    size = "size unknown" if doc["size_bytes"] is None else render.human_bytes(doc["size_bytes"])
    print(f"  id {view.ckpt_id}, step {'-' if view.step is None else view.step}, {view.kind}, "
          f"created {view.created:%Y-%m-%d %H:%M:%S UTC}, {size}")
    print(f"  {view.workers} worker(s), {view.num_buckets} buckets, format version {view.format_version}, "
          f"written by {view.writer}" + (f", parent {view.parent}" if view.parent else ""))
    if len(view.links) > 1:   # rows below are the folded state of the whole chain
        shown = ("tables show the folded state" if doc["tables"] or not damaged else
                 "tables not shown: their folded state needs the damaged files")
        print(f"  {shown} of its chain of {len(view.links)} links: {' <- '.join(view.links)}")
    if doc["tables"]:
        rows = [[t, str(info["rows"]), s, d["dtype"], str(tuple(d["shape"])), d["category"]]
                for t, info in doc["tables"].items() for s, d in info["slots"].items()]
        print("sparse tables:")
        print(render.table(rows, ["TABLE", "ROWS", "SLOT", "DTYPE", "ROW SHAPE", "CATEGORY"]))
    if doc["dense"]:
        print("dense:")
        print(render.table([[k, d["dtype"], str(tuple(d["shape"]))] for k, d in doc["dense"].items()],
                           ["KEY", "DTYPE", "SHAPE"]))
    if doc["objects"] is not None:
        print("registered objects:" if doc["objects"] else "registered objects: none")
        for n, e in doc["objects"].items():
            print(f"  {n} ({e['kind']}): {render.compact(e['state'])}")
        if doc["sparse_optimizer"] is not None:
            print(f"  sparse optimizer: {render.compact(doc['sparse_optimizer'])}")
        for w, s in doc["io_state"].items():
            print(f"io state, worker {w}: {render.compact(s)}")
    return status


def cmd_verify(a) -> int:
    reports, status = [], EXIT_OK
    for path in a.ckpts:
        try:
            rep = recckpt.verify(path, storage_options=a.storage_options)
            ok, text, doc = rep.ok, str(rep), rep
        except RecckptError as e:  # not a checkpoint at all: a problem with this argument, keep going
            ok, text, doc = False, f"{path}: {e}", {"path": path, "problems": [str(e)]}
        status = status if ok else EXIT_PROBLEM
        reports.append(doc)
        if not a.json:
            print(text)
    if a.json:
        print(render.dumps(reports))
    return status


def cmd_diff(a) -> int:
    r = recckpt.diff(a.a, a.b, values=a.values, storage_options=a.storage_options)
    if a.json:
        print(render.dumps({"same": r.same, "differs": r.differs, **render.to_jsonable(r)}))
        return EXIT_OK if r.same else EXIT_PROBLEM
    print(f"--- {r.a}\n+++ {r.b}")
    for side, problems in r.damaged.items():
        print(f"! {side.upper()} is damaged: " + "; ".join(problems)
              + f" (it cannot be loaded; run `recckpt verify {r.a if side == 'a' else r.b}`)")
    for f, (x, y) in r.metadata.items():
        print(f"~ {f}: {x} -> {y}")
    if r.layout:
        print("  layout (not a difference of contents): "
              + ", ".join(f"{f} {x} -> {y}" for f, (x, y) in r.layout.items()))
    for what, d in (("table", r.tables), ("dense key", r.dense), ("object", r.objects), ("IO state of", r.io_state)):
        for sign, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
            for n in d[key]:
                print(f"{sign} {what} {n}")
    if r.sparse_optimizer is not None:
        print(f"{dict(added='+', removed='-', changed='~')[r.sparse_optimizer]} sparse optimizer state")
    for t, d in r.slots.items():
        for sign, key in (("+", "added"), ("-", "removed"), ("~", "changed")):
            for n in d[key]:
                print(f"{sign} slot {t}.{n}")
    for t, what in r.contents.items():
        if "ids" in what:
            ra, rb = r.rows[t]
            print(f"~ rows of {t}: the ids differ ({ra} -> {rb} rows)")
        for n in what:
            if n != "ids":
                print(f"~ slot {t}.{n}: rows differ")
    for t, what in r.digests_disagree.items():
        print(f"! rows of {t}: equal by value, but the content digests the manifests record differ "
              f"({', '.join(what)}): one of the manifests records a wrong digest, so a diff without --values "
              f"calls these rows different")
    for t, why in r.not_compared.items():
        print(f"? rows of {t}: not comparable without --values ({why})"
              + ("; compared by value below" if r.values is not None else ""))
    for t, v in (r.values or {}).items():
        print(f"rows of {t}: {v.common} in both, {v.only_b} added, {v.only_a} removed, {v.changed_rows} changed")
        for s, sv in v.slots.items():
            if sv.changed_rows:
                print(f"  {s}: {sv.changed_rows} rows changed, largest absolute difference {sv.max_abs_diff:g}")
    print("no differences" if r.same else "checkpoints differ" if r.differs else
          "no differences recorded, but a checkpoint is damaged (marked !)" if r.damaged else
          "no differences in the rows, but the recorded digests disagree (marked !)" if r.digests_disagree else
          "no differences found, but the rows marked ? could not be compared without --values")
    return EXIT_OK if r.same else EXIT_PROBLEM


def cmd_export(a) -> int:
    opts = recckpt.ExportOptions(format=a.format, tables=a.tables, slots=tuple(a.slots), dtype=a.dtype,
                                 shard_rows=a.shard_rows, min_freq=a.min_freq,
                                 seen_since_step=a.seen_since_step, chunk_rows=a.chunk_rows)
    view = recckpt.open(a.ckpt, a.storage_options)
    total = sum(t.rows for n, t in view.tables.items() if a.tables is None or n in a.tables)
    update, close = _progress(total, "export", not a.json)
    try:
        res = recckpt.export(view, a.out, opts, progress=update)
    finally:
        close()
    if a.json:
        print(render.dumps(res))
    else:
        for t, d in res.tables.items():
            print(f"{t}: {d['rows']} rows in {len(d['files'])} file(s)")
        print(f"exported {res.rows} rows to {res.out_dir} as {a.format} ({a.dtype}) in {res.seconds:.2f}s")
    return EXIT_OK


def _ids_of(a) -> list[int]:
    """The ids given on the command line, then --ids-file's whitespace-separated integers."""
    ids = list(a.ids)
    if a.ids_file is not None:
        try:
            with open(a.ids_file) as f:
                words = f.read().split()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"--ids-file {a.ids_file}: cannot read it ({type(e).__name__}: {e}); give a "
                                       f"text file of whitespace-separated integer ids") from None
        if not words and not ids:
            raise InvalidArgumentError(f"lookup: --ids-file {a.ids_file} holds no ids; give ids in it or after the "
                                       f"table name")
        for k, word in enumerate(words):
            try:
                ids.append(int(word))
            except ValueError:
                raise InvalidArgumentError(f"--ids-file {a.ids_file}: word {k + 1} ({word[:40]!r}) is not an "
                                           f"integer id") from None
    if not ids:
        raise InvalidArgumentError("lookup: give ids after the table name, or --ids-file")
    return ids


def _row_text(row) -> str:
    """One slot of one row on one line (numpy's form, long rows shortened)."""
    import numpy as np
    return np.array2string(np.asarray(row), separator=", ", threshold=64, max_line_width=1 << 30)


def cmd_lookup(a) -> int:
    import numpy as np
    ids = lookup_ids(_ids_of(a))   # checked before the store is opened
    view = recckpt.open(a.ckpt, a.storage_options)
    found, rows = view.lookup(a.table, ids, a.slots)
    if a.json:
        print(render.dumps({"table": a.table, "rows": [
            {"id": int(i), "found": bool(f), "slots": {s: rows[s][k].tolist() for s in rows} if f else None}
            for k, (i, f) in enumerate(zip(ids, found))]}))
    else:
        for k, (i, f) in enumerate(zip(ids, found)):
            if not f:
                print(f"{i}: not in the checkpoint")
                continue
            print(f"{i}: " + "  ".join(f"{s}={_row_text(rows[s][k])}" for s in rows))
    return EXIT_OK if bool(np.all(found)) else EXIT_PROBLEM


def cmd_prune(a) -> int:
    gone = recckpt.prune(a.output_dir, a.keep, dry_run=a.dry_run,
                         storage_options=a.storage_options)
    if a.json:
        print(render.dumps({"deleted" if not a.dry_run else "would_delete": gone}))
    else:
        verb = "would delete" if a.dry_run else "deleted"
        print("\n".join(f"{verb} {c}" for c in gone) if gone else "nothing to prune")
    return EXIT_OK


def cmd_gc(a) -> int:
    found = recckpt.gc(a.output_dir, dry_run=a.dry_run, storage_options=a.storage_options)
    if a.json:
        print(render.dumps({"removed" if not a.dry_run else "would_remove":
                            [{"name": n, "left_by": w} for n, w in found]}))
    else:
        verb = "would remove" if a.dry_run else "removed"
        print("\n".join(f"{verb} {n} (left by {w})" for n, w in found) if found else "no leftovers")
    return EXIT_OK


def cmd_compact(a) -> int:
    res = recckpt.compact(a.src, a.dst, memory_bytes=a.memory_mb << 20,
                          storage_options=a.storage_options)
    if a.json:
        print(render.dumps({"src": res.src, "dst": res.dst, "links": res.links, "rows": res.rows,
                            "seconds": res.seconds}))
    else:
        print(f"compacted {res.src} ({res.links} link(s)) into {res.dst}: {res.rows} rows in {res.seconds:.2f}s")
    return EXIT_OK


# --------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    common.add_argument("-v", "--verbose", action="store_true", help="log what is done (INFO)")
    common.add_argument("--storage-options", type=_storage_options, default=None, metavar="JSON",
                        help="fsspec keywords for s3://... and other URLs, as a JSON object (s3fs: endpoint_url, "
                             "key, secret, profile, client_kwargs); without it, the store's own configuration "
                             "(AWS_* variables, ~/.aws, FSSPEC_S3)")
    common.add_argument("--storage-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                        help="bound on each object-store operation (a request with its retries; default 300): a "
                             "frozen endpoint fails the command within about this")
    p = _Parser(prog="recckpt", description="Look inside recckpt checkpoints and get embeddings out.",
                epilog="exit codes: 0 ok, 1 a problem found (or differences, for diff), 2 usage")
    p.add_argument("--version", action="version", version=f"recckpt {recckpt.__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True

    def verb(name, fn, help_):
        sp = sub.add_parser(name, parents=[common], help=help_, description=help_)
        sp.set_defaults(fn=fn)
        return sp

    sp = verb("ls", cmd_ls, "list the committed checkpoints of an output directory and leftovers of crashed saves")
    sp.add_argument("output_dir", metavar="OUTPUT_DIR")
    sp.add_argument("--check", action="store_true",
                    help="read every checkpoint's manifest instead of trusting the catalog (on an object store, a "
                         "request a checkpoint): a manifest deleted by hand then shows as unfound")
    sp = verb("inspect", cmd_inspect, "show one checkpoint: metadata, tables and slots, dense keys, objects, IO state")
    sp.add_argument("ckpt", metavar="CKPT")
    sp.add_argument("--no-objects", action="store_true", help="skip registered objects and IO state")
    sp = verb("verify", cmd_verify, "check every byte of one or more checkpoints (exit 1 naming the file on failure)")
    sp.add_argument("ckpts", metavar="CKPT", nargs="+")
    sp = verb("diff", cmd_diff, "tables, slots, dense keys and objects added, removed or changed between A and B, "
                                "rows compared by the content digests the checkpoints record (exit 1 when they "
                                "differ or could not be compared)")
    sp.add_argument("a", metavar="A")
    sp.add_argument("b", metavar="B")
    sp.add_argument("--values", action="store_true",
                    help="also compare rows: ids added/removed, rows changed, largest absolute difference per slot")
    sp = verb("export", cmd_export, "write embedding rows (with their ids) to Parquet, safetensors or .npy files")
    sp.add_argument("ckpt", metavar="CKPT")
    sp.add_argument("--out", required=True, metavar="DIR", help="a new or empty local directory")
    sp.add_argument("--format", default="parquet", choices=["parquet", "safetensors", "npy"])
    sp.add_argument("--tables", type=_names, default=None, help="comma-separated tables (default: all)")
    sp.add_argument("--slots", type=_names, default=["embedding"], help="comma-separated slots (default: embedding)")
    sp.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16", "int8"],
                    help="value type of float slots; int8: row-wise with per-row scale and offset")
    sp.add_argument("--shard-rows", type=_positive, default=None, help="at most N rows per output file")
    sp.add_argument("--min-freq", type=int, default=None, help="only rows whose 'freq' counter is >= N")
    sp.add_argument("--seen-since-step", type=int, default=None,
                    help="only rows whose 'last_step' counter is >= STEP")
    sp.add_argument("--chunk-rows", type=_positive, default=65536, help="rows read at a time (memory bound)")
    sp = verb("lookup", cmd_lookup, "print the rows of given ids of one table (reading only the buckets they fall "
                                    "in; exit 1 when an id is not in the checkpoint)")
    sp.add_argument("ckpt", metavar="CKPT")
    sp.add_argument("table", metavar="TABLE")
    sp.add_argument("ids", metavar="ID", nargs="*", type=int, help="ids, right after TABLE (negative ones too)")
    sp.add_argument("--ids-file", default=None, metavar="PATH", help="more ids, whitespace-separated, from a file")
    sp.add_argument("--slots", type=_names, default=None, help="comma-separated slots (default: all)")
    sp = verb("prune", cmd_prune, "delete all but the newest N regular checkpoints of an output directory")
    sp.add_argument("output_dir", metavar="OUTPUT_DIR")
    sp.add_argument("--keep", type=_positive, required=True, metavar="N")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    sp = verb("compact", cmd_compact, "fold a chain of incremental checkpoints (SRC, any link) into one full "
                                      "checkpoint DST (<output_dir>/<new_id>), committed like a save")
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--memory-mb", type=_positive, default=256, help="rows held at a time (default 256 MiB)")
    sp = verb("gc", cmd_gc, "remove leftovers of crashed saves and deletes from an output directory")
    sp.add_argument("output_dir", metavar="OUTPUT_DIR")
    sp.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    return p


def _os_error_line(e: OSError) -> str:
    where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
    why = e.strerror or str(e)
    return f"{where}: {why}; check that the path exists and each part of it is what it should be (a directory " \
           f"you can write, for an output)"


class Terminated(BaseException):
    """SIGTERM arrived (`timeout`, Kubernetes, Slurm): raised in the main thread so that what a command
    cleans up on an error (an export's partial output) is cleaned up, as on Ctrl-C."""


#: Set by the SIGTERM handler: C code that calls back into Python (numpy writing a file) may turn the
#: `Terminated` raised there into an error of its own, which must still end the command as terminated.
_sigterm_seen = threading.Event()


@contextlib.contextmanager
def _sigterm_as_exception():
    """SIGTERM raises `Terminated` while a command runs, unless the process already handles SIGTERM. The
    first one only: later ones are ignored while the command cleans up, and `_terminate` then ends the
    process by the signal, as it would have ended without this."""
    _sigterm_seen.clear()   # (a flag left by an earlier in-process main() is not this command's)
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _sigterm_seen.set()
        raise Terminated()
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _terminate() -> None:
    """End this process by SIGTERM (its handler is the default again): the caller of an in-process
    `main()` is stopped as the signal asked, and a shell sees a command killed by SIGTERM (status 143)."""
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()   # the signal is delivered on return to the interpreter loop at the latest


@contextlib.contextmanager
def _storage_timeout(seconds: float | None):
    """--storage-timeout: the bound of every store this command opens."""
    from ..storage import fsspec_store
    if seconds is None:
        yield
        return
    before, fsspec_store.DEFAULT_TIMEOUT_S = fsspec_store.DEFAULT_TIMEOUT_S, seconds
    try:
        yield
    finally:
        fsspec_store.DEFAULT_TIMEOUT_S = before


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    try:
        with _sigterm_as_exception(), _storage_timeout(args.storage_timeout):
            code = args.fn(args)
            sys.stdout.flush()   # here, where a reader gone away is caught, not at the interpreter's exit
            if _sigterm_seen.is_set():   # Terminated raised where something swallowed it (a __del__)
                raise Terminated()
            return code
    except KeyboardInterrupt:
        print("recckpt: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("recckpt: terminated (SIGTERM); what the command had written is cleaned up", file=sys.stderr)
        _terminate()
        return EXIT_TERMINATED   # not reached: the signal ends the process
    except BrokenPipeError:
        if args.debug:
            raise
        # the reader of the output went away (`recckpt inspect CK | head`): nothing is left to tell it, and
        # the interpreter's own flush at exit must not fail again
        with contextlib.suppress(OSError, ValueError):
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        return EXIT_BROKEN_PIPE
    except Exception as e:
        if _sigterm_seen.is_set():   # the Terminated raised by the handler, turned into another error on its way
            print(f"recckpt: terminated (SIGTERM); what the command had written is cleaned up ({type(e).__name__} "
                  f"on the way out)", file=sys.stderr)
            _terminate()
            return EXIT_TERMINATED
        if args.debug:
            raise
        # (a checkpoint id the user gave that no checkpoint can have, compact's DST: an option that cannot be valid)
        code = EXIT_USAGE if isinstance(e, (InvalidArgumentError, InvalidCheckpointIdError)) else EXIT_PROBLEM
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, RecckptError) and e.filename is not None:
            # the system refused a path the user gave (a link loop, a missing parent, a file where a
            # directory should be): name it and the reason, as recckpt's own errors do
            text = _os_error_line(e)
        elif not isinstance(e, RecckptError):  # unexpected: say its kind, since the message may not
            text = f"{type(e).__name__}: {text} (run with --debug for the traceback)"
        print(f"recckpt {args.verb}: error: {text}", file=sys.stderr)
        return code
