"""What the hostile-input checks cost on a large index: the bounded parser against plain json.loads
of the same bytes, and the tiling check against the field-by-field index validation.

    python benchmarks/bench_validation.py [--segments 100000] [--repeat 5]

Builds the index JSON of one table with N segments (one shard file per 1000 segments, two slots),
as the writer would, then times, best of `repeat`, in this process:
- json.loads of the index text (the baseline: what any reader pays);
- checked_json.loads (depth, number and key rules, the checksum re-serialisation);
- index_parse.index_from_json (fields, offsets, lengths, column layout);
- structure.tiling_problems (the blocks tile every file).
Ratios are against json.loads measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import time

from recckpt.format import checked_json, layout, names, structure
from recckpt.format.index_parse import index_from_json


def build(segments: int, nb: int = 16, cb: int = 1 << 16) -> dict:
    rows, rb = 512, [8, 64, 64]
    files, segs, per_file, pos = [], [], 1000, 0
    for i in range(segments):
        if i % per_file == 0:
            if files:
                files[-1]["size"] = pos
            files.append({"path": f"sparse/shard-00000-{len(files):03d}.bin", "size": 0})
            pos = 0
        b = {"offset": pos, "length": 8 * (nb + 1), "crc32c": 1}
        pos += 8 * (nb + 1)
        cols = []
        for k, w in enumerate(rb):
            if k:
                pos = layout.align_up(pos)
            n = rows * w
            cols.append({"offset": pos, "length": n, "crc32c": [7] * -(-n // cb)})
            pos += n
        segs.append({"file": len(files) - 1, "rows": rows, "buckets": b, "columns": cols})
    files[-1]["size"] = pos
    # A version 3 index (versions 1-3 are still read); version 4's big-index case is in the hostile
    # corpus (tests/helpers/hostile.py, index_200k_duplicated_segments), bounded against json.loads.
    return {"format_version": 3, "num_buckets": nb, "chunk_bytes": cb, "files": files,
            "tables": {"t": {"slots": ["a", "b"], "segments": segs}}}


def best(fn, repeat):
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    doc = build(a.segments)
    data = checked_json.dumps(doc)
    cap = names.MAX_INDEX_BYTES
    parsed = index_from_json(doc, "index.json")
    t_json = best(lambda: json.loads(data), a.repeat)
    t_checked = best(lambda: checked_json.loads(data, "index.json", cap), a.repeat)
    t_fields = best(lambda: index_from_json(doc, "index.json"), a.repeat)
    t_tiling = best(lambda: structure.tiling_problems(parsed, str), a.repeat)
    assert not structure.tiling_problems(parsed, str)
    print(f"index: {a.segments} segments, {len(data) / 1e6:.1f} MB of JSON")
    print("| step | seconds | × json.loads |")
    print("|---|---|---|")
    for name, t in (("json.loads (baseline)", t_json), ("checked_json.loads", t_checked),
                    ("index_from_json (fields)", t_fields), ("tiling_problems", t_tiling)):
        print(f"| {name} | {t:.3f} | {t / t_json:.2f} |")


if __name__ == "__main__":
    main()
