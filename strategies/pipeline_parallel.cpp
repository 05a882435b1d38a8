// The "pipeline_parallel" method: the model cut into stages between its blocks, over the mesh
// dimension pp (outermost), run by a schedule (pipeline_schedule.hpp) whose messages are the
// differentiable send_to / recv_from of acc/dist/functional.hpp.
//
// Config {"size": p, "schedule": "1f1b" | "interleaved" | "gpipe", "virtual": v,
//         "micro_batches": m, "stages": [[0, 5], [6, 11]]}:
//   size           ranks along pp (required);
//   virtual        stages per rank (default 1); more than 1 needs the interleaved schedule;
//   schedule       default 1f1b, interleaved when virtual > 1;
//   micro_batches  per optimizer step (default p: the least that fills the pipeline once; the
//                  bubble is (p - 1) / (m + p - 1) under 1F1B, so more is faster while the batch
//                  allows: each rank's batch must split into m);
//   stages         the user's cut: p x v [first, last] block ranges (inclusive), in order,
//                  covering every block; without it the blocks are balanced (balance_stages) with
//                  the head's cost charged to the last stage.
//
// What runs where: stage s on rank s % p of the pp group; the embedding modules with stage 0, the
// head's (final norm, output projection) with the last stage; a tied embedding (GPT's wte) is then
// held by both, started equal (broadcast from the first stage) and kept equal: an embedding group
// of the two sums their gradients before the data-parallel reduction and the update, and the
// placement table counts them as two replicas of one tensor (the norm counts it once).
//
// Decisions:
//  - The model comes whole on every rank (the user's, or auto_accelerate's copy); the cut swaps
//    what another stage runs for StageElsewhere and releases those tensors' storage (0 bytes on
//    the meta device), so a rank holds its stages only; the undo broadcasts each back from the pp
//    rank that trained it (a collective, skipped while an exception unwinds, as tensor_parallel's
//    gathers are). Building the whole model first still needs the whole model's memory once:
//    deferred (meta) initialisation is not there yet.
//  - Gradients are reduced over dp after the schedule, not during its backwards (ddp's overlap
//    needs one backward pass per step; a pipeline runs m per stage, and interleaved stages end
//    theirs at different times). So the embedding group's sum comes first for free, before ZeRO's
//    reduce-scatter splits the tied gradient into shards that do not line up across stages.
//  - The loss is the language model's own next-token loss, computed on the last stage; a loss of
//    the user's (ApplyOptions::loss) is refused, as is any other module than a LanguageModel.
//  - Dropout is refused: each stage would draw its masks from its own generator in the schedule's
//    order, not the one process's masks (the layout-dependent masks Megatron seeds per stage).
//  - Composes with ddp, zero1, zero2 over dp, amp, checkpoint, tensor_parallel (its transform
//    runs first, on the whole model; the last stage's loss is then the vocabulary-parallel
//    cross-entropy), Megatron-SP (stages pass each other their sequence chunk) and Ulysses (each
//    stage runs its cp rank's chunk of every micro-batch at the chunk's position offset, the loss
//    weighed as Ulysses weighs it; a stage sends its (B, T / cp, C) to the next stage's rank of
//    the same cp coordinate, the pp group's). Not with fsdp (refused: use zero1/zero2) or
//    grad_accum (micro_batches is the pipeline's accumulation).
//  - The search tries it (sizes dividing the world, m = p, 2p, 4p, 1F1B and interleaved v = 2)
//    and prices each pp rank from the trace of its own stages (layout_rewrite). Once calibrated,
//    it re-cuts each candidate where its cost model balances the stages' time
//    (search::CostModel::balanced_stages, written as "stages"): the FLOP cut below is the
//    method's own when no cost model is at hand (a strategy written by hand).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <unordered_set>

#include "acc/autograd/ops.hpp"
#include "acc/dist/functional.hpp"
#include "acc/util/error.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/progress.hpp"
#include "method.hpp"
#include "pipeline.hpp"

namespace acc::strategies {
namespace {

// What a rank holds in place of a module another stage runs: nothing.
class StageElsewhere : public nn::Module {
 public:
  StageElsewhere(std::string path, int rank)
      : nn::Module("StageElsewhere"), path_(std::move(path)), rank_(rank) {}
  Tensor forward(const Tensor&) override {
    ACC_THROW(ValueError, "pipeline_parallel: '", path_, "' runs on pipeline rank ", rank_,
              ", not on this one: a pipelined model runs through Trainer::train_step");
  }

