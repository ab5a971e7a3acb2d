#!/usr/bin/env python3
"""Writes MNIST IDX files into a Hugging Face cache as the Hub's Parquet conversion of
ylecun/mnist (revision refs/convert/parquet: an `image` struct of PNG bytes and path, an int64
`label`, Snappy), so that `myo train --hub` can be checked offline against `--data-dir`:

    python3 scripts/hub-cache-from-idx.py IDX_DIR HF_HOME     # needs pyarrow, pillow
    HF_HOME=HF_HOME HF_HUB_OFFLINE=1 myo train --task smnist --hub ...
"""
import io
import os
import struct
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image


def read_idx(path):
    data = open(path, "rb").read()
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, rows, cols)
    if magic == 2049:
        return np.frombuffer(data, np.uint8, offset=8)
    sys.exit(f"{path}: magic number {magic}, expected 2049 or 2051")


def png(pixels):
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def main(src, home):
    commit = "0" * 40
    repo = os.path.join(home, "hub", "datasets--ylecun--mnist")
    refs = os.path.join(repo, "refs", "refs", "convert")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, "parquet"), "w") as f:
        f.write(commit)
    for split, prefix in [("train", "train"), ("test", "t10k")]:
        images = read_idx(os.path.join(src, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(os.path.join(src, f"{prefix}-labels-idx1-ubyte"))
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        table = pa.table({
            "image": pa.array([{"bytes": png(a), "path": None} for a in images], type=image_type),
            "label": pa.array(labels.astype(np.int64)),
        })
        out = os.path.join(repo, "snapshots", commit, "mnist", split)
        os.makedirs(out, exist_ok=True)
        pq.write_table(table, os.path.join(out, "0000.parquet"), compression="snappy")
        print(f"{split}: {len(labels)} images → {out}/0000.parquet")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
