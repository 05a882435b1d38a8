#include "acc/checkpoint/trainer_state.hpp"

#include <algorithm>
#include <filesystem>

#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/load.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "trainer_header.hpp"

namespace acc::ckpt {
namespace fs = std::filesystem;

namespace detail {

Header trainer_header(strategies::Trainer& trainer, const std::string& model_trace_hash,
                      nlohmann::json extra) {
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  dist::ProcessGroup& group = *trainer.context()->world();
  nlohmann::json mine = nlohmann::json::object();
  const optim::Optimizer& opt = trainer.optimizer();
  for (const std::string& name : opt.param_names()) mine[name] = opt.param_step(name);
  nlohmann::json steps = nlohmann::json::object();
  for (const std::string& text : dist::allgather_text(group, mine.dump())) {
    const nlohmann::json theirs = nlohmann::json::parse(text);  // items() must not outlive it
    for (const auto& [name, s] : theirs.items()) {
      steps[name] = std::max<int64_t>(steps.value(name, int64_t{0}), s.get<int64_t>());
    }
  }
  if (extra.is_null()) extra = nlohmann::json::object();
  ACC_CHECK(extra.is_object(), "checkpoint: extra must be a JSON object, got ", extra.dump());
  extra["optimizer_steps"] = steps;
  Header h;
  h.model_trace_hash = model_trace_hash;
  h.strategy = strategies::to_json(trainer.strategy());
  h.extra = std::move(extra);
  return h;
}

}  // namespace detail

using detail::trainer_header;

std::string save_trainer(const std::string& root, int64_t step, strategies::Trainer& trainer,
                         const std::string& model_trace_hash, nlohmann::json extra,
                         const SaveOptions& options) {
  const Header h = trainer_header(trainer, model_trace_hash, std::move(extra));
  return save(root, step, trainer.placements(), h, *trainer.context()->world(), options);
}

namespace {

// Throws acc::ValueError naming both hashes when `meta` is of another model.
void check_model(const Metadata& meta, const std::string& step_dir,
                 const std::string& model_trace_hash) {
  ACC_CHECK(meta.model_trace_hash == model_trace_hash, "checkpoint '", step_dir,
            "' is of another model: its trace hash is ", meta.model_trace_hash, ", this model's ",
            model_trace_hash);
}

// load_trainer once the metadata is read and its model checked.
void load_into(const std::string& step_dir, const Metadata& meta, strategies::Trainer& trainer) {
  const nlohmann::json* steps =
      meta.extra.contains("optimizer_steps") ? &meta.extra.at("optimizer_steps") : nullptr;
  ACC_CHECK(steps != nullptr && steps->is_object(), "checkpoint '", step_dir,
            "': extra.optimizer_steps is missing (not written by save_trainer)");
  // Step counts first into a copy of the state, checked, so a failure changes nothing of them.
  optim::Optimizer& opt = trainer.optimizer();
  optim::StateDict sd = opt.state_dict();
  const std::string suffix = ".step";
  for (auto& [key, t] : sd) {
    if (key.size() <= suffix.size() + 6 ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix)) {
      continue;
    }
    const std::string name = key.substr(6, key.size() - 6 - suffix.size());  // "state.<name>.step"
    ACC_CHECK(steps->contains(name) && steps->at(name).is_number_integer() &&
                  steps->at(name).get<int64_t>() >= 0,
              "checkpoint '", step_dir, "': extra.optimizer_steps has no step count >= 0 for '",
              name, "'");
    t = from_vector(std::vector<int64_t>{steps->at(name).get<int64_t>()}, {});
  }
  load(step_dir, meta, trainer.placements());
  opt.load_state_dict(sd);
}

}  // namespace

Metadata load_trainer(const std::string& step_dir, strategies::Trainer& trainer,
                      const std::string& model_trace_hash) {
  Metadata meta = read_metadata(step_dir);
  check_model(meta, step_dir, model_trace_hash);
  load_into(step_dir, meta, trainer);
  return meta;
}

std::optional<Resumed> resume(const std::string& root, strategies::Trainer& trainer,
                              const std::string& model_trace_hash, bool fall_back) {
  ACC_CHECK(trainer.context() != nullptr, "checkpoint: the trainer has no process group");
  dist::ProcessGroup& group = *trainer.context()->world();
  // Rank 0's list of committed steps, newest first, for every rank.
  nlohmann::json list = nlohmann::json::array();
  if (group.rank() == 0) {
    std::error_code ec;
    if (fs::is_regular_file(fs::path(root) / "metadata.json", ec)) {
      list.push_back(root);  // a step directory itself
    } else {
      const std::vector<std::string> steps = committed_steps(root);
      for (auto it = steps.rbegin(); it != steps.rend(); ++it) list.push_back(*it);
    }
  }
  list = nlohmann::json::parse(dist::broadcast_text(group, list.dump(), 0));
  if (list.empty()) return std::nullopt;
  Resumed out;
  for (const auto& entry : list) {
    const std::string dir = entry.get<std::string>();
    std::string error;
    bool other_model = false;
    try {
      out.metadata = read_metadata(dir);
      other_model = out.metadata.model_trace_hash != model_trace_hash;
      check_model(out.metadata, dir, model_trace_hash);
      load_into(dir, out.metadata, trainer);
    } catch (const Error& e) {
      error = e.what();
    }
    Tensor flags =
        from_vector(std::vector<int64_t>{error.empty() ? 0 : 1, other_model ? 1 : 0}, {2});
    group.allreduce(flags, dist::ReduceOp::kSum)->wait();
    const auto f = flags.to_vector<int64_t>();
    if (f[0] == 0) {
      out.dir = dir;
      if (!out.skipped.empty() && group.rank() == 0) {
        logging::warn("checkpoint: resumed from '{}' (skipped {} newer: {})", dir,
                      out.skipped.size(), out.skipped.front());
      }
      return out;
    }
    const std::string messages = dist::rank_messages(dist::allgather_text(group, error));
    ACC_CHECK(f[1] == 0, messages);  // another model: no older step of this root would do
    out.skipped.push_back(dir + " (" + messages + ")");
    if (group.rank() == 0) {
      logging::warn("checkpoint: '{}' does not load ({}){}", dir, messages,
                    fall_back ? "; trying the previous committed step" : "");
    }
    if (!fall_back) break;
  }
  std::string tried;
  for (const auto& s : out.skipped) tried += (tried.empty() ? "" : "; ") + s;
  ACC_THROW(IoError, "checkpoint: nothing under '", root, "' loads: ", tried);
}

}  // namespace acc::ckpt