 private:
  std::string path_;
  int rank_;
};

// The integer `key` in [lo, hi], `fallback` when absent.
int int_in(const nlohmann::json& c, const char* key, int lo, int hi, int fallback) {
  return c.contains(key) ? int_from("pipeline_parallel", c, key, lo, hi) : fallback;
}

int size_from(const nlohmann::json& c) {
  ACC_CHECK(
      c.contains("size"),
      "pipeline_parallel: config needs \"size\" (pipeline stages' ranks, e.g. {\"size\": 2})");
  return int_from("pipeline_parallel", c, "size", 1, 256);
}

struct Config {
  int size = 1, virtual_stages = 1, micro_batches = 1;
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  std::vector<StageBlocks> stages;
};

Config parse(const nlohmann::json& c) {
  Config out;
  out.size = size_from(c);
  out.virtual_stages = int_in(c, "virtual", 1, 64, 1);
  out.micro_batches = int_in(c, "micro_batches", 1, 65536, out.size);
  out.kind = out.virtual_stages > 1 ? ScheduleKind::kInterleaved : ScheduleKind::kOneFOneB;
  if (c.contains("schedule")) {
    ACC_CHECK(c["schedule"].is_string(), "pipeline_parallel: schedule must be a string, got ",
              c["schedule"].dump());
    out.kind = parse_schedule_kind(c["schedule"].get<std::string>());
  }
  const int S = out.size * out.virtual_stages;
  ACC_CHECK(S <= kMaxStages, "pipeline_parallel: size ", out.size, " x virtual ",
            out.virtual_stages, " = ", S, " stages, at most ", kMaxStages);
  if (c.contains("stages")) {
    const auto& st = c["stages"];
    ACC_CHECK(st.is_array() && static_cast<int>(st.size()) == S, "pipeline_parallel: stages must ",
              "list ", S, " [first, last] block ranges (size ", out.size, " x virtual ",
              out.virtual_stages, "), got ", st.dump());
    int64_t next = 0;
    for (size_t i = 0; i < st.size(); ++i) {
      const auto& r = st[i];
      ACC_CHECK(
          r.is_array() && r.size() == 2 && r[0].is_number_integer() && r[1].is_number_integer(),
          "pipeline_parallel: stages[", i, "] must be [first, last] block indices, got ", r.dump());
      const int64_t first = r[0].get<int64_t>(), last = r[1].get<int64_t>();
      ACC_CHECK(first == next && last >= first, "pipeline_parallel: stages[", i, "] is ", r.dump(),
                ", but the stages must cover the blocks in order without gaps: it must start at "
                "block ",
                next, " and end at or after it");
      out.stages.push_back({first, last + 1});
      next = last + 1;
    }
  }
  return out;
}

}  // namespace

std::vector<StageBlocks> balance_stages(int64_t blocks, int stages, double first_extra,
                                        double last_extra) {
  ACC_CHECK(stages >= 1 && blocks >= stages, "pipeline_parallel: ", blocks,
            " blocks cannot be cut into ", stages, " stages (each stage needs a block)");
  ACC_CHECK(std::isfinite(first_extra) && first_extra >= 0 && std::isfinite(last_extra) &&
                last_extra >= 0,
            "pipeline_parallel: the first and last stages' extra costs must be finite and >= 0 "
            "blocks, got ",
            first_extra, " and ", last_extra);
  const auto S = static_cast<size_t>(stages);
  const auto N = static_cast<size_t>(blocks);
  auto cost = [&](size_t stage, size_t a, size_t b) {
    return static_cast<double>(b - a) + (stage == 0 ? first_extra : 0.0) +
           (stage + 1 == S ? last_extra : 0.0);
  };
  // best[i][a]: the least largest cost of stages i.. over blocks [a, N).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(N + 1, inf));
  best[S][N] = 0;
  // Stage i ends at b in (a, N - (S - 1 - i)] (each later stage keeps a block). Over that range
  // its own cost rises with b and the rest's, best[i + 1][b], does not: the least largest of the
  // two is at the first b where the own cost reaches the rest's, or just before it, so a binary
  // search finds it (O(S N log N) rather than O(S N^2); the search prices every pipeline cut).
  for (size_t i = S; i-- > 0;) {
    const size_t last_end = N - (S - 1 - i);
    for (size_t a = 0; a < last_end; ++a) {
      size_t lo = a + 1, hi = last_end;  // the first b in [lo, hi] whose cost >= the rest's
      while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (cost(i, a, mid) >= best[i + 1][mid]) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      double m = std::max(cost(i, a, lo), best[i + 1][lo]);
      if (lo > a + 1) m = std::min(m, std::max(cost(i, a, lo - 1), best[i + 1][lo - 1]));
      best[i][a] = m;
    }
  }
  std::vector<StageBlocks> out;
  size_t a = 0;
  for (size_t i = 0; i < S; ++i) {
    for (size_t b = a + 1; b <= N; ++b) {  // the fewest blocks that keep the optimum
      if (std::max(cost(i, a, b), best[i + 1][b]) <= best[i][a] + 1e-12) {
        out.push_back({static_cast<int64_t>(a), static_cast<int64_t>(b)});
        a = b;
        break;
      }
    }
  }
  return out;
}

Strategy with_pipeline_stages(const Strategy& s, const std::vector<StageBlocks>& stages) {
  Strategy out = s;
  for (auto& m : out) {
    if (m.name != "pipeline_parallel") continue;
    nlohmann::json list = nlohmann::json::array();
    for (const StageBlocks& b : stages) list.push_back({b.begin, b.end - 1});
    m.config["stages"] = std::move(list);
    parse(m.config);  // the config's own checks: one range per stage, in order, without gaps
    return out;
  }
  ACC_THROW(ValueError, "with_pipeline_stages: the strategy has no pipeline_parallel to cut");
}

double head_cost_in_blocks(int64_t hidden_size, int64_t vocab_size, int64_t seq_len) {
  const auto C = static_cast<double>(hidden_size);
  const auto V = static_cast<double>(vocab_size);
  return V / (12 * C + 2 * static_cast<double>(seq_len));
}

double head_cost_in_blocks(const models::LanguageModel& model, int64_t seq_len) {
  return head_cost_in_blocks(model.hidden_size(), model.vocab_size(), seq_len);
}

std::optional<PipelineLayout> pipeline_layout(const Strategy& s, int64_t num_blocks,
                                              double head_cost) {
  for (const auto& m : s) {
    if (m.name != "pipeline_parallel") continue;
    Config cfg = parse(m.config);
    PipelineLayout out{checked_schedule(cfg.kind, cfg.size, cfg.virtual_stages, cfg.micro_batches),
                       std::move(cfg.stages)};
    if (out.stages.empty()) {
      out.stages = balance_stages(num_blocks, out.schedule->num_stages(), 0.0, head_cost);
    }
    ACC_CHECK(out.stages.back().end == num_blocks,
              "pipeline_parallel: the stages cover blocks 0 to ", out.stages.back().end - 1,
              ", the model has ", num_blocks, " blocks: the last stage must end at block ",
              num_blocks - 1);
    return out;
  }
  return std::nullopt;
}

Pipeline::Pipeline(PipelineSchedule schedule, std::vector<StageBlocks> stages,
                   dist::ParallelContextPtr context, LogitsLoss logits_loss,
                   std::shared_ptr<bool> megatron_sp, std::shared_ptr<const SequenceSplit> split)
    : schedule_(std::move(schedule)),
      stages_(std::move(stages)),
      context_(std::move(context)),
      logits_loss_(std::move(logits_loss)),
      megatron_sp_(std::move(megatron_sp)),
      split_(std::move(split)) {
  pp_ = context_->group(dist::MeshDim::kPp);
  rank_ = context_->coordinate(dist::MeshDim::kPp);
  ACC_CHECK_INTERNAL(pp_->size() == schedule_.ranks && pp_->rank() == rank_,
                     "pipeline_parallel: the pp group '", pp_->name(), "' has rank ", pp_->rank(),
                     " of ", pp_->size(), ", the mesh says ", rank_, " of ", schedule_.ranks);
}

models::LanguageModel& Pipeline::stages_of(nn::Module& model) const {
  auto* lm = dynamic_cast<models::LanguageModel*>(&model);
  ACC_CHECK(lm != nullptr, "pipeline_parallel: the model (", model.type_name(),
            ") is no models::LanguageModel: stages are cut between the blocks of a language "
            "model's embed -> blocks -> head (a module of your own is not cut yet)");
  for (const auto& [name, m] : model.named_modules()) {
    const auto* drop = dynamic_cast<const nn::Dropout*>(m.get());
    ACC_CHECK(drop == nullptr || drop->p() == 0, "pipeline_parallel: '", name,
              "' is a dropout of p ", drop ? drop->p() : 0.0,
              ": its masks would be drawn per stage in the schedule's order, not as one process "
              "draws them (set the model's dropout to 0)");
  }
  return *lm;
}

std::vector<std::pair<std::string, int>> Pipeline::ends_elsewhere(
    const models::LanguageModel& lm) const {
  const int S = schedule_.num_stages();
  const bool holds_first = rank_of_stage(0) == rank_;
  const bool holds_last = rank_of_stage(S - 1) == rank_;
  const std::vector<std::string> embedding = lm.embedding_modules(), head = lm.head_modules();
  std::set<std::string> kept, ends(embedding.begin(), embedding.end());
  ends.insert(head.begin(), head.end());
  if (holds_first) kept.insert(embedding.begin(), embedding.end());
  if (holds_last) kept.insert(head.begin(), head.end());
  std::vector<std::pair<std::string, int>> out;
  for (const auto& m : ends) {
    if (kept.count(m)) continue;
    const bool in_embedding = std::find(embedding.begin(), embedding.end(), m) != embedding.end();
    out.emplace_back(m, rank_of_stage(in_embedding ? 0 : S - 1));
  }
  return out;
}

nn::Undo Pipeline::swap_out(nn::Module& model,
                            const std::vector<std::pair<std::string, int>>& elsewhere) {
  std::vector<nn::Undo> undos;
  try {
    for (const auto& [path, owner] : elsewhere) {
      undos.push_back(model.replace_module(path, std::make_shared<StageElsewhere>(path, owner)));
    }
  } catch (...) {
    nn::undo_all(std::move(undos))();
    throw;
  }
  return nn::undo_all(std::move(undos));
}

nn::Undo Pipeline::cut(nn::Module& model) {
  models::LanguageModel* lm = &stages_of(model);
  const int S = schedule_.num_stages(), p = schedule_.ranks;
  const int64_t N = static_cast<int64_t>(lm->blocks().size());
  if (stages_.empty()) {
    stages_ = balance_stages(N, S, 0.0, head_cost_in_blocks(*lm, lm->max_seq_len()));
  }
  ACC_CHECK(stages_.back().end == N, "pipeline_parallel: the stages cover blocks 0 to ",
            stages_.back().end - 1, ", the model (", lm->model_type(), ") has ", N,
            " blocks: the last stage must end at block ", N - 1);
  whole_.clear();
  for (const auto& [name, t] : model.named_parameters()) whole_.emplace_back(name, t.shape());

  std::string blocks_path;
  for (const auto& [name, m] : model.named_modules()) {
    if (m.get() == &lm->blocks()) blocks_path = name;
  }
  ACC_CHECK_INTERNAL(!blocks_path.empty(), "pipeline_parallel: the blocks of ", lm->model_type(),
                     " are not a module of the model");
  const bool holds_first = rank_of_stage(0) == rank_;
  const bool holds_last = rank_of_stage(S - 1) == rank_;
  // The rank that runs each block, and what this rank does not run.
  std::vector<int> block_owner(static_cast<size_t>(N));
  for (int st = 0; st < S; ++st) {
    const StageBlocks& b = stages_[static_cast<size_t>(st)];
    for (int64_t i = b.begin; i < b.end; ++i) {
      block_owner[static_cast<size_t>(i)] = rank_of_stage(st);
    }
  }
  std::vector<std::pair<std::string, int>> elsewhere;
  for (int64_t i = 0; i < N; ++i) {
    const int owner = block_owner[static_cast<size_t>(i)];
    if (owner != rank_) elsewhere.emplace_back(blocks_path + "." + std::to_string(i), owner);
  }
  const auto ends = ends_elsewhere(*lm);
  elsewhere.insert(elsewhere.end(), ends.begin(), ends.end());
  // Every parameter must be in a block or in one of the ends, or no stage would train it.
  std::vector<std::string> end_modules = lm->embedding_modules();
  for (const auto& m : lm->head_modules()) end_modules.push_back(m);
  for (const auto& [name, shape] : whole_) {
    bool placed = name.rfind(blocks_path + ".", 0) == 0;
    for (const auto& m : end_modules) placed = placed || name.rfind(m + ".", 0) == 0;
    ACC_CHECK(placed, "pipeline_parallel: parameter '", name, "' of ", lm->model_type(),
              " is in no block and in none of its embedding or head modules, so no stage holds it");
  }
  // The undo broadcasts every tensor some pp rank gives up from the rank that trained it, in the
  // whole model's order (every rank alike): a block's from its stage's rank, the embedding's from
  // the first stage's, the head's from the last's. The tied embedding is on both end stages:
  // every rank holds it at 2 ranks.
  const std::string tied = lm->tied_embedding_name();
  std::vector<std::pair<Tensor, int>> broadcasts;
  auto list = [&](const std::string& name, const Tensor& t) {
    if (!t.defined() || (name == tied && p == 2)) return;
    const std::string blocks_prefix = blocks_path + ".";
    if (name.rfind(blocks_prefix, 0) == 0) {
      const size_t dot = name.find('.', blocks_prefix.size());
      const auto i = static_cast<size_t>(
          std::stoll(name.substr(blocks_prefix.size(), dot - blocks_prefix.size())));
      broadcasts.emplace_back(t, block_owner.at(i));
      return;
    }
    for (const auto& [modules, owner] :
         {std::make_pair(lm->embedding_modules(), 0), std::make_pair(lm->head_modules(), S - 1)}) {
      for (const auto& m : modules) {
        if (name.rfind(m + ".", 0) == 0) {
          broadcasts.emplace_back(t, rank_of_stage(owner));
          return;
        }
      }
    }
  };
  for (const auto& [name, t] : model.named_parameters()) list(name, t);
  for (const auto& [name, t] : model.named_buffers()) list(name, t);
  // The modules this rank gives up, before they leave the tree.
  std::vector<nn::ModulePtr> given_up;
  for (const auto& [path, owner] : elsewhere) given_up.push_back(model.submodule(path));
  nn::Undo swapped = swap_out(model, elsewhere);
  try {
    // The tied embedding: one group over its two stages' ranks (the others pass a color of their
    // own: world->split is collective over the world).
    if (!tied.empty() && p > 1) {
      const int inner = context_->world_size() / p;  // ranks per stage
      const bool holds = holds_first || holds_last;
      const int color = holds ? context_->rank() % inner : inner + context_->rank();
      embedding_group_ = context_->world()->split(color, rank_, "embedding");
      if (holds) {
        tied_ = tied;
        Tensor w = model.find_tensor(tied);
        NoGradGuard ng;
        embedding_group_->broadcast(w, 0)->wait();
      }
    }
  } catch (...) {
    swapped();
    throw;
  }
  // Another stage's tensors hold no memory here (a pipeline is there to split them): their
  // storage is released, as tensor_parallel releases its whole linears (0 bytes on the meta
  // device: any read fails), unless a module this rank runs shares them (the tied embedding).
  std::unordered_set<const TensorImpl*> kept;
  for (const auto& [name, t] : model.named_parameters()) kept.insert(t.impl());
  for (const auto& [name, t] : model.named_buffers()) kept.insert(t.impl());
  std::unordered_set<const TensorImpl*> released;
  for (const auto& module : given_up) {
    auto release = [&](Tensor t) {
      if (!t.defined() || kept.count(t.impl()) || !released.insert(t.impl()).second) return;
      repoint(t, std::make_shared<Storage>(0, Device::kMeta), 0);
    };
    for (const auto& [name, t] : module->named_parameters()) release(t);
    for (const auto& [name, t] : module->named_buffers()) release(t);
  }
  model_ = lm;
  return [this, swapped, broadcasts]() mutable {
    swapped();
    // While an exception unwinds (a failed step tearing its Trainer down), another rank may never
    // reach the broadcasts: the tensors given up stay released then, as tensor_parallel's wholes.
    // It runs in the Trainer's destructor: a broadcast that fails (a peer gone) is logged and the
    // rest stay released (a failed operation keeps its tensors for the life of the process).
    if (std::uncaught_exceptions() == 0) {
      NoGradGuard ng;
      try {
        for (auto& [t, owner] : broadcasts) {
          if (t.device() == Device::kMeta) {
            repoint_to_own(t, zeros(t.shape(), {t.dtype(), Device::kCPU, false}));
          }
          pp_->broadcast(t, owner)->wait();
        }
      } catch (const Error& e) {
        logging::warn("pipeline_parallel: the other stages' tensors stay released on this rank: {}",
                      e.what());
      }
    }
    model_ = nullptr;
    tied_.clear();
    embedding_group_.reset();
  };
}

nn::Undo Pipeline::cut_for_trace(nn::Module& model) {
  models::LanguageModel* lm = &stages_of(model);
  const int v = schedule_.virtual_stages;
  const auto n = static_cast<int64_t>(lm->blocks().size());
  nn::Undo swapped = swap_out(model, ends_elsewhere(*lm));
  trace_chunks_.clear();
  for (int j = 0; j < v; ++j) trace_chunks_.push_back({n * j / v, n * (j + 1) / v});
  model_ = lm;
  return [this, swapped] {
    swapped();
    model_ = nullptr;
    trace_chunks_.clear();
  };
}

Tensor Pipeline::trace_step(const data::Batch& micro_batch) {
  ACC_CHECK_INTERNAL(model_ != nullptr && !trace_chunks_.empty(),
                     "pipeline_parallel: trace_step before cut_for_trace");
  const SequenceChunk mine = chunk_of(micro_batch);
  const Tensor& idx = mine.batch.idx();
  Tensor total;
  for (size_t j = 0; j < trace_chunks_.size(); ++j) {
    const int stage = static_cast<int>(j) * schedule_.ranks + rank_;
    const StageBlocks& b = trace_chunks_[j];
    Tensor x;
    if (stage == 0) {
      x = embed(mine);
    } else {
      // The copy's first block takes the whole sequence (Megatron-SP scatters it there), a later
      // one its chunk.
      Shape shape = activation_shape(mine.batch);
      if (b.begin == 0) shape[1] = idx.size(1);
      x = dist::recv_from(shape, {DType::kFloat32, idx.device(), /*requires_grad=*/true},
                          rank_of_stage(stage - 1), pp_, stage);
    }
    Tensor out = through(stage, b, std::move(x), mine);
    total = total.defined() ? add(total, out) : out;
  }
  return total;
}

SequenceChunk Pipeline::chunk_of(const data::Batch& micro_batch) const {
  if (split_ && split_->chunk) return split_->chunk(micro_batch);
  return {micro_batch, 0, 1.0};
}

Shape Pipeline::activation_shape(const data::Batch& micro_batch) const {
  const Tensor& idx = micro_batch.idx();
  // Under Ulysses `micro_batch` is this cp rank's chunk already. Under Megatron-SP the blocks pass
  // each other their chunk of the sequence (the first block scatters it, the last gathers it back),
  // and a stage starts after a block that is not last.
  const int64_t T = *megatron_sp_ ? idx.size(1) / context_->size(dist::MeshDim::kTp) : idx.size(1);
  return {idx.size(0), T, model_->hidden_size()};
}

// The receive of `a`'s input activation (a forward of a stage > 0).
dist::PostedRecv Pipeline::post_input(const PipeAction& a, const data::Batch& micro_batch) {
  return dist::post_recv(activation_shape(micro_batch),
                         {DType::kFloat32, Device::kCPU, /*requires_grad=*/true},
                         rank_of_stage(a.stage - 1), pp_, a.stage);
}

Tensor Pipeline::forward(const PipeAction& a, const SequenceChunk& micro_batch,
                         dist::PostedRecv* input) {
  Tensor x = a.stage == 0 ? embed(micro_batch) : dist::recv_from(std::move(*input));
  return through(a.stage, stages_[static_cast<size_t>(a.stage)], std::move(x), micro_batch);
}

Tensor Pipeline::embed(const SequenceChunk& micro_batch) {
  nn::ForwardOptionsGuard guard(micro_batch.options());
  return model_->embed(micro_batch.batch.idx());
}

Tensor Pipeline::through(int stage, const StageBlocks& b, Tensor x,
                         const SequenceChunk& micro_batch) {
  nn::ModuleList& blocks = model_->blocks();
  {
    // The blocks' rotary angles are those of the chunk's tokens (a recomputed block keeps the
    // options it ran its forward with).
    nn::ForwardOptionsGuard guard(micro_batch.options());
    for (int64_t i = b.begin; i < b.end; ++i) x = (*blocks[static_cast<size_t>(i)])(x);
  }
  if (stage == schedule_.num_stages() - 1) {
    Tensor l = logits_loss_(*model_, model_->head(x), micro_batch.batch.targets());
    return micro_batch.weigh(l);
  }
  return dist::send_to(x, rank_of_stage(stage + 1), pp_, stage + 1);
}

double Pipeline::run(const data::Batch& batch) {
  ACC_CHECK_INTERNAL(model_ != nullptr, "pipeline_parallel: run before the model was cut");
  const int m = schedule_.micro_batches;
  // Each micro-batch as this rank runs it (its sequence chunk under Ulysses), before any message.
  std::vector<SequenceChunk> parts;
  for (const data::Batch& b :
       batch.split(m, "train_step (micro-batches: pipeline_parallel's micro_batches)")) {
    parts.push_back(chunk_of(b));
  }
  const int last = schedule_.num_stages() - 1;
  const std::vector<PipeAction>& list = schedule_.actions[static_cast<size_t>(rank_)];
  auto part = [&](const PipeAction& a) -> const SequenceChunk& {
    return parts[static_cast<size_t>(a.micro_batch)];
  };
  // The next forward's input is received while this rank computes: its receive is posted as the
  // one before it is taken. Only when no gradient comes from the rank the activations come from
  // (one stage a rank, or more than 2 ranks): messages from one rank are matched in the order
  // they are posted, and a gradient's receive is posted by the backward that needs it.
  // Measured with bench_pipeline (benchmarks/README.md).
  const bool ahead = schedule_.virtual_stages == 1 || schedule_.ranks > 2;
  std::optional<std::pair<size_t, dist::PostedRecv>> posted;  // (action index, its receive)
  auto post_from = [&](size_t from) {
    for (size_t j = from; j < list.size(); ++j) {
      if (list[j].step == PipeStep::kForward && list[j].stage > 0) {
        posted.emplace(j, post_input(list[j], part(list[j]).batch));
        return;
      }
    }
  };
  // The forward's output until its backward: the loss (last stage) or the send's handle.
  std::map<std::pair<int, int>, Tensor> in_flight;
  double loss_sum = 0;
  dist::DeferredSends sends;
  // Likewise the next backward's gradient (from the next stage's rank), posted as each backward
  // that received one ends: send_to's backward takes it.
  dist::PostedGradients gradients;
  auto post_gradient_from = [&](size_t from) {
    for (size_t j = from; j < list.size(); ++j) {
      const PipeAction& b = list[j];
      if (b.step != PipeStep::kBackward || b.stage == last) continue;
      // The gradient of the activation this stage sent the next one.
      gradients.post(activation_shape(part(b).batch), {DType::kFloat32, Device::kCPU, false},
                     rank_of_stage(b.stage + 1), pp_, b.stage + 1);
      return;
    }
  };
  if (ahead) {
    post_from(0);
    post_gradient_from(0);
  }
  // Compute and wait time of the forwards and backwards (waits: blocked on a message), for the
  // debug log: what a stage's share of the bubble is made of.
  using Clock = std::chrono::steady_clock;
  double busy_s[2] = {0, 0}, waited_s[2] = {0, 0};
  for (size_t i = 0; i < list.size(); ++i) {
    const PipeAction& a = list[i];
    const auto t0 = Clock::now();
    const double w0 = dist::wait_seconds();
    struct Timed {
      double* busy;
      double* waited;
      Clock::time_point t0;
      double w0;
      ~Timed() {
        const double w = dist::wait_seconds() - w0;
        *waited += w;
        *busy += std::chrono::duration<double>(Clock::now() - t0).count() - w;
      }
    } timed{&busy_s[a.step == PipeStep::kForward ? 0 : 1],
            &waited_s[a.step == PipeStep::kForward ? 0 : 1], t0, w0};
    sends.prune();
    if (a.step == PipeStep::kForward) {
      progress::phase(progress::Phase::kForward);
      std::optional<dist::PostedRecv> input;
      if (a.stage > 0) {
        if (posted && posted->first == i) {
          input = std::move(posted->second);
          posted.reset();
          post_from(i + 1);
        } else {
          input = post_input(a, part(a).batch);
        }
      }
      Tensor out = forward(a, part(a), input ? &*input : nullptr);
      if (a.stage == last) loss_sum += out.item();
      in_flight[{a.micro_batch, a.stage}] = std::move(out);
      continue;
    }
    progress::phase(progress::Phase::kBackward);
    auto it = in_flight.find({a.micro_batch, a.stage});
    ACC_CHECK_INTERNAL(it != in_flight.end(), "pipeline_parallel: ", to_string(a, true),
                       " has no forward (the schedule was validated)");
    Tensor out = std::move(it->second);
    in_flight.erase(it);
    if (a.stage == last) {
      (m > 1 ? scale(out, 1.0 / m) : out).backward();
    } else {
      out.backward();  // receives the gradient, sends the input's back
      if (ahead) post_gradient_from(i + 1);
    }
  }
  const double w0 = dist::wait_seconds();
  sends.wait();
  logging::debug(
      "pipeline_parallel: rank {} of pp: forwards {:.2f} ms computing, {:.2f} ms waiting; "
      "backwards {:.2f} ms computing, {:.2f} ms waiting; last sends {:.2f} ms",
      rank_, busy_s[0] * 1e3, waited_s[0] * 1e3, busy_s[1] * 1e3, waited_s[1] * 1e3,
      (dist::wait_seconds() - w0) * 1e3);
  return loss_sum;
}

void Pipeline::reduce_tied_gradient(nn::Module& model) const {
  if (tied_.empty()) return;
  Tensor w = model.find_tensor(tied_);
  Tensor g = w.grad();
  NoGradGuard ng;
  if (!g.defined()) {
    g = zeros(w.shape());
    w.set_grad(g);
  }
  ACC_CHECK_INTERNAL(g.is_contiguous(), "pipeline_parallel: the gradient of '", tied_,
                     "' is not contiguous");
  embedding_group_->allreduce(g, dist::ReduceOp::kSum)->wait();
}

void Pipeline::lift(PlacementTable& table) const {
  if (tied_.empty()) return;
  const bool first = rank_of_stage(0) == rank_;
  for (auto& e : table) {
    if (e.param != tied_) continue;
    if (!first) e.replica += e.replicas;
    e.replicas *= 2;
  }
}

MethodSpec pipeline_parallel_method() {
  return {
      .name = "pipeline_parallel",
      .slot = "pipeline_parallel",
      .exclusive_slot = true,
      .config_keys = {"size", "schedule", "virtual", "micro_batches", "stages"},
      .apply =
          [](const nlohmann::json& c, TrainingPlan& plan) {
            Config cfg = parse(c);
            const std::shared_ptr<const PipelineSchedule> checked =
                checked_schedule(cfg.kind, cfg.size, cfg.virtual_stages, cfg.micro_batches);
            plan.micro_batches = cfg.micro_batches;
            if (!plan.context)
              return;  // validating the config only (or one process: m
                       // micro-batches accumulated, the same computation)
            PipelineSchedule schedule = *checked;
            ACC_CHECK(plan.context->size(dist::MeshDim::kPp) == cfg.size,
                      "pipeline_parallel: size ", cfg.size, " but the run's mesh is ",
                      plan.context->mesh().to_string());
            ACC_CHECK(plan.default_loss,
                      "pipeline_parallel: the last stage computes the language model's own "
                      "next-token loss; a loss function of the user's (ApplyOptions::loss) is "
                      "not run in stages yet");
            auto pipe =
                std::make_shared<Pipeline>(std::move(schedule), std::move(cfg.stages), plan.context,
                                           plan.logits_loss, plan.megatron_sp, plan.sequence_split);
            plan.pipeline = pipe;
            plan.model_transforms.push_back(
                {"pipeline_parallel", [pipe](nn::Module& model) -> Undo {
                   Undo undo = pipe->cut(model);
                   return [pipe, undo] { undo(); };
                 }});
          },
      // The search tries every size that divides the world and leaves each stage a block, with
      // every micro-batch count m that fills the pipeline (a multiple of p, at most 4096, as
      // grad_accum's steps) and divides the batch: the bubble (p - 1) / (m + p - 1) against the
      // micro-batch's size and the first stage's in-flight activations; under 1F1B and, when
      // every rank can hold two stages, interleaved with v = 2. GPipe is not tried: it
      // takes 1F1B's time with every micro-batch in flight. The stages are the FLOP cut until
      // the search, calibrated, re-cuts them by time (auto_accelerate's recut_pipelines); the
      // candidate is priced from the traces of its ranks' stages (layout_rewrite).
      .search_choices =
          [](const SearchContext& ctx) {
            std::vector<nlohmann::json> out;
            if (!ctx.language_model) return out;
            for (int p = 2; p <= ctx.world; ++p) {
              if (ctx.world % p != 0 || ctx.num_blocks < p) continue;
              for (int64_t m = p; m <= ctx.per_rank_batch && m <= 4096; m += p) {
                if (ctx.per_rank_batch % m != 0) continue;
                out.push_back({{"size", p}, {"micro_batches", m}});
                if (ctx.num_blocks >= 2 * p) {
                  out.push_back({{"size", p},
                                 {"schedule", "interleaved"},
                                 {"virtual", 2},
                                 {"micro_batches", m}});
                }
              }
            }
            return out;
          },
      .effects =
          [](const nlohmann::json& c, const SearchContext&, StepEffects& e) {
            const Config cfg = parse(c);
            e.micro_batches = cfg.micro_batches;
            e.pipeline_ranks = cfg.size;
            e.pipeline_virtual = cfg.virtual_stages;
            e.pipeline_schedule = cfg.kind;
          },
      .mesh = [](const nlohmann::json& c, dist::DeviceMesh& mesh) { mesh.pp = size_from(c); },
      .layout = true,
      .never_with = {{"fsdp",
                      "pipeline_parallel does not compose with fsdp (it gathers every unit of "
                      "the whole model on each step): use zero1 or zero2 over dp"},
                     {"grad_accum",
                      "pipeline_parallel accumulates its own micro-batches: drop grad_accum and "
                      "set pipeline_parallel's micro_batches"}}};
}

}  // namespace acc::strategies
