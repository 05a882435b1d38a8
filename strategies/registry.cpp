// The registered methods and the composition rules, in one place.

#include <algorithm>
#include <filesystem>
#include <map>

#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "method.hpp"
#include "pipeline.hpp"

namespace acc::strategies {
namespace {

const std::vector<MethodSpec>& registry() {
  // One line per method. The order is the order of method_names().
  static const std::vector<MethodSpec> methods = {ddp_method(),
                                                  zero1_method(),
                                                  zero2_method(),
                                                  fsdp_method(),
                                                  amp_method(),
                                                  recompute_method(),
                                                  grad_accum_method(),
                                                  tensor_parallel_method(),
                                                  sequence_parallel_method(),
                                                  pipeline_parallel_method()};
  return methods;
}

const MethodSpec* find(const std::string& name) {
  for (const auto& m : registry()) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

void check_keys(const std::string& method, const nlohmann::json& config,
                const std::vector<std::string>& allowed) {
  ACC_CHECK(config.is_object(), method, ": config must be a JSON object, got ", config.dump());
  for (auto it = config.begin(); it != config.end(); ++it) {
    bool ok = false;
    for (const auto& a : allowed) ok = ok || it.key() == a;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    ACC_CHECK(ok, method, ": unknown config key '", it.key(),
              "' (known: ", list.empty() ? "none" : list, ")");
  }
}

std::string known_names() {
  std::string s;
  for (const auto& m : registry()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

}  // namespace

std::vector<std::string> method_names() {
  std::vector<std::string> out;
  for (const auto& m : registry()) out.push_back(m.name);
  return out;
}

int int_from(const std::string& method, const nlohmann::json& config, const char* key, int lo,
             int hi) {
  const auto& v = config.at(key);
  ACC_CHECK(v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi, method, ": ",
            key, " must be an integer in [", lo, ", ", hi, "], got ", v.dump());
  return v.get<int>();
}

int64_t bucket_bytes_from(const std::string& method, const nlohmann::json& config) {
  if (!config.contains("bucket_mb")) return int64_t{25} << 20;
  const auto& v = config["bucket_mb"];
  ACC_CHECK(v.is_number() && v.get<double>() > 0 && v.get<double>() <= 4096, method,
            ": bucket_mb must be a number in (0, 4096], got ", v.dump());
  return static_cast<int64_t>(v.get<double>() * (1 << 20));
}

std::vector<nlohmann::json> bucket_choices(const SearchContext&) {
  return {nlohmann::json::object(), {{"bucket_mb", 100}}};
}

std::vector<MethodSearch> searchable_methods() {
  std::vector<MethodSearch> out;
  for (const auto& m : registry()) {
    out.push_back(
        {.name = m.name,
         .slot = m.slot,
         .exclusive_slot = m.exclusive_slot,
         .needs_bf16 = m.needs_bf16,
         .needs_ranks = m.needs_ranks,
         .choices = m.search_choices
                        ? m.search_choices
                        : [](const SearchContext&) { return std::vector<nlohmann::json>{}; },
         .effects = m.effects,
         .never_with = {}});
    for (const auto& never : m.never_with) out.back().never_with.push_back(never.first);
  }
  return out;
}

namespace {

// Entry i of `s` against the entries before it: a method at most once, at most one method per
// exclusive slot (grad_sync: ddp, zero1, zero2, fsdp).
void check_entry_composes(const Strategy& s, size_t i) {
  const MethodSpec* spec = find(s[i].name);
  ACC_CHECK(spec != nullptr, "strategy entry ", i, ": unknown method '", s[i].name,
            "' (known: ", known_names(), ")");
  for (size_t k = 0; k < i; ++k) {
    ACC_CHECK(s[k].name != s[i].name, "strategy entry ", i, ": method '", s[i].name,
              "' is given twice");
    const MethodSpec* prev = find(s[k].name);
    ACC_CHECK(!spec->exclusive_slot || !prev->exclusive_slot || prev->slot != spec->slot,
              "strategy entry ", i, ": '", s[i].name, "' cannot be combined with '", s[k].name,
              "' (one ", spec->slot, " method at most)");
  }
}

// The rules over the whole list: pairs that do not compose, as a method's never_with lists them,
// and each method's check_with.
void check_whole_composes(const Strategy& s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const MethodSpec* spec = find(s[i].name);
    for (const auto& never : spec->never_with) {
      const bool present =
          std::any_of(s.begin(), s.end(), [&](const Method& m) { return m.name == never.first; });
      ACC_CHECK(!present, "strategy entry ", i, " ('", s[i].name, "'): ", never.second);
    }
    if (!spec->check_with) continue;
    try {
      spec->check_with(s[i].config, s);
    } catch (const ValueError& err) {
      ACC_THROW(ValueError, "strategy entry ", i, " ('", s[i].name, "'): ", err.what());
    }
  }
}

}  // namespace

// The composition rules, all of them (check_entry_composes as each entry is read, then
// check_whole_composes), and each entry's config (check_config).
Strategy parse_strategy(const nlohmann::json& j) {
  ACC_CHECK(j.is_array(), "strategy must be a JSON list of {\"name\", \"config\"} entries, got ",
            j.dump());
  Strategy s;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& e = j[i];
    ACC_CHECK(e.is_object() && e.contains("name") && e["name"].is_string(), "strategy entry ", i,
              " must be an object with a string \"name\", got ", e.dump());
    for (auto it = e.begin(); it != e.end(); ++it) {
      ACC_CHECK(it.key() == "name" || it.key() == "config", "strategy entry ", i,
                ": unknown field '", it.key(), "' (expected name and config)");
    }
    Method& m = s.emplace_back();
    m.name = e["name"].get<std::string>();
    if (e.contains("config")) m.config = e["config"];
    check_entry_composes(s, i);
    try {
      check_config(m);
    } catch (const ValueError& err) {
      ACC_THROW(ValueError, "strategy entry ", i, " ('", m.name, "'): ", err.what());
    }
  }
  check_whole_composes(s);
  return s;
}

void check_config(const Method& m) {
  const MethodSpec* spec = find(m.name);
  ACC_CHECK(spec != nullptr, "unknown method '", m.name, "' (known: ", known_names(), ")");
  check_keys(m.name, m.config, spec->config_keys);
  TrainingPlan plan;  // a scratch plan without a context: the method checks its config only
  spec->apply(m.config, plan);
}

void check_composition(const Strategy& s) {
  for (size_t i = 0; i < s.size(); ++i) check_entry_composes(s, i);
  check_whole_composes(s);
}

bool is_inline_json(const std::string& arg) {
  const size_t first = arg.find_first_not_of(" \t\r\n");
  return first != std::string::npos && (arg[first] == '[' || arg[first] == '{');
}

nlohmann::json read_strategy_arg(const std::string& arg) {
  if (is_inline_json(arg)) return parse_json(arg, "strategy");
  std::error_code ec;
  ACC_CHECK_AS(IoError, std::filesystem::exists(arg, ec), "strategy '", arg,
               "' is neither an existing file nor inline JSON (a strategy is a file or a JSON "
               "list such as [{\"name\": \"ddp\"}])");
  return read_json_file(arg, "strategy file");
}

Strategy parse_strategy_arg(const std::string& arg) {
  const nlohmann::json j = read_strategy_arg(arg);
  try {
    return parse_strategy(j);
  } catch (const ValueError& e) {
    if (is_inline_json(arg)) throw;
    ACC_THROW(ValueError, "strategy file '", arg, "': ", e.what());
  }
}

nlohmann::json to_json(const Strategy& s) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& m : s) j.push_back({{"name", m.name}, {"config", m.config}});
  return j;
}

