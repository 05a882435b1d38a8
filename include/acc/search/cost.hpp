#pragma once
// The search's time model: what a candidate's optimizer step costs on this machine, from the
// traced ops of its micro-batch and the calibrated throughputs.
//
//   compute   = per micro-batch: every GEMM of the trace at its shape's measured rate
//               (MachineCalibration::gemm_seconds), every other op as memory-bound
//               (bytes read + written at the measured bandwidth), or at the best GEMM rate when
//               it counts FLOPs (fused attention), whichever is slower; plus, for every op of
//               the trace, what the engine costs an op beyond its work (dispatch, allocation,
//               autograd: MachineCalibration::op_overhead_s, measured); recomputed forwards are
//               in the trace. The model's depth comes from traces of 1 and 2 blocks, extrapolated
//               linearly (the blocks repeat), so any depth costs milliseconds.
//   optimizer = the update's pass over this rank's shard: the parameter and its gradient read,
//               the parameter written, and each of the optimizer's k state buffers read and
//               written: 3 + 2k words per parameter (AdamW, k = 2: 7; SGD with momentum: 5).
//   comm      = the candidate's collectives (StepEffects) at the α-β fits of its dp x cp group
//               (CommCalibration), bucket by bucket; gradient buckets overlap the backward of the
//               last micro-batch except the last bucket; fsdp's gathers wait before each block
//               (exposed), twice per micro-batch; after-step gathers are exposed.
//             + the communication vertices of the trace of the candidate's rank (a tensor- or
//               sequence-parallel layout: its all-reduces, all-gathers, reduce-scatters and
//               all-to-alls over tp and cp, forward and backward), each at the fit of its group's
//               size, all exposed (the compute waits for them), per micro-batch. An all-to-all
//               is priced at the all-gather fit of its bytes (each rank sends (n - 1) / n of its
//               buffer either way; calibrate_collectives does not measure all-to-alls).
//   step      = micro_batches x compute + optimizer + exposed comm.
//   pipeline  = each pp rank priced from the trace of its own stages (rank_models: its blocks,
//               the embedding or the head, its messages; a receive at the broadcast fit of a
//               2-rank group, a send free), t_r = forward + backward + messages of a micro-batch
//               through its stages; the schedule takes m x max t_r + (sum t_r - max t_r) / v
//               (equal stages: (m + (p - 1) / v) t, the bubble (p - 1) / (v m + p - 1)), and the
//               stage imbalance shows in max t_r. bubble_s: that time less m x mean t_r (what a
//               rank waits on average). The data-parallel reduction runs after the schedule
//               (exposed), with the optimizer of the rank that takes longest.
//
// The fits by group size: add_group_calibration() gives one measured on groups of that size
// (auto_accelerate measures tp- and cp-sized groups of the job); a size without one is priced at
// the fit of the job's whole group (an offline plan has no other).

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "acc/search/calibration.hpp"
#include "acc/search/cluster.hpp"
#include "acc/search/space.hpp"

#include "acc/trace/model_ref.hpp"

