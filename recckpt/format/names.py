"""Every file name in a checkpoint, and validation of the names a user or a file can supply."""
from __future__ import annotations

import posixpath
import re

from ..errors import InvalidCheckpointIdError

FORMAT_NAME = "recckpt"
FORMAT_VERSION = 5                   # what this recckpt writes
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5)  # what it reads: 2 added the slot-column alignment (format/layout.py),
#                                       3 incremental checkpoints (parent, changed rows, removed ids),
#                                       4 bucket directories, packed segments, per-table bucket functions,
#                                       column blocks, a struct-of-arrays index, 5 column groups and
#                                       id-less row-run segments of row_range tables (docs/FORMAT.md)
INCREMENTAL_SINCE = 3                # the first version whose manifests may name a parent
SEGMENT_DIR_SINCE = 4                # the first version with bucket directories and the version 4 index
COLUMN_GROUPS_SINCE = 5              # the first version with column groups and row-run segments

VERSION_FILE = "checkpoint"          # <output_dir>/checkpoint: committed ids, oldest first
STAGING_PREFIX = ".staging-"         # <output_dir>/.staging-<ckpt_id>-<nonce>/ while a save is running
TRASH_PREFIX = ".deleting-"          # a checkpoint being deleted is renamed here first
VERSION_TMP_PREFIX = f".{VERSION_FILE}.tmp-"   # the version file being replaced
OWNER_PREFIX = ".owner-"             # <output_dir>/.owner-<target>.w<worker>: a live writer's claim
CATALOG = ".catalog.json"            # <output_dir>/.catalog.json: what listings need of each manifest
CATALOG_TMP_PREFIX = f"{CATALOG}.tmp-"   # the catalog being replaced

MANIFEST = "manifest.json"
INDEX = "index.json"
DENSE = "dense.safetensors"
EXTRAS = "extras.safetensors"
SPARSE_DIR = "sparse"
IO_STATE_DIR = "io_state"

# Caps on metadata sizes: a hostile or garbled file can never make us allocate more than this.
MAX_MANIFEST_BYTES = 64 << 20
MAX_INDEX_BYTES = 1 << 30
MAX_VERSION_FILE_BYTES = 16 << 20   # ~80k ids of 200 characters
MAX_CATALOG_BYTES = 256 << 20       # ~500k checkpoints

_CKPT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}")


def validate_ckpt_id(ckpt_id: object) -> str:
    """A checkpoint id names a directory: ASCII letters, digits and `_ . = + -`, at most 200 characters,
    the first a letter, digit or `_`, never containing '..'."""
    if not isinstance(ckpt_id, str):
        raise InvalidCheckpointIdError(f"checkpoint id must be a str, got {type(ckpt_id).__name__}")
    if ckpt_id in (VERSION_FILE, MANIFEST):
        what = ("the name of the version file in the output directory" if ckpt_id == VERSION_FILE else
                "the file that makes a directory a checkpoint: the output directory would pass for one")
        raise InvalidCheckpointIdError(f"checkpoint id {ckpt_id!r} is reserved: it is {what}; choose another id, "
                                       f"e.g. 'ckpt_1000'")
    if not _CKPT_ID.fullmatch(ckpt_id) or ".." in ckpt_id:
        raise InvalidCheckpointIdError(
            f"invalid checkpoint id {ckpt_id!r}: use ASCII letters, digits and '_.=+-' (at most 200, the first "
            f"a letter, digit or '_', no '..', '/' or NUL), e.g. 'ckpt_1000'")
    return ckpt_id


def owner_file(target: str, worker: int) -> str:
    """The claim a live writer (one worker) holds on the save target `target` (a staging directory, or
    a checkpoint id where the store writes in place)."""
    return f"{OWNER_PREFIX}{target.lstrip('.')}.w{worker:05d}"


def owner_target_prefix(target: str) -> str:
    """Every worker's claim on `target` starts with this."""
    return f"{OWNER_PREFIX}{target.lstrip('.')}.w"


def shard_file(worker: int, part: int) -> str:
    return f"{SPARSE_DIR}/shard-{worker:05d}-{part:03d}.bin"


# ASCII digits, at most 7 (shard_num < 2**20): names come from files, and int() of 5000 digits raises.
_SHARD_FILE = re.compile(re.escape(SPARSE_DIR) + r"/shard-([0-9]{5,7})-[0-9]{3,}\.bin")
_WORKER_INDEX = re.compile(re.escape(SPARSE_DIR) + r"/worker-([0-9]{5,7})\.index\.json")


def shard_file_worker(rel: str) -> int | None:
    """The worker that wrote a shard file, from its name (None if the name is not a shard file's)."""
    m = _SHARD_FILE.fullmatch(rel)
    return int(m.group(1)) if m else None


def worker_index(worker: int) -> str:
    return f"{SPARSE_DIR}/worker-{worker:05d}.index.json"


def worker_index_worker(rel: str) -> int | None:
    """The worker whose index `rel` is, from its name (None if the name is not a worker index's)."""
    m = _WORKER_INDEX.fullmatch(rel)
    return int(m.group(1)) if m else None


def io_state_file(worker: int) -> str:
    return f"{IO_STATE_DIR}/worker-{worker:05d}.safetensors"


def validate_relpath(path: object, what: str) -> str:
    """A path read from a checkpoint's own metadata: relative, normalised, inside the checkpoint."""
    if (not isinstance(path, str) or not path or "\x00" in path or "\\" in path or path.startswith("/")
            or posixpath.normpath(path) != path or path == "." or path.split("/")[0] == ".."):
        raise ValueError(f"{what}: {path!r} is not a relative path inside the checkpoint")
    return path


#: The IO-state entry a CheckpointManager keeps its RNG state under (`save_rng`): recckpt's own, so a load
#: does not count it as unexpected IO state when the loading manager saves no RNG.
RNG_IO_NAME = "__rng__"
