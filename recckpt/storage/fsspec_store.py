"""Any fsspec filesystem: object stores (s3://, gs://, ...), memory://, ...

Commit protocol (object stores have no directories and no atomic rename): a save writes its files
straight under their final keys `<ckpt_id>/...`, and the manifest, written last and only if absent, is
the commit; nothing is copied. A delete removes the manifest first (the checkpoint is then absent to
every reader), then the data. A writer holds a lease object (`claim`) that it rewrites every
`lease_s / 3` seconds; recovery removes a manifest-less `<ckpt_id>/` only when no fresh lease covers it.

IO: shard files are written locally by the engine and uploaded concurrently (multipart where large),
in the background while the rest of a worker's files are written (`background_uploads`). A load that
needs (nearly) all of a shard file downloads it whole, one GET per file, all concurrently (`download`,
called by the format layer's SegmentReader.fetch_whole_files); other reads are exact byte ranges
(`cat_ranges`, no read-ahead), issued concurrently. Small files are read in one request, a range one
byte past the size the caller expects (no HEAD first). Every remote call runs
under `timeout_s` and the client's retries with backoff; a failure is a StorageError naming the object
and the operation. Listings are never cached, so other processes' commits are seen.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import shutil
import tempfile
import threading
import warnings

from ..errors import CheckpointExistsError, ConcurrentCommitError, StorageError
from . import claims
from .base import Claim, Storage

log = logging.getLogger("recckpt")

#: Defaults for s3fs that bound every request (botocore's own retries stay few: s3fs retries transient
#: errors with backoff on top of them) and turn off its listing cache.
_S3_DEFAULTS = {"use_listings_cache": False,
                "config_kwargs": {"connect_timeout": 10, "read_timeout": 60,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}


def _merged_options(protocol: str, options: dict | None) -> dict:
    # A deep copy: botocore rewrites the `retries` dict it is given in place, which would change the
    # defaults above (and the caller's options), so that fsspec's cache of filesystems keyed by these
    # options missed on every later open and each one paid a new client's start-up.
    out = copy.deepcopy(dict(options or {}))
    if protocol in ("s3", "s3a"):
        for k, v in _S3_DEFAULTS.items():
            if k == "config_kwargs":
                # fsspec's own configuration (FSSPEC_S3, ~/.config/fsspec) fills in keywords not passed, but
                # only whole: without this, the defaults here would replace a configured config_kwargs
                # (timeouts, retries, addressing style) instead of filling in around it.
                from fsspec.config import conf
                configured = {}
                for proto in ("s3", "s3a"):   # s3fs answers to both: fsspec applies the config of each
                    configured.update((conf.get(proto) or {}).get(k) or {})
                out[k] = {**copy.deepcopy(v), **copy.deepcopy(configured), **(out.get(k) or {})}
            else:
                out.setdefault(k, copy.deepcopy(v))
        # recckpt reads and lists the current version of every object. A version-aware s3fs lists prefixes
        # that hold only deleted versions, so each checkpoint retention deleted came back as a leftover that
        # gc could never remove: the option is turned off (also where fsspec's configuration sets it).
        if out.get("version_aware"):
            log.info("recckpt: storage option version_aware=True is not used: checkpoints are read and listed by "
                     "their current versions")
        out["version_aware"] = False
    return out


class _Lease(Claim):
    """A lease object rewritten by a heartbeat until released."""

    def __init__(self, store: "FsspecStorage", owner: str, body: dict):
        self.store, self.owner = store, owner
        self._beat = claims.Heartbeat(lambda b: store.put_bytes(owner, claims.encode(b)), body, store.lease_s,
                                      owner)

    def release(self):
        self._beat.stop()
        with contextlib.suppress(OSError):
            self.store.remove_file(self.owner)


class _BackgroundUpload:
    """One `upload` running in a thread of its own; removes the local directory `tmp` when done."""

    def __init__(self, store: "FsspecStorage", pairs: list[tuple[str, str]], tmp: str):
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(store, pairs, tmp), daemon=True,
                                        name="recckpt-upload")
        self._thread.start()

    def _run(self, store, pairs, tmp):
        try:
            store.upload(pairs)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self.error = e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self.error


#: The bound on one remote operation of a store opened without `timeout_s` (the reader, the tools; a Saver
#: passes SaveOptions.storage_timeout_s). The command line's --storage-timeout sets it for one command.
DEFAULT_TIMEOUT_S = 300.0


class FsspecStorage(Storage):
    def __init__(self, url: str, storage_options: dict | None = None, *, timeout_s: float | None = None,
                 lease_s: float = claims.LEASE_S):
        import fsspec
        protocol = url.split("://", 1)[0]
        self.fs, root = fsspec.core.url_to_fs(url, **_merged_options(protocol, storage_options))
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.timeout_s, self.lease_s = timeout_s, lease_s
        self._uploads = threading.local()   # .pending: this thread's background uploads, in a block
        self._kw = {"timeout": timeout_s} if getattr(self.fs, "async_impl", False) else {}
        super().__init__(root.rstrip("/") or "/")
        from fsspec.implementations.local import LocalFileSystem
        #: True for fsspec's local filesystem under any protocol name (open_storage uses LocalStorage then).
        self.reaches_local_disk = isinstance(self.fs, LocalFileSystem)

    def describe(self, path=""):
        return f"{self.protocol}://{self._p(path)}"

    def _p(self, path):
        return f"{self.root.rstrip('/')}/{path}" if path else self.root

    def _call(self, what: str, path: str, fn, *args, **kwargs):
        """One remote operation, bounded by timeout_s; its failure becomes a StorageError naming the
        object and the operation (FileNotFoundError and FileExistsError pass: callers expect them)."""
        try:
            return fn(*args, **self._kw, **kwargs)
        except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
            raise
        except Exception as e:
            from fsspec.exceptions import FSTimeoutError
            if isinstance(e, (FSTimeoutError, TimeoutError)):
                raise StorageError(errno.ETIMEDOUT, f"{what} {self.describe(path)} did not finish within "
                                                    f"{self.timeout_s:g} s (SaveOptions.storage_timeout_s); "
                                                    f"the endpoint is down or frozen",
                                   self.describe(path)) from e
            code = (errno.EACCES if isinstance(e, PermissionError) else
                    e.errno if isinstance(e, OSError) and e.errno else errno.EIO)
            no_credentials = type(e).__name__ == "NoCredentialsError"   # botocore's, without importing it
            hint = (" Check the credentials and the permissions on the bucket (storage_options)."
                    if code in (errno.EACCES, errno.EPERM) else
                    " Give credentials in storage_options (key, secret), the environment (AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY) or an AWS profile; anon=True for a public bucket."
                    if no_credentials else "")
            raise StorageError(code, f"{what} {self.describe(path)} failed: {type(e).__name__}: {e}.{hint}",
                               self.describe(path)) from e

    def put_bytes(self, path: str, data: bytes, exclusive: bool = False) -> None:
        """One object written whole in one request; with `exclusive`, only if absent (FileExistsError)."""
        self._call("writing", path, self.fs.pipe_file, self._p(path), data,
                   mode="create" if exclusive else "overwrite")

    def upload(self, pairs: list[tuple[str, str]]) -> None:
        """Local files to objects: (local path, store path) pairs, uploaded concurrently where the client
        can (multipart where large)."""
        if not pairs:
            return
        if getattr(self.fs, "async_impl", False):
            self._call("uploading", pairs[0][1], self.fs.put, [lp for lp, _ in pairs], [self._p(p) for _, p in pairs])
        else:
            for lp, p in pairs:
                self._call("uploading", p, self.fs.put_file, lp, self._p(p))

    def download(self, pairs: list[tuple[str, str]]) -> None:
        """Objects to local files, each in one streamed GET, all concurrently. (s3fs would otherwise
        start a GET of an object larger than its block size, drop it after the headers, whose bytes
        already in flight are fetched for nothing, and fetch the object again in concurrent parts.)"""
        if not pairs:
            return
        if getattr(self.fs, "async_impl", False):
            one_stream = {"max_concurrency": 1} if self.protocol in ("s3", "s3a") else {}
            self._call("downloading", pairs[0][0], self.fs.get, [self._p(p) for p, _ in pairs],
                       [lp for _, lp in pairs], **one_stream)
        else:
            for p, lp in pairs:
                self._call("downloading", p, self.fs.get_file, self._p(p), lp)

    # ---------------------------------------------------------------------------------- files
    size_is_a_request = True

    def exists(self, path):
        return self._call("checking", path, self.fs.exists, self._p(path))

    def isdir(self, path):
        found = self._call("checking", path, self.fs.isdir, self._p(path))
        if not found and not path:
            self._check_bucket()   # an empty prefix is a run that has not saved; a missing bucket is an error
        return found

    def listdir(self, path):
        self.fs.invalidate_cache(self._p(path))
        try:
            entries = self._call("listing", path, self.fs.ls, self._p(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            if not path:
                self._check_bucket()   # a missing prefix is an empty run; a missing bucket is an error
            return []
        prefix = self._p(path).rstrip("/") + "/"
        names = []
        for e in entries:
            e = e.rstrip("/")
            # some filesystems return paths without the leading '/' of the root
            name = e[len(prefix):] if e.startswith(prefix) else e.rsplit("/", 1)[-1]
            if name:
                names.append(name)
        return sorted(set(names))

    def makedirs(self, path):
        pass  # object stores have no directories (and s3fs would create a missing bucket)

    def size(self, path):
        return self._call("reading the size of", path, self.fs.size, self._p(path))

    def sizes(self, paths):
        """One listing per directory instead of a request per file (shard files share `sparse/`)."""
        if len(paths) < 2:
            return super().sizes(paths)
        by_dir: dict[str, dict[str, int]] = {}
        for d in sorted({p.rsplit("/", 1)[0] if "/" in p else "" for p in paths}):
            self.fs.invalidate_cache(self._p(d))
            try:
                entries = self._call("listing", d, self.fs.ls, self._p(d), detail=True)
            except (FileNotFoundError, NotADirectoryError):
                entries = []
            by_dir[d] = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size")
                         for e in entries if e.get("type") == "file"}
        out = []
        for p in paths:
            d, name = p.rsplit("/", 1) if "/" in p else ("", p)
            n = by_dir[d].get(name)
            if n is None:
                raise FileNotFoundError(errno.ENOENT, "object not found", self.describe(p))
            out.append(int(n))
        return out

    def read_bytes(self, path, offset=0, length=None):
        if length == 0:
            return b""
        # No Range header for a whole file: a range on an empty object is "not satisfiable".
        end = None if length is None else offset + length
        try:
            return self._call("reading", path, self.fs.cat_file, self._p(path), start=offset or None, end=end)
        except StorageError as e:
            if e.errno == errno.EINVAL and not offset:
                return b""   # a range from 0 "not satisfiable": the object is empty
            raise

    #: Ranged reads are merged where they touch and then cut into pieces of at most this many bytes:
    #: fewer requests for the many small adjacent ranges of a load (columns and their padding), and
    #: several concurrent requests for one large column. Exactly the requested bytes are fetched.
    READ_PIECE_BYTES = 8 << 20

    def read_ranges(self, ranges):
        if not ranges:
            return []
        if not getattr(self.fs, "async_impl", False):
            return super().read_ranges(ranges)
        # Merge touching ranges of one file (in request order), then cut into pieces.
        merged: list[list] = []   # [path, start, end, [request indexes]]
        for k, (p, s_, e) in enumerate(ranges):
            if e <= s_:
                continue
            last = merged[-1] if merged else None
            if last is not None and last[0] == p and last[2] == s_:
                last[2] = e
                last[3].append(k)
            else:
                merged.append([p, s_, e, [k]])
        pieces = [(m[0], lo, min(lo + self.READ_PIECE_BYTES, m[2])) for m in merged
                  for lo in range(m[1], m[2], self.READ_PIECE_BYTES)]
        got = self._call("reading ranges of", ranges[0][0], self.fs.cat_ranges,
                         [self._p(p) for p, _, _ in pieces], [lo for _, lo, _ in pieces],
                         [hi for _, _, hi in pieces], on_error="return") if pieces else []
        for k, ((p, _, _), r) in enumerate(zip(pieces, got)):
            if isinstance(r, OSError) and r.errno == errno.EINVAL:
                got[k] = b""   # a range past the end of a shorter object: a short read, for the caller to judge
            elif isinstance(r, FileNotFoundError):
                raise FileNotFoundError(errno.ENOENT, "object not found", self.describe(p)) from r
            elif isinstance(r, BaseException):
                raise StorageError(errno.EIO, f"reading {self.describe(p)} failed: {type(r).__name__}: {r}",
                                   self.describe(p)) from r
        out: list = [b""] * len(ranges)
        it = iter(zip(pieces, got))
        for p, lo, hi, idx in merged:
            parts, short = [], False
            for _ in range(-(-(hi - lo) // self.READ_PIECE_BYTES)):
                (_, plo, phi), data = next(it)
                if not short:
                    parts.append(data)
                    short = len(data) < phi - plo   # later bytes would land at wrong offsets: stop here
            view = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
            for k in idx:
                out[k] = view[ranges[k][1] - lo:ranges[k][2] - lo]
        return out

    def read_into(self, path, buf):
        view = memoryview(buf).cast("B")
        data = self.read_bytes(path, 0, len(view))
        view[:len(data)] = data
        return len(data)

    @contextlib.contextmanager
    def open_write(self, path, fsync=True):
        # Buffered locally and sent as one PUT: an object appears whole or not at all.
        import io
        buf = io.BytesIO()
        yield buf
        self.put_bytes(path, buf.getvalue())

    def write_atomic(self, path, data, tmp, fsync=True, owner=None):
        self.put_bytes(path, data)   # one PUT replaces an object atomically: no temporary object to claim

    def remove_file(self, path):
        with contextlib.suppress(FileNotFoundError):
            self._call("removing", path, self.fs.rm_file, self._p(path))

    def remove_tree(self, path):
        try:
            self._call("removing", path, self.fs.rm, self._p(path), recursive=True)
        except FileNotFoundError:
            pass

    # --------------------------------------------------------------------------- engine access
    @contextlib.contextmanager
    def engine_outputs(self, directory, rels):
        tmp = tempfile.mkdtemp(prefix="recckpt-")
        handed_off = False
        try:
            paths = [os.path.join(tmp, f"{k}-{os.path.basename(r)}") for k, r in enumerate(rels)]
            yield paths
            pairs = [(p, f"{directory}/{r}") for p, r in zip(paths, rels) if os.path.exists(p)]
            pending = getattr(self._uploads, "pending", None)
            if pending is None:
                self.upload(pairs)
            else:
                pending.append(_BackgroundUpload(self, pairs, tmp))
                handed_off = True
        finally:
            if not handed_off:
                shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def background_uploads(self):
        if getattr(self._uploads, "pending", None) is not None:
            yield   # nested: the outer block waits
            return
        self._uploads.pending = pending = []
        ok = False
        try:
            yield
            ok = True
        finally:
            self._uploads.pending = None
            # Always wait: an upload still running after a failed save would write into what the
            # failed save's cleanup removes.
            errors = [e for e in (u.wait() for u in pending) if e is not None]
            if ok and errors:
                raise errors[0]

    # ------------------------------------------------------------------------- commit protocol
    def prepare_for_save(self):
        self._check_bucket()

    def _check_bucket(self):
        """Raise StorageError when the root's bucket does not exist: a save never creates one, so a
        missing bucket is a wrong name or wrong credentials, never a run that has not started."""
        split = getattr(self.fs, "split_path", None)
        if split is None:
            return
        bucket = split(self.root)[0]
        try:
            ok = self._call("checking the bucket of", "", self.fs.exists, bucket)
        except StorageError as e:
            raise StorageError(e.errno, f"cannot check bucket {bucket!r} of {self.describe()}: {e.strerror}",
                               self.describe()) from e
        if not ok:
            raise StorageError(errno.ENOENT, f"bucket {bucket!r} of {self.describe()} does not exist (or these "
                                             f"credentials cannot see it); a save never creates a bucket: create "
                                             f"it, or fix the bucket name or storage_options", self.describe())

    def save_target(self, ckpt_id, staging):
        return ckpt_id

    def may_hold_uncommitted(self):
        return True

    def commit(self, target, ckpt_id, marker, data, fsync=True):
        path = f"{ckpt_id}/{marker}"
        try:
            self.put_bytes(path, data, exclusive=True)
        except FileExistsError:
            if self._holds(path, data):   # our own PUT, retried by the client after a lost response
                return
            raise ConcurrentCommitError(f"checkpoint {self.describe(ckpt_id)} was committed by another writer "
                                        f"while this save was writing it; this save's files were never "
                                        f"visible, and the committed checkpoint is the other writer's") from None
        except StorageError as e:
            # The commit is the manifest's PUT: if it landed (its response was what got lost), the save
            # succeeded; only a manifest that is not there is a failed save.
            if not self._holds(path, data):
                raise
            warnings.warn(f"{e}; but {self.describe(path)} is in place, so checkpoint {ckpt_id!r} is "
                          f"committed", stacklevel=3)

    def _holds(self, path, data) -> bool:
        try:
            return self.read_bytes(path) == data
        except (OSError, StorageError):
            return False

    def drop_leftovers(self, target, files, marker):
        prefix = self._p(target).rstrip("/") + "/"
        try:
            found = self._call("listing", target, self.fs.find, self._p(target))
        except FileNotFoundError:
            found = []
        rels = set()
        for p in found:
            # some filesystems return paths without the leading '/' of the root
            rel = (p[len(prefix):] if p.startswith(prefix) else
                   p[len(prefix.lstrip("/")):] if p.startswith(prefix.lstrip("/")) else None)
            if rel:
                rels.add(rel)
        missing = sorted(set(files) - rels)
        if missing:
            raise StorageError(errno.ENOENT, f"{len(missing)} file(s) this save wrote are gone from "
                                             f"{self.describe(target)} before its commit ({', '.join(missing[:3])}"
                                             f"{', ...' if len(missing) > 3 else ''}): another process removed "
                                             f"them (recovery or a delete racing this save); nothing was "
                                             f"committed, save again", self.describe(target))
        for rel in sorted(rels - set(files) - {marker}):
            self.remove_file(f"{target}/{rel}")

    def discard(self, target, ckpt_id, marker):
        if not self.exists(f"{ckpt_id}/{marker}"):
            self.remove_tree(ckpt_id)

    def delete_checkpoint(self, ckpt_id, marker, trash):
        self.remove_file(f"{ckpt_id}/{marker}")
        self.remove_tree(ckpt_id)

    def _lease_state(self, owner) -> dict | None:
        """The lease's body while its holder may be alive (claims.abandoned), else None."""
        try:
            body = claims.decode(self.read_bytes(owner, 0, 1 << 16))
        except FileNotFoundError:
            return None
        if claims.abandoned(body, self.lease_s) is not None:   # one PUT writes a lease: no torn body
            return None
        return body

    def claim(self, target, owner):
        for _ in range(2):
            body = claims.body(target, self.lease_s)
            data = claims.encode(body)
            try:
                self.put_bytes(owner, data, exclusive=True)
                return _Lease(self, owner, body)
            except FileExistsError:
                live = self._lease_state(owner)
                if live is not None:
                    raise CheckpointExistsError(
                        f"{self.describe(target)} is being written by another live process (pid "
                        f"{live.get('pid')} on {live.get('host')}, lease {self.describe(owner)}); choose "
                        f"another ckpt_id or wait for that save") from None
                if self._take_over(owner, data):   # a dead writer's lease
                    return _Lease(self, owner, body)
                # another process took it over first: the next round names it
        raise CheckpointExistsError(f"could not claim {self.describe(target)}: another process keeps "
                                    f"taking lease {self.describe(owner)}")

    def _take_over(self, owner: str, data: bytes) -> bool:
        """Replace the lease `owner`, judged stale, with `data`; True when this process now holds it.

        On S3 a compare-and-swap: the new lease is written only if the object is still the one judged
        stale (a PUT with If-Match on its ETag), so of processes taking over one stale lease at once
        exactly one wins. Stores without conditional writes remove it and create it only if absent,
        which two takers can both pass in a narrow window (docs/SAFETY.md)."""
        if self.protocol not in ("s3", "s3a"):
            self.remove_file(owner)
            return self._create(owner, data)
        try:
            etag = self._call("checking", owner, self.fs.info, self._p(owner))["ETag"]
        except FileNotFoundError:
            return self._create(owner, data)
        # The body judged stale must be the one with that ETag: judged again, between two looks at it.
        if self._lease_state(owner) is not None:
            return False
        try:
            if self._call("checking", owner, self.fs.info, self._p(owner))["ETag"] != etag:
                return False
            self._call("taking over", owner, self.fs.pipe_file, self._p(owner), data, IfMatch=etag)
            return True
        except FileNotFoundError:
            return self._create(owner, data)
        except StorageError as e:
            if e.errno != errno.EINVAL:   # s3fs reports a failed precondition (412) as EINVAL
                raise
            return self._holds(owner, data)   # our own PUT, retried by the client after a lost response

    def _create(self, path: str, data: bytes) -> bool:
        try:
            self.put_bytes(path, data, exclusive=True)
            return True
        except FileExistsError:
            return False

    def remove_if_unowned(self, owners, paths):
        if any(self._lease_state(o) is not None for o in owners):
            return False
        for p in paths:
            if self.isdir(p):
                self.remove_tree(p)
            else:
                self.remove_file(p)
        for o in owners:
            self.remove_file(o)
        return True
