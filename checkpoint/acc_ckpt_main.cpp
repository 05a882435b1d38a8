// acc-ckpt: look into, check and convert sharded checkpoints (checkpoint/README.md).
//
//   acc-ckpt inspect DIR                          step, layout, every tensor and its chunks
//   acc-ckpt verify DIR                           every checksum and chunk; exit 1 on any fault
//   acc-ckpt export-safetensors DIR OUT.safetensors    the full model weights
//   acc-ckpt import-safetensors IN.safetensors DIR --model gpt --config FILE
//
// DIR is a step directory or a checkpoint root (then its newest committed step). Exit codes: 0
// done, 1 a fault (named), 2 a bad command line.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
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

int64_t file_size_or(const fs::path& p, int64_t missing) {
  std::error_code ec;
  const auto s = fs::file_size(p, ec);
  return ec ? missing : static_cast<int64_t>(s);
}

int inspect(const std::string& dir_arg) {
  const std::string dir = step_dir(dir_arg);
  const ckpt::Metadata m = ckpt::read_metadata(dir);
  std::printf("%s: step %lld, written by %d rank(s), strategy %s, model %s\n", dir.c_str(),
              static_cast<long long>(m.step), m.world, m.strategy.dump().c_str(),
              m.model_trace_hash.c_str());
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
    std::printf("%-56s %-15s %-14s %-5s %7zu %12s\n", t.name.c_str(), t.kind.c_str(),
                to_string(t.shape).c_str(), dtype_name(t.dtype), t.chunks.size(),
                trace::human_bytes(static_cast<double>(bytes)).c_str());
  }
  for (size_t i = 0; i < m.files.size(); ++i) {
    const int64_t size = file_size_or(fs::path(dir) / m.files[i], -1);
    std::printf("%s: %s of chunks, %s on disk\n", m.files[i].c_str(),
                trace::human_bytes(static_cast<double>(per_file[static_cast<int>(i)])).c_str(),
                size < 0 ? "missing" : trace::human_bytes(static_cast<double>(size)).c_str());
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
  for (const auto& t : m.tensors) {
    for (const auto& c : t.chunks) {
      ++chunks;
      const fs::path file = fs::path(dir) / m.files.at(static_cast<size_t>(c.file));
      const std::string where = file.string() + " ('" + t.name + "')";
      try {
        const int64_t size = file_size_or(file, -1);
        ACC_CHECK_AS(IoError, size >= 0, where, ": the shard is missing");
        ACC_CHECK_AS(IoError, c.byte_offset + c.byte_length <= size, where,
                     ": the shard is truncated (", size, " bytes, the chunk ends at ",
                     c.byte_offset + c.byte_length, ")");
        std::ifstream in(file, std::ios::binary);
        stored.resize(static_cast<size_t>(c.byte_length));
        in.seekg(c.byte_offset);
        in.read(stored.data(), static_cast<std::streamsize>(stored.size()));
        ACC_CHECK_AS(IoError, in.good(), where, ": reading failed");
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
  const std::string dir = step_dir(dir_arg);
  const size_t n = ckpt::export_safetensors(dir, out);
  std::printf("wrote %zu tensors of %s to %s\n", n, dir.c_str(), out.c_str());
  return 0;
}

int import_safetensors(const std::string& in, const std::string& dir, const std::string& model_type,
                       const std::string& config_file, int64_t step) {
  const nlohmann::json config = read_json_file(config_file, "--config");
  auto model = models::create_model(model_type, config);
  try {
    model->load_pretrained(io::load_safetensors(in).tensors);
  } catch (const ValueError& e) {
    ACC_THROW(ValueError, "import-safetensors '", in, "': ", e.what());
  }
  // One process, no strategy: AdamW's state starts at zero (step counts 0), as a fresh run's does.
  auto trainer = strategies::apply(model, optim::AdamW::factory({}), {},
                                   {.group = dist::ProcessGroup::world()});
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
  import_cmd->add_option("--step", step, "the step to record")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  if (const auto code = acc::cli::parse(app, argc, argv)) return *code;  // bad: 2
  int rc = 0;
  try {
    if (*import_cmd) acc::dist::init(argc, argv);  // a Trainer saves through a process group
    if (*inspect_cmd) rc = inspect(dir);
    if (*verify_cmd) rc = verify(dir);
    if (*export_cmd) rc = export_safetensors(dir, file);
    if (*import_cmd) rc = import_safetensors(file, dir, model, config, step);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "acc-ckpt: error: %s\n", e.what());
    rc = 1;
  }
  if (*import_cmd) acc::dist::finalize();
  return rc;
}
