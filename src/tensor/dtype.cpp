#include "acc/tensor/dtype.hpp"

#include "acc/util/error.hpp"

namespace acc {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "f32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
  }
  return "?";
}

const char* device_name(Device d) {
  return d == Device::kCPU ? "cpu" : "meta";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::kFloat32;
  if (name == "bf16" || name == "bfloat16") return DType::kBFloat16;
  if (name == "i32" || name == "int32") return DType::kInt32;
  if (name == "i64" || name == "int64") return DType::kInt64;
  ACC_THROW(ValueError, "unknown dtype '", name, "' (expected f32, bf16, i32 or i64)");
}

bool is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16;
}

}  // namespace acc
