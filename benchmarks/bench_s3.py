"""recckpt on an object store: save and load through s3fs against an S3-compatible server on
127.0.0.1 (moto's server mode, in its own process), next to the same bytes put and got by s3fs
directly at the same concurrency ("raw"), torch.save/torch.load and safetensors through s3fs.
Also: the bytes a 1-of-3 resharding load fetches, and requests per checkpoint, counted on the wire by a
loopback proxy (tests/helpers/s3_server.py). Ratios are against raw measured in the same run.

    python benchmarks/bench_s3.py --ids 600000      # ~500 MB of state (issue 14's size)
    python benchmarks/bench_s3.py --ids 100000      # ~80 MB, a couple of minutes on a 2-core machine
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests"), HERE]

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from compare import build, exported, fresh_model  # noqa: E402

from helpers.s3_server import LoopbackProxy, server_process, storage_options  # noqa: E402
from recckpt import SaveOptions, Saver  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dense-mb", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--chunk-kb", type=int, default=None,
                    help="SaveOptions.chunk_bytes (default: the library's): a partial read reads whole checksum "
                         "chunks, so this bounds the over-read of a resharding load")
    ap.add_argument("--segment-mb", type=int, default=None, help="SaveOptions.segment_bytes (default: the library's)")
    a = ap.parse_args()
    logging.getLogger("recckpt").setLevel(logging.ERROR)
    kw = {} if a.chunk_kb is None else {"chunk_bytes": a.chunk_kb << 10}
    if a.segment_mb is not None:
        kw["segment_bytes"] = a.segment_mb << 20
    opts = SaveOptions(fsync=False, **kw)   # the library's defaults unless asked otherwise
    with server_process() as server:
        server.client().create_bucket(Bucket="bench")
        so = server.options()
        fs = server.fs()
        m, opt = build(a.ids, a.dim, a.dense_mb)
        tensors = {k: v.contiguous() for k, v in exported(m).items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"state: {a.ids} ids x {a.dim} x 3 slots + {a.dense_mb} MB dense = {size / 1e6:.0f} MB; "
              f"concurrency {a.concurrency}; chunk_bytes {opts.chunk_bytes >> 10} KiB, segment_bytes "
              f"{opts.segment_bytes >> 20} MiB", flush=True)
        blobs = {k: t.view(-1).view(torch.uint8).numpy().tobytes() for k, t in tensors.items()}
        # raw: the same bytes as `concurrency` objects, put and got concurrently by s3fs
        joined = b"".join(blobs.values())
        step = -(-len(joined) // a.concurrency)
        raw_parts = {f"bench/raw/part{k}": joined[k * step:(k + 1) * step] for k in range(a.concurrency)}
        del joined
        res: dict[str, list[float]] = {}

        def put_raw():
            fs.pipe(raw_parts, batch_size=a.concurrency)

        def get_raw():
            return fs.cat(list(raw_parts), batch_size=a.concurrency)

        for r in range(a.repeat):
            url = f"s3://bench/recckpt{r}"
            s = Saver(m, sparse_optim=opt, output_dir=url, concurrency=a.concurrency, options=opts,
                      storage_options=so, max_keep=None)
            res.setdefault("recckpt save", []).append(timed(lambda: s.save("c"))[0])
            m2, opt2 = fresh_model(list(m.dense.keys()), a.dim)
            res.setdefault("recckpt load", []).append(timed(
                lambda: Saver(m2, sparse_optim=opt2, output_dir=url, concurrency=a.concurrency,
                              storage_options=so).load())[0])
            res.setdefault("raw put", []).append(timed(put_raw)[0])
            res.setdefault("raw get", []).append(timed(get_raw)[0])

            def torch_save():
                with fs.open(f"bench/torch{r}.pt", "wb") as f:
                    torch.save(tensors, f)

            def torch_load():
                with fs.open(f"bench/torch{r}.pt", "rb") as f:
                    return torch.load(io.BytesIO(f.read()), weights_only=True)

            res.setdefault("torch.save via s3fs", []).append(timed(torch_save)[0])
            res.setdefault("torch.load via s3fs", []).append(timed(torch_load)[0])
            res.setdefault("safetensors save via s3fs", []).append(timed(
                lambda: fs.pipe_file(f"bench/st{r}.safetensors", safetensors.torch.save(tensors)))[0])
            res.setdefault("safetensors load via s3fs", []).append(timed(
                lambda: safetensors.torch.load(fs.cat_file(f"bench/st{r}.safetensors")))[0])
        best = {k: min(v) for k, v in res.items()}

        # On the wire, through a counting proxy: requests per save and load, and the bytes of 1-of-3.
        proxy = LoopbackProxy(int(server.endpoint.rsplit(":", 1)[1]))
        pso = storage_options(proxy.endpoint)
        url = "s3://bench/wire"
        s = Saver(m, sparse_optim=opt, output_dir=url, concurrency=a.concurrency, options=opts, storage_options=pso)
        s.save("c")   # the first save also runs start-up recovery: count the second one
        proxy.reset()
        s.save("d")
        save_requests = proxy.requests
        m3, opt3 = fresh_model(list(m.dense.keys()), a.dim)
        reader = Saver(m3, sparse_optim=opt3, output_dir=url, concurrency=a.concurrency, storage_options=pso)
        proxy.reset()
        reader.load(ckpt_id="d")
        load_requests, full_bytes = proxy.requests, proxy.bytes_down
        ckpt_bytes = sum(fs.du("bench/wire/d", total=False).values())
        proxy.reset()
        reader.load(ckpt_id="d", shard_id=1, shard_num=3, load_conf={"load": ["sparse", "sparse_opt"]})
        third_bytes = proxy.bytes_down
        proxy.stop()

    mb = size / 1e6
    print(f"\n| operation | best of {a.repeat} (s) | MB/s | ratio to raw |")
    print("|---|---|---|---|")
    for k, t in best.items():
        raw = best["raw put"] if ("save" in k or "put" in k) else best["raw get"]
        print(f"| {k} | {t:.2f} | {mb / t:.0f} | {raw / t:.2f} |")
    print(f"\ncheckpoint {ckpt_bytes / 1e6:.1f} MB; full load fetched {full_bytes / 1e6:.1f} MB "
          f"({full_bytes / ckpt_bytes:.3f}x, HTTP headers included)")
    print(f"1-of-3 resharding load (sparse + sparse_opt) fetched {third_bytes / 1e6:.1f} MB = "
          f"{third_bytes / (ckpt_bytes / 3):.2f} x (size / 3)   [target <= 1.2]")
    print(f"requests per checkpoint: save {save_requests}, full load {load_requests}")
    print(f"targets: save {best['raw put'] / best['recckpt save']:.2f} x raw [>= 0.8], "
          f"load {best['raw get'] / best['recckpt load']:.2f} x raw [>= 0.8]")


if __name__ == "__main__":
    main()
