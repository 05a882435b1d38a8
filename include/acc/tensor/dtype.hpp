#pragma once
// Element types and devices.

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>

namespace acc {

enum class DType : uint8_t { kFloat32, kBFloat16, kInt32, kInt64 };

/// kCPU tensors own host memory; kMeta tensors carry shape, strides and dtype and no memory at all,
/// so a 175B-parameter model can be built and traced for free.
enum class Device : uint8_t { kCPU, kMeta };

constexpr size_t element_size(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

/// Short lower-case names used in messages and files: f32, bf16, i32, i64.
const char* dtype_name(DType t);
const char* device_name(Device d);
/// Parses "f32", "float32", "bf16", "bfloat16", "i32", "int32", "i64", "int64"; throws
/// acc::ValueError.
DType parse_dtype(const std::string& name);
bool is_floating(DType t);

inline std::ostream& operator<<(std::ostream& os, DType t) {
  return os << dtype_name(t);
}
inline std::ostream& operator<<(std::ostream& os, Device d) {
  return os << device_name(d);
}

/// bfloat16 storage: the upper 16 bits of an IEEE float. Conversion from float rounds to nearest
/// even (as PyTorch does); NaN stays NaN.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  explicit BFloat16(float f) : bits(round_from_float(f)) {}
  operator float() const { return to_float(bits); }

  static uint16_t round_from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
    uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>((u + rounding_bias) >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(BFloat16) == 2);

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = DType::kBFloat16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::kInt64;
};

}  // namespace acc
