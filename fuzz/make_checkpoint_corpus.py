#!/usr/bin/env python3
"""Writes fuzz_checkpoint's format-version-2 seeds: fuzz/corpus/checkpoint/boxes_v2.json (metadata
only) and boxes_v2.bin (metadata, a NUL, then the shard), a one-rank checkpoint of hand-made box
layouts with real zstd frames and xxh64 checksums (libzstd and libxxhash through ctypes):

  col     [4, 6] f32   two column blocks (a Megatron column split)
  qkv     [6, 2] f32   three row boxes (a fused q|k|v block's pieces)
  zero    [4, 6] f32   box [0:4, 0:3] split flat in two (ZeRO over a tensor-parallel box), and
                       box [0:4, 3:6] whole
  scalar  []     f32   one chunk of the one element
  half    [8]    bf16  one chunk

    python3 fuzz/make_checkpoint_corpus.py        (from the repository's root)

The version-1 seeds beside them (metadata_only.json, small.bin) came from a checkpoint written by
the version-1 writer.
"""

import ctypes
import json
import os
import struct

ZSTD = ctypes.CDLL("libzstd.so.1")
ZSTD.ZSTD_compressBound.restype = ctypes.c_size_t
ZSTD.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
ZSTD.ZSTD_compress.restype = ctypes.c_size_t
ZSTD.ZSTD_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_int]
XXH = ctypes.CDLL("libxxhash.so.0")
XXH.XXH64.restype = ctypes.c_uint64
XXH.XXH64.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]


def compress(raw):
    out = ctypes.create_string_buffer(ZSTD.ZSTD_compressBound(len(raw)))
    n = ZSTD.ZSTD_compress(out, len(out), raw, len(raw), 1)
    return out.raw[:n]


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def region_values(shape, offsets, sizes, flat, base):
    """The region's elements in row-major order; element i of the tensor holds base + i."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    idx = [[]]
    for k in range(len(shape)):
        idx = [p + [offsets[k] + i] for p in idx for i in range(sizes[k])]
    values = [base + sum(c * s for c, s in zip(p, strides)) for p in idx]
    if flat:
        values = values[flat[0]:flat[0] + flat[1]]
    return values


def main():
    tensors = [
        ("col", [4, 6], [([0, 0], [4, 3], None), ([0, 3], [4, 3], None)]),
        ("qkv", [6, 2], [([0, 0], [2, 2], None), ([2, 0], [2, 2], None), ([4, 0], [2, 2], None)]),
        ("zero", [4, 6], [([0, 0], [4, 3], (0, 5)), ([0, 0], [4, 3], (5, 7)),
                          ([0, 3], [4, 3], None)]),
        ("scalar", [], [([], [], None)]),
    ]
    shard = b""
    meta_tensors = []
    for n, (name, shape, regions) in enumerate(tensors):
        chunks = []
        for offsets, sizes, flat in regions:
            stored = compress(f32(region_values(shape, offsets, sizes, flat, 100.0 * n)))
            chunk = {"file": 0, "offsets": offsets, "sizes": sizes}
            if flat:
                chunk["flat"] = {"offset": flat[0], "length": flat[1]}
            chunk.update({"byte_offset": len(shard), "byte_length": len(stored),
                          "xxh64": "%016x" % XXH.XXH64(stored, len(stored), 0)})
            chunks.append(chunk)
            shard += stored
        meta_tensors.append({"name": name, "kind": "parameter", "param": name, "field": "",
                             "shape": shape, "dtype": "f32", "chunks": chunks})
    half = struct.pack("<8H", *[0x3f80 + i for i in range(8)])  # bf16 1.0, ...
    stored = compress(half)
    meta_tensors.append({"name": "state.half.exp_avg", "kind": "optimizer_state",
                         "param": "half", "field": "exp_avg", "shape": [8], "dtype": "bf16",
                         "chunks": [{"file": 0, "offsets": [0], "sizes": [8],
                                     "byte_offset": len(shard), "byte_length": len(stored),
                                     "xxh64": "%016x" % XXH.XXH64(stored, len(stored), 0)}]})
    shard += stored
    meta = {"format": "autoacc-checkpoint", "version": 2, "step": 3, "world": 1,
            "model_trace_hash": "0123456789abcdef", "strategy": [{"name": "zero2"}],
            "extra": {"optimizer_steps": {"col": 3}}, "files": ["shard-00000.bin"],
            "tensors": meta_tensors}
    text = json.dumps(meta).encode()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "checkpoint")
    with open(os.path.join(out, "boxes_v2.json"), "wb") as f:
        f.write(text)
    with open(os.path.join(out, "boxes_v2.bin"), "wb") as f:
        f.write(text + b"\0" + shard)


if __name__ == "__main__":
    main()
