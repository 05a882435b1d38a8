#pragma once
// The search's time model: what a candidate's optimizer step costs on this machine, from the
// traced ops of its micro-batch and the calibrated throughputs.
//
//   compute   = per micro-batch: every GEMM of the trace at its shape's measured rate
//               (MachineCalibration::gemm_seconds), every other op as memory-bound
//               (bytes read + written at the measured bandwidth), or at the best GEMM rate when
//               it counts FLOPs (fused attention), whichever is slower; recomputed forwards are
//               in the trace. The model's depth comes from traces of 1 and 2 blocks, extrapolated
//               linearly (the blocks repeat), so any depth costs milliseconds.
//   optimizer = AdamW's pass over this rank's shard: 7 words read or written per parameter.
//   comm      = the candidate's collectives (StepEffects) at the α-β fits of the job's group
//               (CommCalibration), bucket by bucket; gradient buckets overlap the backward of the
//               last micro-batch except the last bucket; fsdp's gathers wait before each block
//               (exposed), twice per micro-batch; after-step gathers are exposed.
//   step      = micro_batches x compute + optimizer + exposed comm.

#include <map>
#include <string>
#include <tuple>

#include "acc/search/calibration.hpp"
#include "acc/search/space.hpp"

#include "acc/trace/model_ref.hpp"

namespace acc::search {

struct TimePrediction {
  double compute_s = 0;   // forward + backward of all micro-batches
  double backward_s = 0;  // of one micro-batch (what bucketed communication overlaps)
  double optimizer_s = 0;
  double comm_s = 0;          // all communication of the step
  double exposed_comm_s = 0;  // the part not hidden behind backward
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
  TimePrediction predict(const Candidate& c);

  /// The GEMM shapes of a micro-batch step (for calibrating before predicting).
  static std::vector<GemmShape> shapes_to_measure(const std::string& model_type,
                                                  const nlohmann::json& config,
                                                  const std::vector<int64_t>& micro_batches,
                                                  int64_t seq_len);
  static std::vector<GemmShape> shapes_to_measure(const trace::ModelRef& model,
                                                  const std::vector<int64_t>& micro_batches,
                                                  int64_t seq_len);

 private:
  struct PassCost {
    double forward_s = 0, backward_s = 0;
    int64_t parameters = 0;        // elements of the whole model
    int64_t block_parameters = 0;  // elements of one block
    int64_t num_blocks = 0;
  };
  /// The forward and backward of a micro-batch with the candidate's activation options.
  const PassCost& pass(int64_t micro_batch, const trace::TraceOptions& activations);

  trace::ModelRef model_;
  int64_t seq_len_;
  MachineCalibration machine_;
  CommCalibration comm_;
  double contention_ = 1.0;
  // (micro-batch, recomputation, recomputed blocks, bf16 activations).
  std::map<std::tuple<int64_t, int, int64_t, bool>, PassCost> passes_;
};

}  // namespace acc::search
