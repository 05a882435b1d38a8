#!/usr/bin/python3
"""Writes tests/io/data/torch_written.safetensors from tensors made by PyTorch.

Debian's python3-torch has no `safetensors` package, so the file is written by hand following
the spec and the reference implementation's conventions: tensors sorted by dtype (widest enum
value first) then name, "__metadata__" first in the header, compact JSON, header padded with
spaces to a multiple of 8. The tensor bytes are PyTorch's own storage bytes, so the C++ test
(tests/io/safetensors_test.cpp, TorchInterop) checks AutoAcc against values produced by torch.

Run with: /usr/bin/python3 tests/io/make_torch_file.py
"""

import json
import os
import struct

import torch

# Order of the reference implementation's Dtype enum; data is sorted by it, descending.
DTYPE_ORDER = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32",
               "U32", "F32", "F64", "I64", "U64"]
NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
         torch.int64: "I64"}


def tensor_bytes(t):
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    if t.dtype == torch.float16:
        return t.numpy().astype("<f2").tobytes()
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()


def save(path, tensors, metadata):
    items = sorted(tensors.items(), key=lambda kv: (-DTYPE_ORDER.index(NAMES[kv[1].dtype]), kv[0]))
    header = {"__metadata__": metadata}
    data = b""
    for name, t in items:
        b = tensor_bytes(t)
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def main():
    torch.manual_seed(0)
    tensors = {
        # Rounded by torch from float32: the C++ test checks AutoAcc rounds the same way.
        "bf16": torch.tensor([1.0, -0.1, 3.14159265, 65504.0, 1e-3], dtype=torch.bfloat16),
        # 2^-24 is the smallest subnormal; 0.1 is inexact in half precision.
        "f16": torch.tensor([1.0, -2.0, 0.1, 65504.0, 2.0**-24, float("inf"), float("-inf"),
                             float("nan"), -0.0], dtype=torch.float16),
        "f32.matrix": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5 - 1.0,
        # Stored in logical order: column-major storage of [[0, 1, 2, 3], [4, ...]].t().
        "f32.transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "f32.randn": torch.randn(2, 3),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "i32": torch.tensor([[1, -2], [3, 2**31 - 1]], dtype=torch.int32),
        "i64": torch.tensor([-(2**40), 0, 2**62 + 1], dtype=torch.int64),
    }
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                       "torch_written.safetensors")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save(out, tensors, {"format": "pt", "producer": "torch " + torch.__version__})
    # The values the C++ test asserts for the random tensor.
    print("f32.randn", [float(x) for x in tensors["f32.randn"].flatten()])
    print("bf16", [float(x) for x in tensors["bf16"].float()])
    print("wrote", out)


if __name__ == "__main__":
    main()