std::string describe(const Strategy& s) {
  std::string out;
  for (const auto& m : s) {
    out += (out.empty() ? "" : " + ") + m.name;
    if (!m.config.empty()) out += m.config.dump();
  }
  return out.empty() ? "single process" : out;
}

TrainingPlan make_plan(const Strategy& s, dist::ParallelContextPtr context, LossFn loss,
                       data::Batch sample_batch, bool default_loss) {
  TrainingPlan plan;
  plan.context = std::move(context);
  plan.loss = std::move(loss);
  plan.sample_batch = std::move(sample_batch);
  plan.default_loss = default_loss;
  plan.logits_loss = [](models::LanguageModel& lm, const Tensor& logits, const Tensor& targets) {
    return lm.loss_from_logits(logits, targets);
  };
  Strategy ordered = s;
  std::stable_partition(ordered.begin(), ordered.end(),
                        [](const Method& m) { return m.name == "tensor_parallel"; });
  for (const auto& m : ordered) {
    const MethodSpec* spec = find(m.name);
    ACC_CHECK(spec != nullptr, "unknown method '", m.name, "' (known: ", known_names(), ")");
    spec->apply(m.config, plan);
  }
  std::stable_partition(
      plan.model_transforms.begin(), plan.model_transforms.end(),
      [](const TrainingPlan::Transform& t) { return t.method == "tensor_parallel"; });
  // Ulysses' all-to-alls go around every other wrapper of the attention cores (installed last,
  // they are outermost), so a selective recomputation replays the core alone, not the messages.
  std::stable_partition(
      plan.model_transforms.begin(), plan.model_transforms.end(),
      [](const TrainingPlan::Transform& t) { return t.method != "sequence_parallel"; });
  std::stable_partition(
      plan.model_transforms.begin(), plan.model_transforms.end(),
      [](const TrainingPlan::Transform& t) { return t.method != "pipeline_parallel"; });
  return plan;
}

