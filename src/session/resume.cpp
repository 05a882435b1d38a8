// A session's resume: the checkpoint's run state checked (the model by type and config before its
// hash, the loader's position, every rank's RNG), the trainer loaded into this run's layout, the
// loader and the generators put where the checkpoint's run was.

#include <filesystem>

#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/load.hpp"
#include "acc/checkpoint/trainer_state.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/models/language_model.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "acc/util/json_fields.hpp"
#include "acc/util/logging.hpp"
#include "session_state.hpp"

namespace acc::session_detail {

namespace fs = std::filesystem;

namespace {

std::string metadata_path(const std::string& step_dir) {
  return (fs::path(step_dir) / "metadata.json").string();
}

// The run state a session keeps in a checkpoint's extra, checked before any of it is used, so
// that a damaged or hand-edited field is named with its file (it failed inside nlohmann::json:
// "[json.exception.type_error.304] cannot use at() with string"). Every rank reads the same file
// and so fails alike.
void check_run_state(const nlohmann::json& extra, const std::string& step_dir) {
  using acc::json::brief;
  json::Fields f(extra, "checkpoint metadata '" + metadata_path(step_dir) + "'", "extra");
  if (const nlohmann::json* t = f.optional("model_type"); t && !t->is_string()) {
    f.fail(f.path("model_type"), "must be a string (gpt or llama), got " + brief(*t));
  }
  if (const nlohmann::json* c = f.optional("config"); c && !c->is_object()) {
    f.fail(f.path("config"), "must be an object (the model's config), got " + brief(*c));
  }
  if (const nlohmann::json* t = f.optional("module_type"); t && !t->is_string()) {
    f.fail(f.path("module_type"), "must be a string (the model's module type), got " + brief(*t));
  }
  if (const nlohmann::json* l = f.optional("loader"); l && !l->is_object()) {
    f.fail(f.path("loader"), "must be an object (the data loader's position), got " + brief(*l));
  }
  if (const nlohmann::json* l = f.optional("loader_ranks")) {
    bool ok = l->is_array() && !l->empty();
    for (size_t i = 0; ok && i < l->size(); ++i) ok = l->at(i).is_object();
    if (!ok) {
      f.fail(f.path("loader_ranks"),
             "must be a list of objects (each rank's data loader position), got " + brief(*l));
    }
  }
  if (const nlohmann::json* r = f.optional("rng")) {
    bool ok = r->is_array() && !r->empty();
    for (size_t i = 0; ok && i < r->size(); ++i) {
      const nlohmann::json& e = r->at(i);
      ok = e.is_array() && e.size() == 2 && e[0].is_number_unsigned() && e[1].is_number_unsigned();
    }
    if (!ok) {
      f.fail(f.path("rng"),
             "must be a list of [seed, offset] pairs of unsigned integers, one per rank, got " +
                 brief(*r));
    }
  }
}

// The model a checkpoint holds against this run's, by type and config (a clearer message than
// another trace hash, which ckpt::resume checks after this).
void check_model(const nlohmann::json& extra, const nn::Module& model, const std::string& what) {
  const auto* lm = dynamic_cast<const models::LanguageModel*>(&model);
  if (extra.contains("model_type")) {
    const std::string saved = extra.at("model_type").get<std::string>();
    ACC_CHECK(lm != nullptr, what, " holds a ", saved, " language model, this run's model is a ",
              model.type_name());
    ACC_CHECK(saved == lm->model_type(), what, " holds a ", saved, " model, this run's is a ",
              lm->model_type());
    if (extra.contains("config")) {
      const nlohmann::json& saved_config = extra.at("config");
      const nlohmann::json now = lm->config_json();
      for (const auto& [key, value] : now.items()) {
        const auto it = saved_config.find(key);
        ACC_CHECK(it != saved_config.end() && *it == value, what, " was saved with ", key, " = ",
                  it == saved_config.end() ? std::string("(absent)") : it->dump(),
                  ", this run has ", key, " = ", value.dump(),
                  ": resume with the checkpoint's model config");
      }
    }
  }
  if (extra.contains("module_type")) {
    const std::string saved = extra.at("module_type").get<std::string>();
    ACC_CHECK(saved == model.type_name(), what, " holds a ", saved, " model, this run's is a ",
              lm ? lm->model_type() + " language model" : model.type_name());
  }
}

// This rank's loader state in a checkpoint: its own when the states differ by rank (saved as
// extra.loader_ranks), else the one every rank had.
const nlohmann::json* loader_state(const nlohmann::json& extra, const std::string& step_dir,
                                   int rank, int world) {
  if (const auto it = extra.find("loader_ranks"); it != extra.end()) {
    ACC_CHECK(it->size() == static_cast<size_t>(world), "checkpoint metadata '",
              metadata_path(step_dir), "': field 'extra.loader_ranks' holds the positions of ",
              it->size(), " ranks' data loaders, which differ by rank, and this run has ", world,
              ": a loader whose position differs by rank resumes on as many ranks only");
    return &it->at(static_cast<size_t>(rank));
  }
  const auto it = extra.find("loader");
  return it == extra.end() ? nullptr : &*it;
}

}  // namespace

nlohmann::json model_extra(const nn::Module& model) {
  if (const auto* lm = dynamic_cast<const models::LanguageModel*>(&model)) {
    return {{"model_type", lm->model_type()}, {"config", lm->config_json()}};
  }
  return {{"module_type", model.type_name()}};
}

std::optional<Resumed> resume(const SessionOptions& o, const dist::ProcessGroupPtr& world,
                              strategies::Trainer& trainer, const nn::Module& model,
                              const std::string& model_hash, data::Loader& loader) {
  const bool leader = world->rank() == 0;
  const bool automatic = o.resume == Resume::kAuto;
  const std::string from = automatic ? o.ckpt_dir : o.resume_path;
  const std::string what = o.names.resume + " '" + from + "'";
  // The model's type and config first, by field, from the newest step.
  if (const auto dir = ckpt::resolve(from)) {
    nlohmann::json extra;
    try {
      extra = ckpt::read_metadata(*dir).extra;
    } catch (const Error&) {
      // Damaged: ckpt::resume below names it and falls back (auto) or refuses.
    }
    if (extra.is_object()) {
      check_run_state(extra, *dir);
      check_model(extra, model, what);
    }
  }
  // Falling back past a damaged newest step either way: auto goes on from the step that loads; a
  // root named by hand is refused, naming that step, since its owner asked for the newest and may
  // not want to lose the steps after it.
  const auto resumed = ckpt::resume(from, trainer, model_hash, /*fall_back=*/true);
  ACC_CHECK(resumed || automatic, what, ": no committed checkpoint there");
  if (resumed && !automatic && !resumed->skipped.empty()) {
    std::string skipped;
    for (const std::string& s : resumed->skipped) skipped += (skipped.empty() ? "" : "; ") + s;
    ACC_THROW(IoError, what, ": its newest committed step does not load: ", skipped,
              ". The older '", resumed->dir, "' does: give ", o.names.resume, " ", resumed->dir,
              " to resume from it (", o.names.resume, " auto with ", o.names.ckpt_dir, " ", from,
              " falls back to it by itself)");
  }
  if (!resumed) {
    if (leader) {
      logging::info("{} auto: no checkpoint in '{}' yet, starting at step 0", o.names.resume, from);
    }
    return std::nullopt;
  }
  const nlohmann::json& extra = resumed->metadata.extra;
  check_run_state(extra, resumed->dir);
  check_model(extra, model, what);
  const int64_t step = resumed->metadata.step;
  ACC_CHECK(o.steps == 0 || step < o.steps, what, " is at step ", step, " and ", o.names.steps,
            " is ", o.steps, ": nothing left to train (give ", o.names.steps, " > ", step, ")");
  // A checkpoint made from weights (acc-ckpt import-safetensors) has no data position or RNG: the
  // data then starts from the beginning.
  if (const nlohmann::json* state =
          loader_state(extra, resumed->dir, world->rank(), world->size())) {
    // Each rank loads its own position (per rank when they differ), so one rank may refuse it
    // alone: the ranks agree on the outcome before any of them goes on, and every rank throws
    // the refusing ranks' messages.
    std::string refused;
    try {
      loader.load_state(*state);
    } catch (const ValueError& e) {
      refused = e.what();
    }
    if (world->size() > 1) {
      refused = dist::rank_messages(dist::allgather_text(*world, refused));
    }
    ACC_CHECK(refused.empty(), "checkpoint metadata '", metadata_path(resumed->dir),
              "': field 'extra.", extra.contains("loader_ranks") ? "loader_ranks" : "loader",
              "': ", refused);
  } else if (leader) {
    logging::warn(
        "{}: no data position in the checkpoint (imported weights?): the data starts from the "
        "beginning",
        what);
  }
  // Each rank's generator; on another world size, rank 0's (every rank seeds alike).
  if (const auto it = extra.find("rng"); it != extra.end()) {
    const nlohmann::json& rng = *it;
    const size_t r =
        rng.size() == static_cast<size_t>(world->size()) ? static_cast<size_t>(world->rank()) : 0;
    default_generator().set_state(rng.at(r).at(0).get<uint64_t>(), rng.at(r).at(1).get<uint64_t>());
  }
  if (leader) logging::info("resumed from {} at step {}", resumed->dir, step);
  return Resumed{resumed->dir, step};
}

}  // namespace acc::session_detail
