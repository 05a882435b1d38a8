#include "acc/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json.hpp"
#include "acc/util/json_strict.hpp"
#include "acc/util/logging.hpp"

namespace acc::io {

// The data section is copied to and from tensor memory as is.
static_assert(std::endian::native == std::endian::little,
              "safetensors i/o assumes a little-endian host");

namespace {

using ojson = nlohmann::ordered_json;

// The reference implementation refuses headers above this size (MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderSize = 100'000'000;

std::string sys_error() {
  return std::strerror(errno);
}

std::string quoted(const std::string& path) {
  return "safetensors file '" + path + "'";
}

// ---------------------------------------------------------------------------------------------
// byte sources for reading

class Source {
 public:
  virtual ~Source() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly n bytes at `offset`; the caller has checked the range against size().
  virtual void read(uint64_t offset, void* dst, size_t n) const = 0;
  virtual const std::string& name() const = 0;
};

class FileSource final : public Source {
 public:
  explicit FileSource(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    ACC_CHECK_AS(IoError, fd_ >= 0, "cannot open ", quoted(path_), ": ", sys_error());
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const std::string err = sys_error();
      ::close(fd_);
      ACC_THROW(IoError, "cannot stat ", quoted(path_), ": ", err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      ACC_THROW(IoError, "cannot read ", quoted(path_), ": not a regular file");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~FileSource() override { ::close(fd_); }
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

  uint64_t size() const override { return size_; }
  const std::string& name() const override { return path_; }

  void read(uint64_t offset, void* dst, size_t n) const override {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      ACC_CHECK_AS(IoError, r >= 0, "cannot read ", quoted(path_), " at byte ", offset, ": ",
                   sys_error());
      ACC_CHECK_AS(IoError, r > 0, "cannot read ", quoted(path_), " at byte ", offset,
                   ": unexpected end of file (was it truncated while reading?)");
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

class MemorySource final : public Source {
 public:
  MemorySource(std::string_view bytes, std::string name) : bytes_(bytes), name_(std::move(name)) {}
  uint64_t size() const override { return bytes_.size(); }
  const std::string& name() const override { return name_; }
  void read(uint64_t offset, void* dst, size_t n) const override {
    ACC_CHECK_INTERNAL(offset <= bytes_.size() && n <= bytes_.size() - offset,
                       "read beyond the buffer of ", quoted(name_));
    if (n > 0) std::memcpy(dst, bytes_.data() + offset, n);
  }

 private:
  std::string_view bytes_;
  std::string name_;
};

// ---------------------------------------------------------------------------------------------
// dtypes

struct DTypeInfo {
  const char* name;
  size_t size;
  bool supported;
  DType load_as;  // AutoAcc dtype of the loaded tensor (when supported)
};

// Every dtype of the safetensors spec; only the supported ones load.
constexpr DTypeInfo kDTypes[] = {
    {"F32", 4, true, DType::kFloat32},      {"BF16", 2, true, DType::kBFloat16},
    {"F16", 2, true, DType::kFloat32},      {"I32", 4, true, DType::kInt32},
    {"I64", 8, true, DType::kInt64},        {"F64", 8, false, DType::kFloat32},
    {"BOOL", 1, false, DType::kFloat32},    {"U8", 1, false, DType::kFloat32},
    {"I8", 1, false, DType::kFloat32},      {"U16", 2, false, DType::kFloat32},
    {"I16", 2, false, DType::kFloat32},     {"U32", 4, false, DType::kFloat32},
    {"U64", 8, false, DType::kFloat32},     {"F8_E5M2", 1, false, DType::kFloat32},
    {"F8_E4M3", 1, false, DType::kFloat32},
};

const DTypeInfo* find_dtype(const std::string& name) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string offsets_str(uint64_t begin, uint64_t end) {
  return detail::str_cat("[", begin, ", ", end, "]");
}

// ---------------------------------------------------------------------------------------------
// header parsing

SafetensorsEntry parse_entry(const std::string& file, const std::string& name, const ojson& v) {
  const std::string where = quoted(file) + ": tensor '" + name + "'";
  ACC_CHECK_AS(IoError, v.is_object(), where, ": entry is not a JSON object but ", v.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    ACC_CHECK_AS(IoError, v.contains(key), where, ": entry has no '", key, "'");
  }
  SafetensorsEntry e;
  e.name = name;

  const ojson& dt = v.at("dtype");
  ACC_CHECK_AS(IoError, dt.is_string(), where, ": dtype must be a string, got ", dt.dump());
  e.dtype = dt.get<std::string>();
  const DTypeInfo* info = find_dtype(e.dtype);
  ACC_CHECK_AS(IoError, info != nullptr, where, ": unknown dtype '", e.dtype, "'");
  ACC_CHECK_AS(IoError, info->supported, where, ": unsupported dtype '", e.dtype,
               "' (autoacc reads F32, BF16, F16, I32, I64)");

  const ojson& sh = v.at("shape");
  ACC_CHECK_AS(IoError, sh.is_array(), where, ": shape must be an array, got ", sh.dump());
  uint64_t numel = 1;
  bool overflow = false, has_zero = false;
  for (const ojson& d : sh) {
    ACC_CHECK_AS(IoError, d.is_number_integer(), where, ": shape ", sh.dump(),
                 " must hold integers");
    ACC_CHECK_AS(IoError, d.is_number_unsigned() || d.get<int64_t>() >= 0, where,
                 ": negative dimension ", d.dump(), " in shape ", sh.dump());
    ACC_CHECK_AS(IoError, d.is_number_unsigned() ? d.get<uint64_t>() <= INT64_MAX : true, where,
                 ": dimension ", d.dump(), " in shape ", sh.dump(), " is too large");
    const uint64_t n = d.get<uint64_t>();
    e.shape.push_back(static_cast<int64_t>(n));
    if (n == 0) has_zero = true;
    if (n != 0 && numel > UINT64_MAX / n) overflow = true;
    numel *= n;
  }
  if (has_zero) {
    overflow = false;  // a zero dimension makes any product fit
    numel = 0;
  }
  ACC_CHECK_AS(IoError, !overflow && numel <= UINT64_MAX / info->size, where, ": shape ", sh.dump(),
               " is too large");

  const ojson& off = v.at("data_offsets");
  ACC_CHECK_AS(IoError, off.is_array() && off.size() == 2, where,
               ": data_offsets must be an array [begin, end], got ", off.dump());
  for (const ojson& o : off) {
    ACC_CHECK_AS(IoError, o.is_number_unsigned(), where,
                 ": data_offsets must be non-negative integers, got ", off.dump());
  }
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  ACC_CHECK_AS(IoError, e.begin <= e.end, where, ": data_offsets ", offsets_str(e.begin, e.end),
               " have begin > end");
  const uint64_t want = numel * info->size;
  ACC_CHECK_AS(IoError, e.end - e.begin == want, where, " (dtype ", e.dtype, ", shape ",
               to_string(e.shape), ") needs ", want, " bytes but data_offsets ",
               offsets_str(e.begin, e.end), " cover ", e.end - e.begin);
  return e;
}

SafetensorsHeader parse_header(const Source& src) {
  const std::string& file = src.name();
  const uint64_t size = src.size();
  ACC_CHECK_AS(IoError, size >= 8, quoted(file), ": file has ", size,
               " bytes, too short for the 8-byte header length");
  unsigned char len[8];
  src.read(0, len, 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  ACC_CHECK_AS(IoError, n <= kMaxHeaderSize, quoted(file), ": header length ", n,
               " exceeds the limit of ", kMaxHeaderSize, " bytes (not a safetensors file?)");
  ACC_CHECK_AS(IoError, n <= size - 8, quoted(file), ": header length ", n, " is larger than the ",
               size - 8, " bytes that follow it (file truncated?)");

  std::string text(n, '\0');
  src.read(8, text.data(), n);

  // Refused while parsing, before anything else is looked at:
  // - a repeated key at any depth: nlohmann keeps the last value silently, so a repeated tensor
  //   name (or entry field, or metadata key) would drop one without a word;
  // - nesting deeper than acc::kMaxJsonDepth: no valid header nests more than 3 levels, nlohmann
  //   parses any depth, and the dump() of a bad value in an error message recursed once per level
  //   (found while writing fuzz_safetensors, by a hand-made input: a 400 KB header of '[' as a
  //   shape overflowed the stack). serde_json, behind the reference reader, stops at 128 levels
  //   too.
  //   (acc/util/json_strict.hpp parses in linear time; nlohmann's callback parser was quadratic
  //   in the number of tensors).
  struct Refusal final : detail::StrictJsonSink {
    explicit Refusal(const std::string& file) : file_(file) {}
    void syntax_error(const std::string& what) override {
      ACC_THROW(IoError, quoted(file_), ": header is not valid JSON: ", what);
    }
    void duplicate_key(const std::string& key, const std::string& pointer, size_t depth) override {
      ACC_CHECK_AS(IoError, depth != 1, quoted(file_), ": duplicate tensor name '", key,
                   "' in the header");
      ACC_THROW(IoError, quoted(file_), ": duplicate key '", key, "' in the header entry '",
                top_level_entry(pointer), "'");
    }
    void too_deep(const std::string&, size_t limit) override {
      ACC_THROW(IoError, quoted(file_), ": header nests deeper than ", limit, " levels");
    }
    // "/a~1b/shape" -> "a/b": the first segment of a JSON pointer, unescaped.
    static std::string top_level_entry(const std::string& pointer) {
      const size_t end = pointer.find('/', 1);
      std::string escaped = pointer.substr(1, end == std::string::npos ? end : end - 1), out;
      for (size_t i = 0; i < escaped.size(); ++i) {
        if (escaped[i] == '~' && i + 1 < escaped.size()) {
          out += escaped[++i] == '1' ? '/' : '~';
        } else {
          out += escaped[i];
        }
      }
      return out;
    }
    const std::string& file_;
  } refusal(file);
  const ojson header = detail::parse_strict_json<ojson>(text, kMaxJsonDepth, refusal);
  ACC_CHECK_AS(IoError, header.is_object(), quoted(file), ": header is not a JSON object but ",
               header.type_name());

  SafetensorsHeader h;
  h.header_size = n;
  h.data_size = size - 8 - n;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // tolerated as "no metadata"
      ACC_CHECK_AS(IoError, value.is_object(), quoted(file),
                   ": __metadata__ must be an object of strings, got ", value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        ACC_CHECK_AS(IoError, mv.is_string(), quoted(file), ": __metadata__ value of '", mk,
                     "' must be a string, got ", mv.dump());
        h.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    // save_safetensors refuses an empty name, so a file that loads can always be saved again.
    ACC_CHECK_AS(IoError, !key.empty(), quoted(file), ": a tensor has an empty name");
    h.entries.push_back(parse_entry(file, key, value));
  }

  // The reference reader requires the tensors to tile the data section exactly.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : h.entries) {
    const std::string where = quoted(file) + ": tensor '" + e.name + "'";
    ACC_CHECK_AS(IoError, e.end <= h.data_size, where, ": data_offsets ",
                 offsets_str(e.begin, e.end), " exceed the data section of ", h.data_size,
                 " bytes (file truncated?)");
    order.push_back(&e);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : order) {
    ACC_CHECK_AS(IoError, e->begin >= covered, quoted(file), ": tensors '", prev->name, "' ",
                 offsets_str(prev->begin, prev->end), " and '", e->name, "' ",
                 offsets_str(e->begin, e->end), " overlap in the data section");
    ACC_CHECK_AS(IoError, e->begin == covered, quoted(file), ": bytes [", covered, ", ", e->begin,
                 ") of the data section before tensor '", e->name, "' belong to no tensor");
    covered = e->end;
    if (e->end > e->begin || prev == nullptr) prev = e;
  }
  ACC_CHECK_AS(IoError, covered == h.data_size, quoted(file), ": the data section has ",
               h.data_size, " bytes but the tensors cover only ", covered);
  return h;
}

SafetensorsFile load_from(const Source& src) {
  SafetensorsHeader h = parse_header(src);
  SafetensorsFile f;
  f.path = src.name();
  f.metadata = std::move(h.metadata);
  const uint64_t data_start = 8 + h.header_size;
  for (const SafetensorsEntry& e : h.entries) {
    const DTypeInfo* info = find_dtype(e.dtype);
    Tensor t = empty(e.shape, {info->load_as, Device::kCPU, false});
    const size_t nbytes = static_cast<size_t>(e.end - e.begin);
    if (nbytes > 0) {
      if (e.dtype == "F16") {
        std::vector<uint16_t> half(nbytes / 2);
        src.read(data_start + e.begin, half.data(), nbytes);
        float* out = t.data<float>();
        for (size_t i = 0; i < half.size(); ++i) out[i] = f16_to_f32(half[i]);
      } else {
        src.read(data_start + e.begin, t.raw_data(), nbytes);
      }
    }
    f.tensors.emplace_back(e.name, std::move(t));
  }
  return f;
}

// ---------------------------------------------------------------------------------------------
// writing

void check_utf8(const std::string& s, const char* what) {
  try {
    (void)ojson(s).dump();
  } catch (const ojson::exception&) {
    ACC_THROW(ValueError, "save_safetensors: ", what, " is not valid utf-8: '", s, "'");
  }
}

struct Prepared {
  std::string header;              // padded JSON
  std::vector<Tensor> contiguous;  // in data order
  std::vector<std::string> half;   // F16 bytes of contiguous[i] when stored as F16, else empty
};

Prepared prepare(const NamedTensors& tensors, const Metadata& metadata,
                 const SaveOptions& options) {
  Prepared p;
  ojson h = ojson::object();
  if (!metadata.empty()) {
    ojson m = ojson::object();
    for (const auto& [k, v] : metadata) {
      check_utf8(k, "metadata key");
      check_utf8(v, "metadata value");
      m[k] = v;
    }
    h["__metadata__"] = std::move(m);
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    ACC_CHECK(!name.empty(), "save_safetensors: tensor ", i, " has an empty name");
    ACC_CHECK(name != "__metadata__",
              "save_safetensors: '__metadata__' is reserved and cannot name a tensor");
    check_utf8(name, "tensor name");
    ACC_CHECK(names.insert(name).second, "save_safetensors: duplicate tensor name '", name, "'");
    ACC_CHECK(t.defined(), "save_safetensors: tensor '", name, "' is undefined");
    ACC_CHECK_TYPE(!t.is_meta(), "save_safetensors: tensor '", name, "' (shape ", t.shape(),
                   ") is a meta tensor and has no data");
    Tensor c = t.detach().contiguous();
    const bool as_half = options.f32_as_f16 && c.dtype() == DType::kFloat32;
    std::string half;
    if (as_half) {
      half.resize(static_cast<size_t>(c.numel()) * 2);
      const float* src = c.numel() > 0 ? c.data<float>() : nullptr;
      const int64_t n = c.numel();
      for (int64_t k = 0; k < n; ++k) {
        const uint16_t b = f32_to_f16(src[k]);
        half[2 * k] = static_cast<char>(b & 0xff);
        half[2 * k + 1] = static_cast<char>(b >> 8);
      }
    }
    const uint64_t nbytes = as_half ? half.size() : c.nbytes();
    ojson shape = ojson::array();
    for (int64_t d : c.shape()) shape.push_back(d);
    h[name] = ojson{{"dtype", as_half ? "F16" : safetensors_dtype_name(c.dtype())},
                    {"shape", std::move(shape)},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    p.contiguous.push_back(std::move(c));
    p.half.push_back(std::move(half));
  }
  p.header = h.dump();
  p.header.append((8 - p.header.size() % 8) % 8, ' ');
  return p;
}

// Writes the whole file through `sink`.
void write_to(const Prepared& p, const std::function<void(const void*, size_t)>& sink) {
  unsigned char len[8];
  uint64_t n = p.header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  sink(len, 8);
  sink(p.header.data(), p.header.size());
  for (size_t i = 0; i < p.contiguous.size(); ++i) {
    const Tensor& t = p.contiguous[i];
    if (!p.half[i].empty()) {
      sink(p.half[i].data(), p.half[i].size());
    } else if (t.nbytes() > 0) {
      sink(t.raw_data(), t.nbytes());
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public API

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "F32";
    case DType::kBFloat16:
      return "BF16";
    case DType::kInt32:
      return "I32";
    case DType::kInt64:
      return "I64";
  }
  ACC_THROW(InternalError, "safetensors_dtype_name: unhandled dtype ", static_cast<int>(dtype));
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    bits = sign | std::bit_cast<uint32_t>(magnitude);
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, or NaN keeping its payload
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // rebias 15 -> 127
  }
  return std::bit_cast<float>(bits);
}

uint16_t f32_to_f16(float value) {
  const uint32_t x = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {
    // Subnormal or zero in half: value = m * 2^-24 with m rounded to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 113 - exp + 13
    uint32_t m = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  // Normal: rebias 127 -> 15 and round the 13 dropped bits to nearest even.
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  ACC_THROW(ValueError, "no tensor named '", name, "' in ", quoted(path), " (", tensors.size(),
            " tensors)");
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const auto& p) { return p.first == name; });
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors.size());
  for (const auto& p : tensors) out.push_back(p.first);
  return out;
}

std::string serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata,
                                  const SaveOptions& options) {
  const Prepared p = prepare(tensors, metadata, options);
  std::string out;
  write_to(p, [&](const void* data, size_t n) { out.append(static_cast<const char*>(data), n); });
  return out;
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const Metadata& metadata, const SaveOptions& options) {
  const Prepared p = prepare(tensors, metadata, options);  // validate before touching the disk

  // A save killed mid-write (SIGKILL) leaves its temporary file: the next save of the path
  // removes those whose process is gone.
  for (const auto& stale : remove_stale_temp_files(path)) {
    logging::info("removed '{}', left by an interrupted save of '{}'", stale, path);
  }
  const std::string tmp = temp_file_for(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  ACC_CHECK_AS(IoError, fd >= 0, "cannot save ", quoted(path), ": cannot create '", tmp,
               "': ", sys_error());
  auto fail = [&](const std::string& what) {
    const std::string err = sys_error();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    ACC_THROW(IoError, "cannot save ", quoted(path), ": ", what, ": ", err);
  };
  write_to(p, [&](const void* data, size_t n) {
    const char* c = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("write to '" + tmp + "' failed");
      c += w;
      n -= static_cast<size_t>(w);
    }
  });
  if (::fsync(fd) != 0) fail("fsync of '" + tmp + "' failed");
  const int rc = ::close(fd);
  fd = -1;
  if (rc != 0) fail("close of '" + tmp + "' failed");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename of '" + tmp + "' failed");

  // Make the rename itself durable; a failure here loses nothing already written.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}

SafetensorsFile load_safetensors(const std::string& path) {
  return load_from(FileSource(path));
}

SafetensorsFile deserialize_safetensors(std::string_view bytes, const std::string& name) {
  return load_from(MemorySource(bytes, name));
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  return parse_header(FileSource(path));
}

std::vector<std::string> list_safetensors(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& e : read_safetensors_header(path).entries) out.push_back(e.name);
  return out;
}

}  // namespace acc::io
