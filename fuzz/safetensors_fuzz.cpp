// libFuzzer target: the safetensors reader (acc::io::deserialize_safetensors, the code behind
// load_safetensors) on arbitrary bytes. A malformed file must be an acc::IoError; anything else
// escaping, a crash or a sanitizer report is a finding. A file that loads must save and load back
// to the same names, metadata, dtypes, shapes and bytes (F16 loads as f32 and saves as F32, exact).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "acc/io/safetensors.hpp"
#include "acc/util/error.hpp"

namespace {

void require(bool cond, const char* what) {
  if (!cond) {
    std::fprintf(stderr, "safetensors_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  acc::io::SafetensorsFile f;
  try {
    f = acc::io::deserialize_safetensors(
        std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const acc::IoError&) {
    return 0;  // refused by name: the expected outcome for most inputs
  }
  const std::string bytes = acc::io::serialize_safetensors(f.tensors, f.metadata);
  const acc::io::SafetensorsFile g = acc::io::deserialize_safetensors(bytes, "round trip");
  require(g.names() == f.names(), "names differ after a round trip");
  require(g.metadata == f.metadata, "metadata differs after a round trip");
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    const acc::Tensor& a = f.tensors[i].second;
    const acc::Tensor& b = g.tensors[i].second;
    require(a.dtype() == b.dtype() && a.shape() == b.shape(), "dtype or shape differs");
    require(a.nbytes() == b.nbytes(), "byte size differs");
    require(a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0,
            "tensor bytes differ after a round trip");
  }
  return 0;
}
