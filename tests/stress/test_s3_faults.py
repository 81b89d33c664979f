"""Object-store faults against a real S3-compatible server on 127.0.0.1: a saving process SIGKILLed at
random moments, flipped bytes, wrong credentials. After a kill, everything listed loads and verifies,
the next save (of any id, the killed one's included) succeeds, and leftovers are cleaned up."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers.s3_server import server_process, storage_options
from helpers.shared_dir_child import Model
from recckpt import SaveOptions, Saver, verify
from recckpt.errors import CorruptCheckpointError, StorageError

logging.getLogger("werkzeug").setLevel(logging.ERROR)
CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "s3_save_child.py")
OPTS = SaveOptions(num_buckets=32, chunk_bytes=4096, segment_bytes=1 << 16, fsync=False)


def _check_loads(url, opts):
    s = Saver(Model(), output_dir=url, storage_options=opts)
    ids = s.checkpoints()
    for cid in ids:
        assert verify(f"{url}/{cid}", storage_options=opts).ok, cid
        m = Model()
        Saver(m, output_dir=url, storage_options=opts).load(ckpt_id=cid)
        k = int(cid.split("_")[1])
        assert m.tag.tolist() == [k, k] and torch.all(m.t.cols["embedding"] == float(k))
    return ids


def test_sigkill_during_saves_to_s3(tmp_path, s3_server, s3_bucket, slow_mode):
    url, opts = f"s3://{s3_bucket}/killed", s3_server.options()
    rng = random.Random(7)
    trials = 12 if slow_mode else 2
    for trial in range(trials):
        ready = tmp_path / f"ready{trial}"
        child = subprocess.Popen([sys.executable, CHILD, url, json.dumps(opts), str(ready)])
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the saving child did not get going"
            time.sleep(0.02)
        time.sleep(rng.random() * 1.5)
        child.send_signal(signal.SIGKILL)
        child.wait()
        ids = _check_loads(url, opts)
        assert ids, "nothing committed"
    # The next save, of the id the last child was writing too, succeeds and cleans up after the dead.
    last = int(ids[-1].split("_")[1])
    m = Model()
    m.tag.copy_(torch.tensor([last + 1, last + 1]))
    m.t.set_rows(torch.arange(5), {"embedding": torch.full((5, 8), float(last + 1))})
    Saver(m, output_dir=url, max_keep=None, storage_options=opts, options=OPTS).save(f"ckpt_{last + 1:05d}")
    _check_loads(url, opts)
    fs = s3_server.fs()
    left = [p for p in fs.find(f"{s3_bucket}/killed") if "/.owner-" in p]
    assert not left, left
    top = {p.split("/")[2] for p in fs.find(f"{s3_bucket}/killed")}
    assert top <= set(Saver(Model(), output_dir=url, storage_options=opts).checkpoints()) | {"checkpoint", ".catalog.json"}, top


def test_flipped_byte_on_s3_is_caught_by_load_and_verify(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/flip", s3_server.options()
    m = Model()
    m.t.set_rows(torch.arange(2000), {"embedding": torch.randn(2000, 8)})
    Saver(m, output_dir=url, storage_options=opts, options=OPTS).save("c1")
    fs = s3_server.fs()
    shard = sorted(p for p in fs.find(f"{s3_bucket}/flip/c1/sparse") if p.endswith(".bin"))[0]
    data = bytearray(fs.cat(shard))
    data[len(data) // 2] ^= 0x40
    fs.pipe(shard, bytes(data))
    assert not verify(f"{url}/c1", storage_options=opts).ok
    with pytest.raises(CorruptCheckpointError, match="shard-"):
        Saver(Model(), output_dir=url, storage_options=opts).load()


def test_wrong_credentials_are_a_storage_error_that_says_so():
    with server_process(auth_after=1) as server:
        server.client().create_bucket(Bucket="locked")   # the one request allowed without valid credentials
        url = "s3://locked/run"
        s = Saver(Model(), output_dir=url, storage_options=storage_options(server.endpoint), options=OPTS)
        with pytest.raises(StorageError, match="credentials") as ei:
            s.checkpoints()
        assert "s3://locked/run" in str(ei.value)
        with pytest.raises(StorageError, match="credentials"):
            s.save("c1")