Strategy layout_of(const Strategy& s) {
  Strategy layout;
  for (const auto& m : s) {
    const MethodSpec* spec = find(m.name);
    ACC_CHECK(spec != nullptr, "unknown method '", m.name, "' (known: ", known_names(), ")");
    if (spec->layout) layout.push_back(m);
  }
  return layout;
}

std::string layout_key(const Strategy& s) {
  std::string key;
  for (const auto& m : s) {
    const MethodSpec* spec = find(m.name);
    ACC_CHECK(spec != nullptr, "unknown method '", m.name, "' (known: ", known_names(), ")");
    if (!spec->layout) continue;
    // As nlohmann::json dumps {"name", "config"}: its keys sorted.
    key += key.empty() ? "[" : ",";
    key += "{\"config\":" + m.config.dump() + ",\"name\":" + nlohmann::json(m.name).dump() + "}";
  }
  return key.empty() ? key : key + "]";
}

Strategy stage_layout_of(const Strategy& s) {
  Strategy within;
  for (auto& m : layout_of(s)) {
    if (m.name != "pipeline_parallel") within.push_back(std::move(m));
  }
  return within;
}

trace::ModelRef::Rewrite layout_rewrite(const Strategy& s, int world, bool default_loss,
                                        int pp_rank) {
  const Strategy layout = layout_of(s);
  if (layout.empty()) return {};
  const dist::DeviceMesh mesh = mesh_for(s, world);
  ACC_CHECK(pp_rank >= 0 && pp_rank < mesh.pp, "layout_rewrite: pp rank ", pp_rank,
            " outside the mesh ", mesh.to_string());
  const dist::ParallelContextPtr context =
      dist::ParallelContext::meta(mesh, mesh.rank_of(dist::MeshCoord{.pp = pp_rank}));
  return [layout, context, default_loss](nn::Module& model, const data::Batch& sample,
                                         const trace::BatchLoss& loss) {
    // The undos write into the plan's tables (the layouts they recorded): it lives as they do.
    auto plan = std::make_shared<const TrainingPlan>(
        make_plan(layout, context, loss, sample, default_loss));
    std::vector<Undo> undos;
    try {
      for (const auto& t : plan->model_transforms) {
        // The copy traced holds this rank's blocks only: the pipeline keeps them all.
        undos.push_back(t.method == "pipeline_parallel" ? plan->pipeline->cut_for_trace(model)
                                                        : t.apply(model));
      }
    } catch (...) {
      nn::undo_all(std::move(undos))();
      throw;
    }
    Undo undo = [plan, all = nn::undo_all(std::move(undos))] { all(); };
    trace::BatchLoss traced = plan->loss;
    if (plan->pipeline) {
      traced = [pipe = plan->pipeline](nn::Module&, const data::Batch& b) {
        return pipe->trace_step(b);
      };
    }
    return std::make_pair(std::move(undo), std::move(traced));
  };
}

dist::DeviceMesh mesh_for(const Strategy& s, int world) {
  dist::DeviceMesh mesh;
  for (const auto& m : s) {
    const MethodSpec* spec = find(m.name);
    if (spec != nullptr && spec->mesh) spec->mesh(m.config, mesh);
  }
  const int inner = mesh.tp * mesh.cp * mesh.pp;
  ACC_CHECK(world >= 1 && world % inner == 0, "strategy ", describe(s), ": its mesh (tp ", mesh.tp,
            ", cp ", mesh.cp, ", pp ", mesh.pp, ") needs a multiple of ", inner,
            " ranks, the run has ", world);
  mesh.dp = world / inner;
  return mesh;
}

}  // namespace acc::strategies
