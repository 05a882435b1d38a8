#pragma once
// Pipeline schedules as data (PyTorch pipelining's idea): for every rank of a pipeline, the
// ordered list of what it computes, each action a forward or a backward of one micro-batch
// through one stage. A schedule is built by a plain function of (ranks, virtual stages,
// micro-batches), checked by validate() before anything runs, and then executed action by action
// (strategies/pipeline_parallel.cpp); tests compare the builders with golden tables
// (tests/strategies/data/schedule_*.txt).
//
// Stages: the model is cut into S = ranks x virtual consecutive stages; stage s lives on rank
// s % ranks (virtual 1: stage r on rank r; Megatron's interleaving: rank r holds stages r,
// r + ranks, ...). Messages: a forward of stage s > 0 receives its input from stage s - 1's rank,
// a forward of stage s < S - 1 sends its output to stage s + 1's rank; a backward of stage
// s < S - 1 receives its output's gradient from stage s + 1's rank, a backward of stage s > 0
// sends its input's gradient to stage s - 1's rank. Messages between two ranks are matched by
// their order (dist::send_to / recv_from), so both ends must list them in the same order.
//
//   kind         virtual   in flight on rank r (forwards whose backward has not run)
//   gpipe        1         every micro-batch: all forwards, then all backwards
//   1f1b         1         min(ranks - r, m): warm-up forwards, then one forward one backward
//   interleaved  v >= 2    Megatron's interleaved 1F1B, m a multiple of ranks: warm-up
//                          min(2 (ranks - r - 1) + (v - 1) ranks, m v) forwards, one more in
//                          flight at most; bubble (ranks - 1) / (v m) against 1F1B's
//                          (ranks - 1) / m

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace acc::strategies {

/// The blocks a stage runs: [begin, end) of the model's blocks.
struct StageBlocks {
  int64_t begin = 0, end = 0;
  bool operator==(const StageBlocks&) const = default;
};

enum class ScheduleKind { kGPipe, kOneFOneB, kInterleaved };
/// "gpipe", "1f1b", "interleaved".
const char* schedule_kind_name(ScheduleKind k);
/// The kind named `name`; acc::ValueError naming it and the known ones otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);

enum class PipeStep { kForward, kBackward };

struct PipeAction {
  PipeStep step = PipeStep::kForward;
  int micro_batch = 0;
  int stage = 0;  // the global stage, 0 .. ranks x virtual - 1
  bool operator==(const PipeAction&) const = default;
};
/// "F3" / "B3" (virtual 1), "F3@2" (micro-batch 3 through stage 2) otherwise.
std::string to_string(const PipeAction& a, bool with_stage);

struct PipelineSchedule {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks = 1;
  int virtual_stages = 1;
  int micro_batches = 1;
  /// Per rank, its actions in order.
  std::vector<std::vector<PipeAction>> actions;
  /// Per rank, the most forwards it promises to hold in flight (their activations alive).
  std::vector<int> max_in_flight;

  int num_stages() const { return ranks * virtual_stages; }
  int rank_of_stage(int stage) const { return stage % ranks; }
  /// One line per rank: "rank 0: F0 F1 B0 F2 B1 F3 B2 B3" (the golden tables' format).
  std::string to_string() const;
};

/// The schedule of `kind` for `ranks` ranks of `virtual_stages` stages each and `micro_batches`
/// micro-batches per step. Throws acc::ValueError naming the value for ranks, virtual stages or
/// micro-batches below 1, virtual_stages != 1 for gpipe and 1f1b, virtual_stages < 2 for
/// interleaved, and for interleaved micro-batches that are not a multiple of ranks.
PipelineSchedule make_schedule(ScheduleKind kind, int ranks, int virtual_stages, int micro_batches);

/// make_schedule, then validate: each distinct (kind, ranks, virtual stages, micro-batches) built
/// and checked once per process and copied from then on (the search asks for the same schedules
/// for many candidates, and checking pp 64 x 512 micro-batches takes milliseconds), shared from
/// then on (a copy of that one is 130,000 actions). Thread-safe. Throws what make_schedule and
/// validate throw (a refusal is not kept).
std::shared_ptr<const PipelineSchedule> checked_schedule(ScheduleKind kind, int ranks,
                                                         int virtual_stages, int micro_batches);

/// Checks a schedule before it runs; throws acc::ValueError naming the rank and the step (its
/// index and action) of the first fault:
///  - an action of a stage another rank holds, a micro-batch or stage out of range;
///  - an action listed twice, or one missing (every micro-batch has one forward and one backward
///    through every stage);
///  - a backward before its forward on the same rank;
///  - more forwards in flight than the rank's max_in_flight;
///  - messages out of order: a rank that receives from another in an order the sender does not
///    send in (the runtime matches them by order);
///  - a deadlock: running the ranks' lists with receives that wait for their message and sends
///    that do not wait (the runtime defers them: dist::DeferredSends), some rank can never go on
///    (the message names every stuck rank and what it waits for).
void validate(const PipelineSchedule& schedule);

/// The time of a 1F1B or interleaved schedule of `micro_batches` micro-batches whose rank r takes
/// `per_micro_batch[r]` for one micro-batch through its stages: m x the slowest rank, plus the
/// others' fill and drain, (sum - slowest) / v with v `virtual_stages` a rank. For equal ranks the
/// idle share is (p - 1) / (v m + p - 1); messages are not counted. Throws acc::ValueError for no
/// ranks, or m or v < 1.
double schedule_time(const std::vector<double>& per_micro_batch, int micro_batches,
                     int virtual_stages);

/// What one rank of a pipeline spends on each of its actions (simulated_schedule_time): compute,
/// in seconds with the rank computing alone on its cores, and communication (its stage's
/// messages and collectives), which it waits for without computing.
struct ActionCosts {
  double forward_s = 0, backward_s = 0;
  double forward_comm_s = 0, backward_comm_s = 0;
};

/// The time of `schedule` run action by action on ranks that share cores: each rank runs its
/// actions in order, an action starting once the one before it on the rank has finished and its
/// input has been sent (a forward's from the previous stage, a backward's from the next), then
/// communicating for its comm seconds and computing for its compute seconds. While n ranks of the
/// pipeline compute at once each computes `slowdown(n)` times slower (processor sharing: n ranks
/// time-sliced over fewer cores; 1 for ranks with a core each). `per_rank[r]` is rank r's cost of
/// one action. With slowdown 1 and equal ranks, 1F1B and interleaved take schedule_time's
/// formula. Throws acc::ValueError for a cost per rank that the schedule does not have, a cost
/// that is negative or not finite, and a slowdown below 1 or not finite (naming it).
double simulated_schedule_time(const PipelineSchedule& schedule,
                               const std::vector<ActionCosts>& per_rank,
                               const std::function<double(int computing)>& slowdown);

}  // namespace acc::strategies
