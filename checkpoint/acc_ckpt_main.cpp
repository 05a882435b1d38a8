// acc-ckpt: look into, check and convert sharded checkpoints (checkpoint/README.md).
//
//   acc-ckpt inspect DIR                          step, layout, every tensor and its chunks
//   acc-ckpt verify DIR                           every checksum and chunk; exit 1 on any fault
//   acc-ckpt export-safetensors DIR OUT.safetensors    the full model weights
//   acc-ckpt import-safetensors IN.safetensors DIR --model gpt --config FILE [--step N] [--force]
//
// DIR is a step directory or a checkpoint root (then its newest committed step). Exit codes: 0
// done, 1 a fault (named), 2 a bad command line. What the tools write is written atomically
// (temporary file or directory, fsync, rename) and never inside a checkpoint they read: export's
// output may not lie inside any checkpoint, import writes under the root's lock and only into a
// root without committed steps (--force deletes them first).

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/dist.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/util/cli.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/json.hpp"

namespace {

using namespace acc;
namespace fs = std::filesystem;

std::string step_dir(const std::string& dir) {
  const auto d = ckpt::resolve(dir);
  ACC_CHECK_AS(IoError, d.has_value(), "'", dir, "' holds no committed checkpoint");
  return *d;
}

// The step's files opened once each; a file that cannot be opened keeps its error for every chunk
// that needs it.
class StepFiles {
 public:
  StepFiles(std::string dir, const ckpt::Metadata& m) : dir_(std::move(dir)), m_(m) {}
  const ckpt::StepFile& at(int index) {
    auto it = files_.find(index);
    if (it == files_.end()) {
      try {
        it =
            files_
                .emplace(index, ckpt::StepFile::open(dir_, m_.files.at(static_cast<size_t>(index))))
                .first;
      } catch (const Error& e) {
        errors_[index] = e.what();
      }
    }
    ACC_CHECK_AS(IoError, it != files_.end(), errors_.at(index));
    return it->second;
  }