namespace acc::search {

namespace detail {
struct OpsDigest;  // what the time model reads of a trace (search/ops_digest.hpp)
}  // namespace detail

struct TimePrediction {
  double compute_s = 0;   // forward + backward of all micro-batches
  double backward_s = 0;  // of one micro-batch (what bucketed communication overlaps)
  double optimizer_s = 0;
  double comm_s = 0;          // all communication of the step
  double exposed_comm_s = 0;  // the part not hidden behind backward
  /// A pipeline's idle time per rank (the bubble and the stages' imbalance), in compute_s; 0
  /// without one.
  double bubble_s = 0;
  /// The collectives and received messages in exposed_comm_s (a pipeline's: its slowest rank's;
  /// overlapped buckets: the exposed part in messages): what the per-collective wait of
  /// time-sliced ranks (CommCalibration::wait_s) is paid on.
  double waits = 0;
  double step_s = 0;
  nlohmann::json to_json() const;
};

class CostModel {
 public:
  /// `comm` may be for one rank (world 1: no communication). `contention` multiplies every compute
  /// time (forward, backward, optimizer): how much slower the job's ranks compute together than
  /// one alone, as measure_compute_contention() gives it (1: no sharing).
  CostModel(std::string model_type, nlohmann::json config, int64_t seq_len,
            MachineCalibration machine, CommCalibration comm, double contention = 1.0);
  /// Any model (trace::ModelRef: a user's module is priced from its whole trace).
  CostModel(trace::ModelRef model, int64_t seq_len, MachineCalibration machine,
            CommCalibration comm, double contention = 1.0);
  /// A cluster not at hand: every op, collective and message priced by `cluster`'s figures
  /// (cluster.hpp), each group placed by the candidate's mesh; no contention.
  CostModel(trace::ModelRef model, int64_t seq_len, ClusterProfile cluster);
  /// The job's ranks x threads over a machine's cores, when more than 1 (they time-slice the
  /// cores; `contention` is then at least this share). A pipeline's schedule is then run action
  /// by action (strategies::simulated_schedule_time): each rank computing at the contention
  /// beyond the slicing, slowed further while more of the job's ranks compute at once than the
  /// cores hold, so its ranks idle in the fill and drain leave their cores to the others. Throws
  /// acc::ValueError for a share not finite or above the contention.
  void set_time_slicing(double share);
  TimePrediction predict(const Candidate& c);
  /// The cut of `c`'s pipeline whose stages take the most even predicted time
  /// (strategies::balance_stages): a stage costs its blocks, and the first stage also the
  /// embedding and the last the final norm, head and loss, each in its blocks' time as the first
  /// and last pp ranks' traces price a micro-batch on this machine (blocks from the 1- and 2-block
  /// extrapolation, the rest what is left). nullopt without a pipeline. pipeline_parallel's own
  /// cut counts the head's FLOPs instead (strategies::head_cost_in_blocks), which misses what the
  /// memory-bound ops of the head and the loss cost.
  std::optional<std::vector<strategies::StageBlocks>> balanced_stages(const Candidate& c);
  /// What balanced_stages charges the first and the last stage beyond their blocks, in blocks.
  struct StageEnds {
    double first = 0, last = 0;
  };
  std::optional<StageEnds> stage_ends(const Candidate& c);
  /// The cut `c`'s pipeline has now (its strategy's "stages", else pipeline_parallel's FLOP cut),
  /// stage by stage; empty without a pipeline.
  std::vector<strategies::StageBlocks> stages_of(const Candidate& c);
  /// The optimizer's parameter-sized state buffers (optim::optimizer_state_buffers: AdamW 2, the
  /// default; SGD with momentum 1; SGD 0), which its update reads and writes. Throws
  /// acc::ValueError when negative.
  void set_optimizer_state_buffers(int buffers);
  /// Tells the model the candidates it will predict: a pass first traced for one of the
  /// (micro-batch, dp) of the candidates running a rank's trace with the same activation options
  /// (batch_pair_key) is then priced at all of them from the same traces at 2 and 3 samples
  /// (trace::BatchTraces: the traces at any larger batch, to the byte), instead of traced again
  /// for each. Optional. It also makes those passes at once, on the configured threads
  /// (acc::set_num_threads; a module of the user's on one): the predictions that follow find them
  /// made, the same as they would make them. A layout the model refuses is left to predict.
  void expect(const std::vector<Candidate>& candidates);
  /// The same for the candidates pointed to (a search's that fit its memory budget).
  void expect(const std::vector<const Candidate*>& candidates);
  /// Passes traced so far (each from 2 or 3 traces, or from their pairs at 2 and 3 samples for
  /// every expected micro-batch): what the predictions so far cost in traces.
  size_t passes_priced() const { return passes_traced_; }
  /// Its traces kept in `cache` (RankModels::share_traces; by default a cache of its own): the
  /// memory model's of the same search, whose passes trace much the same.
  void share_traces(std::shared_ptr<trace::TraceCache> cache) {
    ranks_->share_traces(std::move(cache));
  }
  const std::shared_ptr<trace::TraceCache>& traces() const { return ranks_->traces(); }
  /// Its rank models those of `ranks` (MemoryModel::rank_models of the same search: the same
  /// model and sequence length, else acc::InternalError), their traces with them: each layout's
  /// ranks made once for both models (making them again was a second of GPT-3 175B's plan-only
  /// search on 1024 devices). Call it before the first expect() or predict().
  void share_rank_models(std::shared_ptr<RankModels> ranks);
  /// The α-β fits measured on groups of `comm.world` ranks (a tp or cp group of the job).
  void add_group_calibration(CommCalibration comm);
  /// The fits for a group of `size` ranks: measured on that size, else the job's.
  const CommCalibration& comm_for(int size) const;

  /// The GEMM shapes of a micro-batch step (for calibrating before predicting).
  static std::vector<GemmShape> shapes_to_measure(const std::string& model_type,
                                                  const nlohmann::json& config,
                                                  const std::vector<int64_t>& micro_batches,
                                                  int64_t seq_len);
  static std::vector<GemmShape> shapes_to_measure(const trace::ModelRef& model,
                                                  const std::vector<int64_t>& micro_batches,
                                                  int64_t seq_len);
  /// Every GEMM shape the candidates' ranks run: each layout's pp ranks (tensor-parallel shards
  /// multiply smaller matrices; the head's projection is on the last stage alone) at each
  /// micro-batch of the candidates of that layout. Sorted, each once. Throws what a layout's
  /// rewrite throws for a layout the model refuses (MemoryModel::layout_refusal: leave those out).
  static std::vector<GemmShape> shapes_to_measure_for(
      const trace::ModelRef& model, const std::vector<const Candidate*>& candidates,
      int64_t seq_len);

