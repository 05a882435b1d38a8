#pragma once
// safetensors files, the format PyTorch and Hugging Face use to exchange weights
// (https://github.com/huggingface/safetensors). Layout:
//
//   [8 bytes]  N, little-endian u64
//   [N bytes]  UTF-8 JSON header, padded with spaces to a multiple of 8:
//              {"__metadata__": {"k": "v"},
//               "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//   [rest]     the data section; data_offsets are relative to its start, every tensor is stored
//              row-major and little-endian
//
// Writing follows the reference implementation byte for byte except for two orders: the data
// section (and header) keep the caller's order (the reference sorts by dtype, then name), and
// metadata keys are sorted (the reference writes a hash map in arbitrary order). As there:
// compact JSON, "__metadata__" first and omitted when empty, entry fields in the order dtype,
// shape, data_offsets, and space padding.
//
// Reading is as strict as the reference reader (the Rust crate behind the `safetensors` Python
// package), so a file AutoAcc accepts is one PyTorch users can load too: sorted by begin, the
// tensors must tile the data section exactly, with no overlap, no gap and no trailing bytes.
// Zero-byte tensors may sit at any boundary. Every violation is an acc::IoError naming the file
// and the problem.
//
// Dtypes: F32, BF16, I32 and I64 load as f32, bf16, i32 and i64; F16 (no AutoAcc dtype) is
// converted to f32 exactly. Other safetensors dtypes (F64, U8, BOOL, ...) are rejected by name.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::io {

/// Ordered (name, tensor) pairs. When saving, this order is the order of the header entries and
/// of the data section; when loading, it is the order of the file's header.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// String-to-string metadata stored under "__metadata__".
using Metadata = std::map<std::string, std::string>;

/// One header entry as stored in the file.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // safetensors spelling: "F32", "BF16", "F16", "I32", "I64"
  Shape shape;
  uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  uint64_t end = 0;
};

/// The validated header of a file, without the tensor data.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in header order
  Metadata metadata;
  uint64_t header_size = 0;  // N: bytes of JSON including the padding
  uint64_t data_size = 0;    // bytes of the data section
};

/// A loaded file. Tensors are contiguous CPU tensors that own their memory.
struct SafetensorsFile {
  std::string path;  // the path it was loaded from (or the name given to deserialize)
  NamedTensors tensors;
  Metadata metadata;

  /// The tensor called `name`. Throws acc::ValueError naming the file when there is none.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
  /// Tensor names in file order.
  std::vector<std::string> names() const;
};

/// Writes `tensors` (any strides, written in logical row-major order) and `metadata` to `path`
/// atomically: a temporary file in the same directory is written, flushed to disk and renamed
/// over `path`, so a reader never sees a partial file and a failed save leaves nothing behind.
/// Throws acc::ValueError on an empty, duplicate or non-UTF-8 name (or the reserved
/// "__metadata__"), an undefined tensor or non-UTF-8 metadata; acc::TypeError on a meta tensor;
/// acc::IoError naming the path and the system error when writing fails.
struct SaveOptions {
  /// Store f32 tensors as F16 (round to nearest even; overflow becomes inf), halving the file,
  /// e.g. for weights handed to tools that want half precision. Other dtypes are unaffected.
  bool f32_as_f16 = false;
};

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata = {}, const SaveOptions& options = {});

/// The bytes save_safetensors() would write. Throws what save_safetensors() throws for bad
/// arguments.
std::string serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata = {},
                                  const SaveOptions& options = {});

/// Loads every tensor of a file. Throws acc::IoError naming the path and the problem when the
/// file is missing or unreadable (with the system error) or malformed: shorter than 8 bytes, a
/// header length beyond the file or above 100 MB, a header that is not a JSON object, an entry
/// without dtype/shape/data_offsets, an unknown or unsupported dtype, a negative dimension,
/// data_offsets with begin > end or beyond the data section, a byte size that does not match
/// shape x dtype size, overlapping or non-contiguous tensors, an empty name (save_safetensors
/// refuses it too), a duplicate name or any key repeated in an entry or the metadata, or JSON
/// nested deeper than acc::kMaxJsonDepth.
SafetensorsFile load_safetensors(const std::string& path);

/// load_safetensors() from bytes in memory; `name` stands for the path in messages.
SafetensorsFile deserialize_safetensors(std::string_view bytes,
                                        const std::string& name = "<memory>");

/// Reads and validates only the header (cheap for a large file). Throws what load_safetensors()
/// throws.
SafetensorsHeader read_safetensors_header(const std::string& path);

/// Tensor names of a file in header order. Throws what load_safetensors() throws.
std::vector<std::string> list_safetensors(const std::string& path);

/// The safetensors spelling of an AutoAcc dtype: F32, BF16, I32, I64.
const char* safetensors_dtype_name(DType dtype);

/// IEEE 754 binary16 to float, exact for every input (subnormals, infinities; NaN stays NaN with
/// its payload).
float f16_to_f32(uint16_t bits);
/// float to IEEE 754 binary16, rounding to nearest even; overflow gives inf, NaN stays NaN.
uint16_t f32_to_f16(float value);

}  // namespace acc::io
