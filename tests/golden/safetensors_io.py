"""Minimal safetensors reader/writer (no dependency on the `safetensors` package).

File layout:
  8 bytes   little-endian u64 N = header length
  N bytes   JSON header {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
            ..., "__metadata__": {str: str}}, padded with trailing spaces to a multiple of 8
  data      raw little-endian tensor bytes, back to back in header order; offsets are relative
            to the first byte after the header
"""

import json
import struct
import sys

import torch

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}
_NAMES = {v: k for k, v in _DTYPES.items()}

if sys.byteorder != "little":
    raise RuntimeError("safetensors_io: only little-endian hosts are supported")


def _tensor_bytes(t):
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def save_file(tensors, path, metadata=None):
    """Write an ordered dict name -> tensor. Tensors are stored in the given order."""
    header = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"safetensors_io: unsupported dtype {t.dtype} for {name}")
        data = _tensor_bytes(t)
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for data in blobs:
            f.write(data)


def load_file(path):
    """Return (dict name -> tensor in file order, metadata dict)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        buf = bytearray(raw[base + begin:base + end])
        if len(buf) == 0:
            t = torch.empty(info["shape"], dtype=dtype)
        else:
            t = torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])
        out[name] = t
    return out, metadata


def _self_test():
    """Round-trip every dtype, including 0-d and empty tensors, and check the raw layout with
    numpy independently of load_file."""
    import os
    import tempfile

    import numpy as np

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).to(torch.float16),
        "i64": torch.tensor([[1, -2, 3], [2**40, 5, -(2**50)]], dtype=torch.int64),
        "i32": torch.tensor([7, -8, 2**30], dtype=torch.int32),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.safetensors")
        save_file(tensors, path, {"k": "v"})
        back, meta = load_file(path)
        raw = open(path, "rb").read()
    assert meta == {"k": "v"} and list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    b, e = header["f32"]["data_offsets"]
    ref = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<f4").reshape(3, 5)
    assert np.array_equal(ref, tensors["f32"].numpy())
    b, e = header["i64"]["data_offsets"]
    ref = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<i8").reshape(2, 3)
    assert np.array_equal(ref, tensors["i64"].numpy())
    b, e = header["bf16"]["data_offsets"]
    hi = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<u2").astype("<u4") << 16
    assert np.array_equal(hi.view("<f4"), tensors["bf16"].float().numpy())
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == c[0] for a, c in zip(ends, ends[1:]))
    assert len(raw) == 8 + n + ends[-1][1]
    print("safetensors_io self-test ok")


if __name__ == "__main__":
    _self_test()
