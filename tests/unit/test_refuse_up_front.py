"""Constructors refuse what a save or load would reject, saying what is allowed; local reads open only
regular files, checked on the opened file (recckpt/storage/regular.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from recckpt import SaveOptions, Saver, verify
from recckpt.errors import CorruptCheckpointError, StorageURLError
from recckpt.format import names
from recckpt.format.index_parse import index_from_json
from recckpt.storage import LocalStorage, open_storage
from recckpt.storage.regular import open_regular, read_regular


def _index_accepts(nb: int) -> bool:
    try:
        index_from_json({"format_version": names.FORMAT_VERSION, "num_buckets": nb, "chunk_bytes": 64,
                         "files": [], "tables": {}}, "index.json")
        return True
    except CorruptCheckpointError:
        return False


@pytest.mark.parametrize("nb", [1, 4096, (1 << 24) - 1, 1 << 24, (1 << 24) + 1])
def test_num_buckets_range_is_the_validators(nb):
    """SaveOptions accepts exactly the bucket counts a load accepts (docs/FORMAT.md: 1 <= B < 2**24)."""
    try:
        SaveOptions(num_buckets=nb)
        accepted = True
    except ValueError as e:
        assert "1 <= num_buckets < 2**24" in str(e)
        accepted = False
    assert accepted == _index_accepts(nb) == (nb < 1 << 24)


def test_empty_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageURLError, match="non-empty path or URL"):
        Saver(torch.nn.Linear(2, 2), output_dir="")
    with pytest.raises(StorageURLError, match="names no directory"):
        Saver(torch.nn.Linear(2, 2), output_dir="file://")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["nosuchproto://bucket/run", "s4://x/y"])
def test_unknown_protocol_is_a_recckpt_error(url):
    with pytest.raises(StorageURLError, match=r"s3://.*memory://") as ei:
        Saver(torch.nn.Linear(2, 2), output_dir=url)
    assert isinstance(ei.value, ValueError) and url in str(ei.value)
    with pytest.raises(StorageURLError):
        verify(url)


def test_fsspec_local_protocols_get_the_local_store(tmp_path):
    s = open_storage(f"local://{tmp_path}")
    assert isinstance(s, LocalStorage) and s.root == str(tmp_path)


# ------------------------------------------------------------------------- regular files only
def test_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "f"
    os.mkfifo(p)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(CorruptCheckpointError, open_regular, str(p))))
    t.start()
    t.join(10)
    assert done, "opening a FIFO blocked"
    assert "a FIFO" in str(done[0].value) and str(p) in str(done[0].value)


@pytest.mark.parametrize("target, what", [("/dev/zero", "a symbolic link"), (".", "a symbolic link")])
def test_links_are_not_followed(tmp_path, target, what):
    os.symlink(target, tmp_path / "l")
    with pytest.raises(CorruptCheckpointError, match=what):
        read_regular(str(tmp_path / "l"))


def test_devices_and_directories_are_refused(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="character device"):
        read_regular("/dev/zero")
    with pytest.raises(CorruptCheckpointError, match="directory"):
        read_regular(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "missing"))


def test_reads_stop_at_the_size_of_the_opened_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"abcdef")
    assert read_regular(str(p)) == b"abcdef"
    assert read_regular(str(p), 2, 3) == b"cde"
    assert read_regular(str(p), 4, 100) == b"ef"
    assert read_regular(str(p), 10) == b""


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_engine_reads_only_regular_files(tmp_path, kind):
    """The engine's reader checks the opened file too (a FIFO does not block, a link is not followed)."""
    import numpy as np

    from recckpt import _C
    p = tmp_path / "shard.bin"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        (tmp_path / "real.bin").write_bytes(bytes(8))
        os.symlink(tmp_path / "real.bin", p)
    dst = np.zeros(8, dtype=np.uint8)
    req = (str(p), 0, 8, 8, np.asarray([_C.crc32c(bytes(8))], dtype=np.uint32), 0, 8, dst, 0)
    out = []
    t = threading.Thread(target=lambda: out.append(_C.read_ranges([req], 1)))
    t.start()
    t.join(10)
    assert out, "the engine blocked opening a FIFO"
    _, errors = out[0]
    assert errors and errors[0][0] == 0
    assert ("not a regular file" in errors[0][1]) if kind == "fifo" else ("open error" in errors[0][1])
