#include "acc/checkpoint/load.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "acc/checkpoint/layout.hpp"
#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "acc/util/progress.hpp"
#include "entries.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;

using detail::range_of;
using detail::saved_kind;
using dist::PlacementEntry;

Metadata read_metadata(const std::string& step_dir) {
  const StepFile file = StepFile::open(step_dir, "metadata.json");
  ACC_CHECK_AS(IoError, file.size() <= kMaxMetadataBytes, "checkpoint: '", file.path(),
               "': ", file.size(), " bytes is over the limit of ", kMaxMetadataBytes,
               " bytes for a metadata.json");
  Metadata m = parse_metadata(file.read_all(), file.path());
  // Readers order steps by their directories' names: a name that disagrees with the metadata
  // would be found as another step than it is. (A copy under another name is the user's own.)
  std::string name = fs::path(step_dir).filename().string();
  if (name.empty()) name = fs::path(step_dir).parent_path().filename().string();  // "step-2/"
  const std::optional<int64_t> named = step_of_dir_name(name);
  ACC_CHECK(!named || *named == m.step, "checkpoint '", step_dir, "' is named ", name,
            " but its metadata says step ", m.step, ": it would be taken for another step");
  return m;
}

namespace {

// The placement entries load() fills and, for each, the checkpoint's tensor; checked to fit.
std::vector<std::pair<const PlacementEntry*, const TensorInfo*>> loaded_entries(
    const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table) {
  std::vector<std::pair<const PlacementEntry*, const TensorInfo*>> out;
  for (const PlacementEntry& e : table) {
    if (!saved_kind(e.kind) || range_of(e).length == 0) continue;
    const TensorInfo* t = meta.find(e.name);
    ACC_CHECK(t != nullptr, "checkpoint '", step_dir, "' has no tensor '", e.name,
              "' (another model or optimizer?)");
    ACC_CHECK_SHAPE(t->shape == e.global_shape, "checkpoint '", step_dir, "': '", e.name,
                    "' has shape ", to_string(t->shape), ", this model's is ",
                    to_string(e.global_shape));
    ACC_CHECK_TYPE(t->dtype == e.dtype, "checkpoint '", step_dir, "': '", e.name, "' is ", t->dtype,
                   ", this run's is ", e.dtype);
    ACC_CHECK(e.local.defined() && e.local.numel() == range_of(e).length && e.local.is_contiguous(),
              "checkpoint: '", e.name, "' has no contiguous local tensor of ", range_of(e).length,
              " elements to load into");
    out.emplace_back(&e, t);
  }
  return out;
}

bool overlaps(const PlacementEntry& e, const ChunkInfo& c) {
  return std::max(range_of(e).offset, c.offset) <
         std::min(range_of(e).offset + range_of(e).length, c.offset + c.length);
}

// Reads items 0..n-1 in order on its own thread, a few ahead of the consumer: get(i) waits for
// item i (rethrowing the read's error as acc::IoError), done(i) gives its buffer back. The
// destructor stops the thread, also when the consumer threw.
class ChunkReader {
 public:
  using ReadFn = std::function<void(size_t, std::vector<char>&)>;
  ChunkReader(size_t n, ReadFn read) : n_(n), read_(std::move(read)), slots_(kSlots) {
    thread_ = std::thread([this] { run(); });
  }
  ~ChunkReader() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  const std::vector<char>& get(size_t i) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return read_count_ > i || !error_.empty(); });
    ACC_CHECK_AS(IoError, read_count_ > i, error_);
    return slots_[i % kSlots];
  }
  void done(size_t i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_count_ = i + 1;
    }
    cv_.notify_all();
  }

 private:
  static constexpr size_t kSlots = 4;
  void run() {
    for (size_t i = 0; i < n_; ++i) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || i < done_count_ + kSlots; });
        if (stop_) return;
      }
      std::string error;
      try {
        read_(i, slots_[i % kSlots]);  // the slot is the reader's until read_count_ passes i
      } catch (const std::exception& e) {
        error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (error.empty()) {
          read_count_ = i + 1;
        } else {
          error_ = error;
        }
      }
      cv_.notify_all();
      if (!error.empty()) return;
    }
  }

  const size_t n_;
  ReadFn read_;
  std::vector<std::vector<char>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t read_count_ = 0, done_count_ = 0;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

}  // namespace

void load(const std::string& step_dir, const Metadata& meta, const dist::PlacementTable& table) {
  progress::phase(progress::Phase::kLoad,
                  [&] { return "checkpoint step " + std::to_string(meta.step); });
  const auto entries = loaded_entries(step_dir, meta, table);
  // The chunks this rank reads, in order, and their files, opened (a missing one named).
  struct Read {
    const PlacementEntry* entry;
    const ChunkInfo* chunk;
  };
  std::vector<Read> reads;
  std::map<int, StepFile> files;
  for (const auto& [e, t] : entries) {
    for (const ChunkInfo& c : t->chunks) {
      if (!overlaps(*e, c)) continue;
      reads.push_back({e, &c});
      if (files.count(c.file) == 0) {
        files.emplace(c.file, StepFile::open(step_dir, meta.files.at(static_cast<size_t>(c.file))));
      }
    }
  }
  // A second thread reads the chunks ahead (a few buffers) while this one checksums and
  // decompresses them: in one thread the disk waited for those (0.7-0.8 of its cold-read rate).
  // (posix_fadvise WILLNEED ahead of the reads made loads 30% slower on this VM's disk.)
  ChunkReader reader(reads.size(), [&](size_t i, std::vector<char>& into) {
    const ChunkInfo& c = *reads[i].chunk;
    const StepFile& f = files.at(c.file);
    const std::string& where = meta.files.at(static_cast<size_t>(c.file));
    ACC_CHECK_AS(IoError, c.byte_offset + c.byte_length <= f.size(), "checkpoint '", step_dir,
                 "': shard '", where, "' is truncated: '", reads[i].entry->name, "' chunk at byte ",
                 c.byte_offset, " needs ", c.byte_length, " bytes, the file has ", f.size());
    into.resize(static_cast<size_t>(c.byte_length));
    f.read_at(c.byte_offset, into.data(), c.byte_length);
  });
  NoGradGuard no_grad;
  std::vector<char> raw;
  for (size_t i = 0; i < reads.size(); ++i) {
    const PlacementEntry& e = *reads[i].entry;
    const ChunkInfo& c = *reads[i].chunk;
    const std::vector<char>& stored = reader.get(i);
    char* dst = static_cast<char*>(e.local.raw_data());
    const int64_t elem = static_cast<int64_t>(element_size(e.dtype));
    const int64_t lo = range_of(e).offset, hi = range_of(e).offset + range_of(e).length;
    const int64_t a = std::max(lo, c.offset), b = std::min(hi, c.offset + c.length);
    const std::string what = "checkpoint '" + step_dir + "': '" + e.name + "' chunk in '" +
                             meta.files.at(static_cast<size_t>(c.file)) + "'";
    if (a == c.offset && b == c.offset + c.length) {  // the whole chunk: straight into place
      decode_chunk_into(stored.data(), stored.size(), c, e.dtype, what, dst + (a - lo) * elem);
    } else {
      decode_chunk(stored.data(), stored.size(), c, e.dtype, what, raw);
      std::memcpy(dst + (a - lo) * elem, raw.data() + (a - c.offset) * elem,
                  static_cast<size_t>((b - a) * elem));
    }
    reader.done(i);
  }
}

}  // namespace acc::ckpt