 private:
  struct PassCost {
    double forward_s = 0, backward_s = 0;
    double comm_forward_s = 0, comm_backward_s = 0;  // the trace's own communication
    double comm_waits = 0;                           // its collectives and received messages
    int64_t parameters = 0;                          // elements of the whole model
    int64_t block_parameters = 0;                    // elements of one block
    double block_s = 0;  // one block's forward and backward compute (0: traced whole)
    int64_t num_blocks = 0;
  };
  /// The forward and backward of a micro-batch of `rank`'s model with the candidate's activation
  /// options (kept under the rank's RankModel::trace_id).
  const PassCost& pass(const Candidate& c, const RankModel& rank,
                       const trace::TraceOptions& activations);
  TimePrediction predict_pipeline(const Candidate& c, const std::vector<RankModel>& ranks);
  // The activation options stage_ends prices a pipeline rank's pass at: the candidate's for the
  // rank, nothing recomputed.
  static trace::TraceOptions end_options(const Candidate& c, const RankModel& r);
  // (the rank's trace_id, the mesh's dp on a cluster (it places the pp neighbours; else 0),
  // micro-batch, the activation options' key_fields()): numbers, not the trace key's string,
  // which the warm pricing made and compared for each rank of 10^5 candidates.
  using PassKey = std::tuple<int, int, int64_t, trace::TraceOptions::KeyFields>;
  PassKey pass_key(int trace_id, const dist::DeviceMesh& mesh, int64_t micro_batch,
                   const trace::TraceOptions& activations) const;
  // (micro-batch, dp) -> the mesh of a candidate asked at them.
  using Asked = std::map<std::pair<int64_t, int>, dist::DeviceMesh>;
  // Passes made, not kept yet, and the traces' sets they cost (as passes_traced_ counts).
  struct MadePasses {
    std::vector<std::pair<PassKey, PassCost>> passes;
    size_t traced = 0;
  };
  // The passes of `rank`'s model (keyed by its trace_id) with activation options `a` at each of
  // `asked`:
  // with `paired`, those from BatchTraces::kLow up of a registry model from one set of trace
  // pairs when they follow the batch, the rest each from its own traces. Reads no member but the
  // pricing's (const): expect() runs it on several threads.
  MadePasses make_passes(const RankModel& rank, const trace::TraceOptions& a, const Asked& asked,
                         bool paired) const;
  // Of `expected`, those whose pass is not made (each pass key once); `from_low`: from
  // BatchTraces::kLow up only.
  Asked not_made(int trace_id, const trace::TraceOptions& a, const Asked& expected,
                 bool from_low) const;
  void keep(MadePasses made);
  /// The pass of a model of `num_blocks` blocks from its traces' digests of 1 and 2 blocks (and of
  /// 1 recomputed: `r1`, null when nothing is), priced on `mesh`.
  PassCost extrapolated_pass(const detail::OpsDigest& t1, const detail::OpsDigest& t2,
                             const detail::OpsDigest* r1, int64_t num_blocks,
                             const dist::DeviceMesh& mesh,
                             const trace::TraceOptions& activations) const;
  /// The data-parallel methods' communication of a rank holding `p`'s parameters (StepEffects'
  /// collectives over dp x cp), added to `t`; `overlap`: whether gradient buckets overlap the
  /// last backward.
  void add_data_parallel_comm(const Candidate& c, const PassCost& p, bool overlap,
                              TimePrediction& t) const;

  trace::ModelRef model_;
  std::shared_ptr<RankModels> ranks_;          // the model as each pp rank of a candidate runs it
  std::map<int, CommCalibration> group_comm_;  // by group size
  int64_t seq_len_;
  MachineCalibration machine_;
  CommCalibration comm_;
  double contention_ = 1.0;
  double sliced_ = 1.0;                    // set_time_slicing
  std::optional<ClusterProfile> cluster_;  // set: priced for a cluster, not this machine
  int optimizer_buffers_ = 2;              // AdamW's exp_avg and exp_avg_sq
  std::map<PassKey, PassCost> passes_;
  size_t passes_traced_ = 0;
  // -> the candidates expected (expect).
  std::map<RankTraceKey, Asked> expected_;
};

/// A pipeline candidate re-cut where `cost` balances its stages' time (balanced_stages), with the
/// first stage's memory respected: while a cut's predicted peak (`memory`) plus `margin` of it is
/// over `budget` bytes, the first stage, which holds the most micro-batches in flight, gives up a
/// block (the later stages balanced over the rest). The first cut that fits, written into the
/// candidate's strategy as pipeline_parallel's "stages", with its memory; nullopt when `c` has no
/// pipeline, or the cut reached is `c`'s own (pipeline_parallel's FLOP cut or the user's), or no
/// cut fits.
struct Recut {
  Candidate candidate;
  MemoryPrediction memory;
};
std::optional<Recut> rebalanced_pipeline(const Candidate& c, CostModel& cost, MemoryModel& memory,
                                         int64_t budget, double margin);

}  // namespace acc::search