 private:
  std::string dir_;
  const ckpt::Metadata& m_;
  std::map<int, ckpt::StepFile> files_;
  std::map<int, std::string> errors_;
};

int inspect(const std::string& dir_arg) {
  const std::string dir = step_dir(dir_arg);
  const ckpt::Metadata m = ckpt::read_metadata(dir);
  std::printf("%s: step %lld, written by %d rank(s), format version %d, strategy %s, model %s\n",
              dir.c_str(), static_cast<long long>(m.step), m.world, m.version,
              m.strategy.dump().c_str(), m.model_trace_hash.c_str());
  int64_t stored = 0, raw = 0;
  std::map<int, int64_t> per_file;
  std::printf("%-56s %-15s %-14s %-5s %7s %12s\n", "tensor", "kind", "shape", "dtype", "chunks",
              "stored");
  for (const auto& t : m.tensors) {
    int64_t bytes = 0;
    for (const auto& c : t.chunks) {
      bytes += c.byte_length;
      per_file[c.file] += c.byte_length;
    }
    stored += bytes;
    raw += t.numel() * static_cast<int64_t>(element_size(t.dtype));
    std::printf("%-56s %-15s %-14s %-5s %7zu %12s\n", t.name.c_str(),
                dist::tensor_kind_name(t.kind), to_string(t.shape).c_str(), dtype_name(t.dtype),
                t.chunks.size(), trace::human_bytes(static_cast<double>(bytes)).c_str());
  }
  StepFiles files(dir, m);
  for (size_t i = 0; i < m.files.size(); ++i) {
    std::string on_disk;
    try {
      on_disk = trace::human_bytes(static_cast<double>(files.at(static_cast<int>(i)).size())) +
                " on disk";
    } catch (const IoError& e) {
      on_disk = e.what();
    }
    std::printf("%s: %s of chunks, %s\n", m.files[i].c_str(),
                trace::human_bytes(static_cast<double>(per_file[static_cast<int>(i)])).c_str(),
                on_disk.c_str());
  }
  std::printf("%zu tensors, %s of data stored in %s (zstd ratio %.2f)\n", m.tensors.size(),
              trace::human_bytes(static_cast<double>(raw)).c_str(),
              trace::human_bytes(static_cast<double>(stored)).c_str(),
              stored > 0 ? static_cast<double>(raw) / static_cast<double>(stored) : 0.0);
  return 0;
}

int verify(const std::string& dir_arg) {
  const std::string dir = step_dir(dir_arg);
  ckpt::Metadata m;
  try {
    m = ckpt::read_metadata(dir);
  } catch (const Error& e) {
    std::printf("FAULT %s\n", e.what());
    return 1;
  }
  int faults = 0;
  int64_t chunks = 0;
  std::vector<char> stored, raw;
  StepFiles files(dir, m);
  for (const auto& t : m.tensors) {
    for (const auto& c : t.chunks) {
      ++chunks;
      const fs::path file = fs::path(dir) / m.files.at(static_cast<size_t>(c.file));
      const std::string where = file.string() + " ('" + t.name + "')";
      try {
        const ckpt::StepFile& f = files.at(c.file);
        ACC_CHECK_AS(IoError, c.byte_offset + c.byte_length <= f.size(), where,
                     ": the shard is truncated (", f.size(), " bytes, the chunk ends at ",
                     c.byte_offset + c.byte_length, ")");
        stored.resize(static_cast<size_t>(c.byte_length));
        f.read_at(c.byte_offset, stored.data(), c.byte_length);
        ckpt::decode_chunk(stored.data(), stored.size(), c, t.dtype, where, raw);
      } catch (const Error& e) {
        std::printf("FAULT %s\n", e.what());
        ++faults;
      }
    }
  }
  if (faults > 0) {
    std::printf("%s: %d of %lld chunks faulty\n", dir.c_str(), faults,
                static_cast<long long>(chunks));
    return 1;
  }
  std::printf("%s: ok, %lld chunks of %zu tensors verified (metadata, sizes, xxh64, zstd)\n",
              dir.c_str(), static_cast<long long>(chunks), m.tensors.size());
  return 0;
}

int export_safetensors(const std::string& dir_arg, const std::string& out) {
  check_output_path(out, "export-safetensors OUT");
  ckpt::check_outside_checkpoints(out, "export-safetensors OUT");
  const std::string dir = step_dir(dir_arg);
  const size_t n = ckpt::export_safetensors(dir, out);
  std::printf("wrote %zu tensors of %s to %s\n", n, dir.c_str(), out.c_str());
  return 0;
}

// A file made by export-safetensors or train_gpt --save names its model in its metadata: the
// weights of an n_head 2 model load into an n_head 4 one (the shapes agree) and train as another
// model, so the file's config is compared with --config field by field. A file without them (from
// PyTorch) cannot be checked.
void check_file_config(const std::string& in, const io::Metadata& meta,
                       const std::string& model_type, const models::LanguageModel& model) {
  const std::string what = "import-safetensors '" + in + "'";
  if (const auto it = meta.find("model_type"); it != meta.end()) {
    ACC_CHECK(it->second == model_type, what, " holds a ", it->second,
              " model (its metadata's model_type), not --model ", model_type);
  }
  const auto it = meta.find("config");
  if (it == meta.end()) return;
  nlohmann::json saved;
  try {
    saved = parse_json(it->second, what + ": its metadata's config");
    // Its defaults filled in as --config's are, so that a field left out compares as its value.
    saved =
        models::create_meta_model(model_type, saved, models::config_num_layers(model_type, saved))
            ->config_json();
  } catch (const ValueError& e) {
    ACC_THROW(ValueError, what, ": its metadata's config is not a valid ", model_type,
              " config: ", e.what());
  }
  const nlohmann::json given = model.config_json();  // items() must not outlive it
  for (const auto& [key, value] : given.items()) {
    const auto s = saved.find(key);
    ACC_CHECK(s != saved.end() && *s == value, what, " was saved with ", key, " = ",
              s == saved.end() ? std::string("(absent)") : s->dump(), ", --config has ", key, " = ",
              value.dump(), ": import with the file's own config");
  }
}

int import_safetensors(const std::string& in, const std::string& dir, const std::string& model_type,
                       const std::string& config_file, int64_t step, bool force) {
  const nlohmann::json config = read_json_file(config_file, "--config");
  auto model = models::create_model(model_type, config);
  const io::SafetensorsFile file = io::load_safetensors(in);
  check_file_config(in, file.metadata, model_type, *model);
  try {
    model->load_pretrained(file.tensors);
  } catch (const ValueError& e) {
    ACC_THROW(ValueError, "import-safetensors '", in, "': ", e.what());
  }
  // DIR is a root of its own: inside another checkpoint (a step directory, a root's subdirectory)
  // it would nest a checkpoint in one that readers and --force treat as theirs.
  fs::path abs = fs::absolute(dir).lexically_normal();
  if (abs.filename().empty()) abs = abs.parent_path();
  const auto outer = ckpt::enclosing_checkpoint(abs.parent_path().string());
  ACC_CHECK_AS(IoError, !outer.has_value(), "import-safetensors DIR '", dir,
               "' lies inside the checkpoint '", outer.value_or(""),
               "': give a checkpoint root of its own");
  // The root's one writer from here to the commit, so that no job writes between the check of its
  // steps and the save (and none is writing now: a training job holds the lock for its life).
  const ckpt::RootLock lock = ckpt::RootLock::acquire(dir);
  const std::vector<std::string> steps = ckpt::committed_steps(dir);
  if (!steps.empty()) {
    // The root is a run's: an imported step would replace its state (optimizer, RNG, data
    // position) or sit beside it, and `latest` would move to the import while readers take the
    // newest step, so the two would disagree.
    const std::string newest = fs::path(steps.back()).filename().string();
    const bool same = std::any_of(steps.begin(), steps.end(), [&](const std::string& s) {
      return fs::path(s).filename() == ckpt::step_dir_name(step);
    });
    ACC_CHECK(force, "import-safetensors: '", dir, "' holds ", steps.size(),
              " committed step(s) of a run (the newest: ", newest, ")",
              same ? ", " + ckpt::step_dir_name(step) + " among them" : std::string(),
              ": importing there would ", same ? "replace" : "mix with",
              " its training state; import into a new directory, or give --force to delete "
              "the root's steps first");
    for (const std::string& s : steps) {
      ACC_CHECK(!ckpt::path_within(in, s), "import-safetensors: '", in, "' lies inside '", s,
                "', which --force would delete: copy it elsewhere first");
    }
    const std::vector<std::string> removed = ckpt::remove_committed_steps(dir);
    std::printf("--force: deleted %zu committed step(s) of %s (%s ... %s)\n", removed.size(),
                dir.c_str(), removed.front().c_str(), removed.back().c_str());
  }
  // One process, no strategy: AdamW's state starts at zero (step counts 0), as a fresh run's does.
  auto trainer = strategies::apply(model, optim::AdamW::factory({}), {},
                                   {.context = nullptr, .group = dist::ProcessGroup::world()});
  const std::string written = ckpt::save_trainer(
      dir, step, *trainer, trace::model_trace_hash(model_type, config),
      {{"model_type", model_type}, {"config", model->config_json()}, {"source", in}});
  std::printf("wrote %s from %s (%s, step %lld)\n", written.c_str(), in.c_str(), model_type.c_str(),
              static_cast<long long>(step));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Look into, check and convert AutoAcc's sharded checkpoints"};
  app.require_subcommand(1);
  std::string dir, file, model = "gpt", config;
  int64_t step = 0;
  bool force = false;
  auto* inspect_cmd = app.add_subcommand("inspect", "the step, layout, tensors and chunks");
  inspect_cmd->add_option("DIR", dir, "a step directory or a checkpoint root")->required();
  auto* verify_cmd =
      app.add_subcommand("verify", "check the metadata and every chunk; exit 1 on any fault");
  verify_cmd->add_option("DIR", dir, "a step directory or a checkpoint root")->required();
  auto* export_cmd =
      app.add_subcommand("export-safetensors", "write the full model weights (safetensors)");
  export_cmd->add_option("DIR", dir, "a step directory or a checkpoint root")->required();
  export_cmd->add_option("OUT", file, "the .safetensors file to write")->required();
  auto* import_cmd = app.add_subcommand(
      "import-safetensors", "build a one-rank checkpoint (fresh optimizer state) from weights");
  import_cmd->add_option("IN", file, "a .safetensors file of the model's weights")->required();
  import_cmd->add_option("DIR", dir, "the checkpoint root to write")->required();
  import_cmd->add_option("--model", model, "gpt | llama")
      ->check(CLI::IsMember({"gpt", "llama"}))
      ->capture_default_str();
  import_cmd->add_option("--config", config, "the model config JSON")->required();
  // Whole and in range (acc::cli): CLI11 alone clamped 99999999999999999999 to a step no reader
  // finds. The widest step-N name readers take has 18 digits (ckpt::kMaxStep).
  import_cmd->add_option("--step", step, "the step to record (0 to 999999999999999999)")
      ->check(acc::cli::integer(0, ckpt::kMaxStep))
      ->capture_default_str();
  import_cmd->add_flag("--force", force,
                       "import into a root that holds committed steps (another run's training "
                       "state): they are deleted first, the imported step is then its only one");
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;  // bad: 2
  int rc = 0;
  try {
    if (*import_cmd) acc::dist::init(argc, argv);  // a Trainer saves through a process group
    if (*inspect_cmd) rc = inspect(dir);
    if (*verify_cmd) rc = verify(dir);
    if (*export_cmd) rc = export_safetensors(dir, file);
    if (*import_cmd) rc = import_safetensors(file, dir, model, config, step, force);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-ckpt: error: %s\n", e.what());
    rc = 1;
  }
  if (*import_cmd) acc::dist::finalize();
  return rc;
}
