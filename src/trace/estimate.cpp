#include "acc/trace/estimate.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <tuple>

#include "acc/models/language_model.hpp"
#include "acc/trace/batch_traces.hpp"
#include "acc/trace/dump.hpp"
#include "acc/trace/model_ref.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"
#include "acc/util/hash.hpp"

namespace acc::trace {
namespace {

// The memory timeline of a step cut where its N blocks begin and end (TimelineCut). A deep
// model whose block i stands for counts[i] blocks of the same kind and place runs each block's two
// segments counts[i] times. Repetition r of a segment starts r x (its net change) higher than the
// first, so the highest point over the repetitions lies in the first or the last: the peak of the
// deep step follows exactly, wherever in the step it falls.
using Segment = TimelineSegment;
using Curve = std::vector<Segment>;

// Parameters are all born before the first op and die after the last, so they sit under the whole
// timeline as one constant (the deep model's parameter bytes) and are left out of `live`.
struct Timeline {
  bool ok = false;  // the ops fell into the segments above, in order
  // Some ran between two blocks (a pipeline rank's messages between its stages), counted with the
  // block before them: a cut whose blocks stand for several would repeat them, so only a
  // timeline of every block (each standing for itself) is read then.
  bool inner_ops = false;
  bool plain() const { return ok && !inner_ops; }
  Curve live;          // every storage but the parameters (estimate_memory's peak)
  Curve activations;   // activations only (estimate_memory's activations_peak)
  Curve blockwise;     // `live` with the blocks' gradients held as fsdp holds them (when asked)
  Curve accumulating;  // activations, each gradient only as it is made (TimelineCut)
};

// Adds `bytes` (born > 0, died < 0) to a segment's running total.
void add_event(Segment& sg, int64_t bytes) {
  sg.delta = checked_add(sg.delta, bytes, "bytes alive in the step");
  sg.high = sg.any ? std::max(sg.high, sg.delta) : sg.delta;
  sg.any = true;
}

// A gradient of `bytes` added into the one held (an earlier micro-batch's) and freed: alive only
// for a moment above the segment's running total.
void add_moment(Segment& sg, int64_t bytes) {
  const int64_t moment = checked_add(sg.delta, bytes, "bytes of an accumulation");
  sg.high = sg.any ? std::max(sg.high, moment) : moment;
  sg.any = true;
}

// The end of block b's backward segment in the blockwise curve (see BlockwiseGradients): the
// previous block's buffer completes (`previous`: every block's backward but the first has one),
// a buffer of the block's live gradients `grads` is taken while they are alive, they are dropped,
// and the buffer's in-flight share stays.
void end_block_backward(Segment& sg, int64_t grads, double in_flight_fraction, bool previous,
                        const std::string& label) {
  const int64_t in_flight =
      static_cast<int64_t>(std::llround(in_flight_fraction * static_cast<double>(grads)));
  if (previous) sg.delta = checked_add(sg.delta, -in_flight, label, ": bytes in flight");
  const int64_t packing = checked_add(sg.delta, grads, label, ": bytes packed");
  sg.high = sg.any ? std::max(sg.high, packing) : packing;
  sg.any = true;
  sg.delta = checked_add(sg.delta, in_flight - grads, label, ": bytes in flight");
  sg.high = std::max(sg.high, sg.delta);
}

Timeline timeline(const Trace& t, const std::vector<std::string>& blocks,
                  std::optional<BlockwiseGradients> blockwise) {
  Timeline tl;
  const Graph& g = t.graph;
  const int N = static_cast<int>(blocks.size());
  const int between = N + 1, after = 2 * N + 2;
  std::vector<int> seg_of_op;
  std::vector<bool> seen(static_cast<size_t>(after + 1), false);
  int seg = 0;
  for (VertexId v : g.ops()) {
    const Vertex& vx = g.vertex(v);
    int block = -1;
    for (int b = 0; b < N; ++b) {
      // The block itself or a module inside it ("<block>." first), without making that string.
      const std::string& name = blocks[b];
      const std::string& scope = vx.scope;
      if (scope.size() >= name.size() && scope.compare(0, name.size(), name) == 0 &&
          (scope.size() == name.size() || scope[name.size()] == '.')) {
        block = b;
      }
    }
    int s = -1;
    if (block >= 0) {
      s = vx.phase == Phase::kForward ? 1 + block : 2 * N + 1 - block;
    } else if (seg == 0 || seg >= 2 * N + 1) {
      s = seg == 0 ? 0 : after;
    } else if (seg == N || seg == between) {
      s = between;
    } else {
      // Between two blocks of a forward or a backward: a pipeline rank's message between its
      // stages (send_to, recv_from), with the block before it.
      s = seg;
      tl.inner_ops = true;
    }
    if (s < seg) return tl;  // not the structure the extrapolation assumes
    seg = s;
    seen[s] = true;
    seg_of_op.push_back(s);
  }
  for (int b = 1; b <= N; ++b) {
    if (!seen[b]) return tl;
  }
  tl.live.resize(seen.size());
  tl.activations.resize(seen.size());
  tl.accumulating.resize(seen.size());
  if (blockwise) tl.blockwise.resize(seen.size());
  const bool accumulated = blockwise && blockwise->accumulated;
  auto is_block_backward = [N](int s) { return s >= N + 2 && s <= 2 * N + 1; };
  // Blockwise: gradients born in a block's backward and alive at its end (storage -> bytes), and
  // those dropped there (their later deaths are not counted again).
  std::map<uint64_t, int64_t> block_grads;
  std::set<uint64_t> dropped;
  int open = -1;  // the block backward segment whose end is not applied yet
  auto close = [&] {
    if (open < 0) return;
    int64_t grads = 0;
    for (const auto& [storage, bytes] : block_grads) {
      grads = checked_add(grads, bytes, "gradient bytes of a block");
      dropped.insert(storage);
    }
    block_grads.clear();
    end_block_backward(tl.blockwise[open], grads, blockwise->in_flight_fraction, open != N + 2,
                       "blockwise gradients");
    open = -1;
  };
  for (const MemoryEvent& ev : g.memory_events()) {
    const int s = ev.op_index < 0 ? 0 : seg_of_op.at(static_cast<size_t>(ev.op_index));
    const bool parameter = g.parameter_storages().count(ev.storage) > 0;
    const bool gradient = g.gradient_storages().count(ev.storage) > 0;
    const bool activation = !parameter && !gradient && !g.input_storages().count(ev.storage);
    bool in_blockwise = blockwise && !parameter;
    if (in_blockwise) {
      if (open >= 0 && s != open) close();
      if (is_block_backward(s)) open = s;
      if (gradient && ev.bytes > 0 && is_block_backward(s)) block_grads[ev.storage] = ev.bytes;
      if (gradient && ev.bytes < 0) {
        block_grads.erase(ev.storage);
        in_blockwise = !dropped.count(ev.storage);
      }
      if (gradient && accumulated) {
        // The gradient already held is counted apart.
        if (ev.bytes > 0) add_moment(tl.blockwise[s], ev.bytes);
        in_blockwise = false;
      }
    }
    for (Curve* c : {parameter ? nullptr : &tl.live, activation ? &tl.activations : nullptr,
                     in_blockwise ? &tl.blockwise : nullptr}) {
      if (c != nullptr) add_event((*c)[s], ev.bytes);
    }
    if (activation) {
      add_event(tl.accumulating[s], ev.bytes);
    } else if (gradient && ev.bytes > 0) {
      add_moment(tl.accumulating[s], ev.bytes);  // estimate_memory's accumulating_peak
    }
  }
  if (blockwise) close();
  tl.ok = true;
  return tl;
}

// The highest running total of `c` (from 0) with block i's segments repeated counts[i] times.
int64_t peak_of(const Curve& c, const std::vector<int64_t>& counts, const std::string& label,
                const char* what) {
  const size_t N = counts.size();
  std::vector<int64_t> reps(2 * N + 3, 1);
  for (size_t b = 0; b < N; ++b) reps[1 + b] = reps[2 * N + 1 - b] = counts[b];
  int64_t start = 0, peak = 0;
  for (size_t s = 0; s < reps.size(); ++s) {
    const Segment& sg = c.at(s);
    if (reps[s] == 0) continue;
    if (sg.any) {
      const int64_t growth =
          std::max<int64_t>(0, checked_mul(reps[s] - 1, sg.delta, label, ": ", what));
      peak = std::max(peak, checked_add(checked_add(start, sg.high, label, ": ", what), growth,
                                        label, ": ", what));
    }
    start =
        checked_add(start, checked_mul(reps[s], sg.delta, label, ": ", what), label, ": ", what);
  }
  return peak;
}

// The figures of one trace: those linear in the block count, and the cut timeline.
struct Sample {
  int64_t parameters = 0;
  MemoryEstimate memory;
  ComputeEstimate compute;
  int64_t vertices = 0, ops = 0, forward_ops = 0;
  Timeline timeline;
};

}  // namespace

// What estimate_training_need(s) read of one trace: its Sample and its blocks, kept beside the
// trace where the model keeps its traces (ModelRef::figures), so that the needs of several stage
// layouts and micro-batch lists sharing a trace evaluate it once.
struct TraceFigures {
  Sample sample;
  bool has_blocks = false;
  std::string block_type, block_container;
  int64_t parameters_per_block = 0;
};

namespace {

// The figures of a trace whose repeated blocks are `groups`.
std::shared_ptr<const TraceFigures> figures_of(const Trace& t,
                                               const std::vector<BlockGroup>& groups,
                                               const std::string& optimizer,
                                               std::optional<BlockwiseGradients> blockwise) {
  auto f = std::make_shared<TraceFigures>();
  Sample& s = f->sample;
  s.parameters = t.num_parameters;
  s.memory = estimate_memory(t, optimizer);
  s.compute = estimate_compute(t);
  s.vertices = static_cast<int64_t>(t.graph.num_vertices());
  s.ops = static_cast<int64_t>(t.graph.ops().size());
  s.forward_ops = t.graph.backward_begin();
  if (!groups.empty()) {
    s.timeline = timeline(t, groups.front().blocks, blockwise);
    f->has_blocks = true;
    f->block_type = groups.front().type_name;
    f->block_container = groups.front().container;
    f->parameters_per_block = groups.front().parameters_per_block;
  }
  return f;
}

// The sample of `f`, its blocks written into `blocks_out` (when given and it has them).
Sample taken(const TraceFigures& f, TrainingNeed* blocks_out) {
  if (blocks_out != nullptr && f.has_blocks) {
    blocks_out->block_type = f.block_type;
    blocks_out->block_container = f.block_container;
    blocks_out->parameters_per_block = f.parameters_per_block;
  }
  return f.sample;
}

// What a trace's figures depend on beyond the trace (ModelRef::figures' `what`).
std::string figures_what(const std::string& optimizer,
                         const std::optional<BlockwiseGradients>& blockwise) {
  std::string w = optimizer;
  if (blockwise) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "|%a|%d", blockwise->in_flight_fraction,
                  blockwise->accumulated ? 1 : 0);
    w += buf;
  }
  return w;
}

Sample sample(const ModelRef& ref, int64_t layers, int64_t batch, int64_t seq_len,
              const TraceOptions& options, const std::string& optimizer,
              std::optional<BlockwiseGradients> blockwise, TrainingNeed* blocks_out = nullptr) {
  const auto f =
      ref.figures(layers, batch, seq_len, options, figures_what(optimizer, blockwise), [&] {
        const std::shared_ptr<const ModelRef::Traced> traced =
            ref.traced(layers, batch, seq_len, options);
        return figures_of(traced->trace, traced->blocks, optimizer, blockwise);
      });
  return taken(*f, blocks_out);
}

// `o`'s key fields when every one of `layers` blocks runs alike under it (none recomputed, or
// all), in traced_alike's form, else nullopt (the first blocks recomputed, the rest plain).
std::optional<TraceOptions::KeyFields> uniform_kind(const TraceOptions& o, int64_t layers) {
  const TraceOptions u = traced_alike(o, layers);
  if (u.recompute != Recompute::kNone && u.recompute_blocks != -1) return std::nullopt;
  return u.key_fields();
}

// A run of `count` blocks of one kind, as few blocks as keep its first, middle and last distinct
// (each sees other neighbours), with how many of the deep model's blocks each stands for.
void add_run(int64_t count, std::vector<int64_t>& counts) {
  if (count >= 1) counts.push_back(1);
  if (count >= 3) counts.push_back(count - 2);
  if (count >= 2) counts.push_back(1);
}

// f = base + plain * (two - base) + recomputed * (mixed - base), every step checked: `base` is
// the 1-block trace, `two` the 2-block one, `mixed` the 2-block one with its first block
// recomputed; `plain` and `recomputed` count the full model's blocks beyond the first by kind.
struct Extrapolation {
  std::string label;  // "gpt n_layer 1000000000", for errors
  int64_t plain = 0, recomputed = 0;

  int64_t operator()(int64_t base, int64_t two, int64_t mixed, const char* what) const {
    int64_t f =
        checked_add(base, checked_mul(plain, two - base, label, ": ", what), label, ": ", what);
    if (recomputed > 0) {
      f = checked_add(f, checked_mul(recomputed, mixed - base, label, ": ", what), label, ": ",
                      what);
    }
    return f;
  }
};

// One trace of estimate_training_need (its block count, options and blockwise gradients) at
// the need's batch.
using Sampler =
    std::function<Sample(int64_t layers, const TraceOptions& options,
                         std::optional<BlockwiseGradients> blockwise, TrainingNeed* blocks_out)>;

}  // namespace

TrainingNeed estimate_training_need(const std::string& model_type, const nlohmann::json& config,
                                    int64_t batch, int64_t seq_len, const TraceOptions& options,
                                    const std::string& optimizer,
                                    std::optional<BlockwiseGradients> blockwise) {
  return estimate_training_need(ModelRef::registry(model_type, config), batch, seq_len, options,
                                optimizer, blockwise);
}

namespace {

// The checks of estimate_training_need(s), before any work; returns the sequence length (0: the
// model's maximum).
int64_t checked_need_args(const ModelRef& ref, int64_t batch, int64_t seq_len,
                          const TraceOptions& options, const std::string& optimizer,
                          std::optional<BlockwiseGradients> blockwise) {
  ACC_CHECK(batch >= 1, "batch size must be > 0, got ", batch);
  ACC_CHECK(seq_len >= 0, "sequence length must be > 0 (or 0: the model's maximum), got ", seq_len);
  ACC_CHECK(options.recompute_blocks >= -1, "recompute_blocks must be >= 0 or -1 (all), got ",
            options.recompute_blocks);
  (void)optimizer_state_factor(optimizer);  // validate before the work
  if (blockwise) {
    ACC_CHECK(std::isfinite(blockwise->in_flight_fraction) && blockwise->in_flight_fraction >= 0,
              "blockwise gradients: the in-flight fraction must be >= 0, got ",
              blockwise->in_flight_fraction);
  }
  return seq_len == 0 ? ref.max_seq_len() : seq_len;
}

// The need from the samples `sample_at` gives at `batch` (seq_len resolved, arguments checked).
TrainingNeed need_from(const ModelRef& ref, int64_t batch, int64_t seq_len,
                       const TraceOptions& options, const std::string& optimizer,
                       std::optional<BlockwiseGradients> blockwise, const Sampler& sample_at) {
  TrainingNeed need;
  need.model_type = ref.type();
  need.layers_key = ref.layers_key();
  need.num_layers = ref.num_layers();
  need.batch = batch;
  need.optimizer = optimizer;
  need.seq_len = seq_len;

  const int64_t n = need.num_layers;
  // Recomputation of the first k of n blocks mixes two kinds of block; all or none is one kind.
  const bool partial = options.recompute != Recompute::kNone && options.recompute_blocks >= 0 &&
                       options.recompute_blocks < n;
  const int64_t k = partial ? options.recompute_blocks : 0;
  TraceOptions uniform = options;
  if (partial) uniform.recompute_blocks = 0;
  Extrapolation ex;
  ex.label = ref.type() + " " + need.layers_key + " " + std::to_string(n);
  // Counts, FLOPs and graph sizes from 1 and 2 blocks (and 2 with the first recomputed). A module
  // that is not the registry's is traced whole, and so is a model as shallow as the samples.
  const bool direct = !ref.extrapolates() || (n <= 3 && !partial);
  Sample base, two, mixed;
  if (direct) {
    base = two = mixed = sample_at(n, options, blockwise, &need);
  } else {
    base = sample_at(1, uniform, {}, &need);
    two = sample_at(2, uniform, {}, nullptr);
    ex.plain = n - 1;
    if (k > 0) {
      TraceOptions first = options;
      first.recompute_blocks = 1;
      mixed = sample_at(2, first, {}, nullptr);
      ex.recomputed = k;
      ex.plain = n - 1 - k;  // >= 0: partial means k < n
    }
  }
  need.parameters = ex(base.parameters, two.parameters, mixed.parameters, "parameters");
  need.memory.parameters =
      ex(base.memory.parameters, two.memory.parameters, mixed.memory.parameters, "parameter bytes");
  need.memory.gradients =
      ex(base.memory.gradients, two.memory.gradients, mixed.memory.gradients, "gradient bytes");
  need.memory.optimizer_state = ex(base.memory.optimizer_state, two.memory.optimizer_state,
                                   mixed.memory.optimizer_state, "optimizer state bytes");
  // What the forward saves is a sum over the blocks: linear as the counts.
  need.memory.activations_saved =
      direct ? base.memory.activations_saved
             : ex(base.memory.activations_saved, two.memory.activations_saved,
                  mixed.memory.activations_saved, "saved activation bytes");
  if (!direct) {
    need.block_activations_saved = two.memory.activations_saved - base.memory.activations_saved;
    need.recomputed_block_activations_saved =
        k > 0 ? mixed.memory.activations_saved - base.memory.activations_saved
              : need.block_activations_saved;
  } else if (ref.extrapolates()) {
    // Traced whole (n <= 3, no partial recomputation): one more trace a block shorter, or a block
    // longer at 1 block, with every block recomputed alike.
    TraceOptions alike = options;
    if (options.recompute != Recompute::kNone && options.recompute_blocks >= n) {
      alike.recompute_blocks = -1;
    }
    const int64_t other = n >= 2 ? n - 1 : 2;
    const Sample s = sample_at(other, alike, {}, nullptr);
    need.block_activations_saved =
        (base.memory.activations_saved - s.memory.activations_saved) / (n - other);
    need.recomputed_block_activations_saved = need.block_activations_saved;
  }
  // Peaks from the timeline of the deep model's runs (k recomputed, n - k plain) cut to their
  // first, middle and last block: at most 6 blocks.
  // Without a timeline cut at the blocks, the blockwise figure is the whole-model one (every
  // gradient held: an upper bound).
  auto whole_live = [&] {
    return need.memory.peak - need.memory.parameters - need.memory.optimizer_state;
  };
  // Accumulated: the gradients held from the start, under the curve.
  auto held = [&](int64_t peak) {
    return blockwise->accumulated
               ? checked_add(peak, need.memory.gradients, ex.label, ": blockwise peak bytes")
               : peak;
  };
  if (direct) {
    need.memory.activations_peak = base.memory.activations_peak;
    need.memory.peak = base.memory.peak;
    // Every block of the trace stands for itself.
    const std::vector<int64_t> ones(base.timeline.ok ? (base.timeline.live.size() - 3) / 2 : 0, 1);
    if (base.timeline.ok) {
      need.timeline = TimelineCut{ones, base.timeline.live, base.timeline.accumulating};
    }
    if (blockwise) {
      need.blockwise_live_peak =
          base.timeline.plain()
              ? held(peak_of(base.timeline.blockwise, ones, ex.label, "blockwise peak bytes"))
              : held(whole_live());
    }
  } else {
    std::vector<int64_t> counts;
    add_run(k, counts);
    add_run(n - k, counts);
    TraceOptions cut = options;
    if (partial) cut.recompute_blocks = std::min<int64_t>(k, 3);
    const Sample shape = sample_at(static_cast<int64_t>(counts.size()), cut, blockwise, nullptr);
    const Timeline& tl = shape.timeline;
    const std::vector<int64_t> once(counts.size(), 1);
    // The cut must give back the sample's own peaks; if the blocks do not run one after another,
    // the peaks are extrapolated like the counts (exact only where the peak keeps its place).
    const bool every_block =
        std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c == 1; });
    if (tl.ok && (!tl.inner_ops || every_block) &&
        peak_of(tl.live, once, ex.label, "peak bytes") ==
            shape.memory.peak - shape.memory.optimizer_state - shape.memory.parameters &&
        peak_of(tl.activations, once, ex.label, "activation peak bytes") ==
            shape.memory.activations_peak) {
      need.memory.activations_peak =
          peak_of(tl.activations, counts, ex.label, "activation peak bytes");
      need.memory.peak = checked_add(checked_add(peak_of(tl.live, counts, ex.label, "peak bytes"),
                                                 need.memory.parameters, ex.label, ": peak bytes"),
                                     need.memory.optimizer_state, ex.label, ": peak bytes");
      if (blockwise) {
        need.blockwise_live_peak =
            tl.inner_ops ? held(whole_live())
                         : held(peak_of(tl.blockwise, counts, ex.label, "blockwise peak bytes"));
      }
      need.timeline = TimelineCut{counts, tl.live, tl.accumulating};
    } else {
      need.memory.activations_peak = ex(base.memory.activations_peak, two.memory.activations_peak,
                                        mixed.memory.activations_peak, "activation peak bytes");
      need.memory.peak = ex(base.memory.peak, two.memory.peak, mixed.memory.peak, "peak bytes");
      if (blockwise) need.blockwise_live_peak = held(whole_live());
    }
  }
  // A gradient made beside the activations: where in a block's backward (or the ends') it peaks
  // does not move with the block count, so the samples' largest excess over their activation
  // peak carries over.
  int64_t made_beside = 0;
  for (const Sample* s : {&base, &two, &mixed}) {
    made_beside = std::max(made_beside, s->memory.accumulating_peak - s->memory.activations_peak);
  }
  need.memory.accumulating_peak =
      checked_add(need.memory.activations_peak, made_beside, ex.label, ": accumulating peak bytes");
  need.compute.forward_flops = ex(base.compute.forward_flops, two.compute.forward_flops,
                                  mixed.compute.forward_flops, "forward FLOPs");
  need.compute.backward_flops = ex(base.compute.backward_flops, two.compute.backward_flops,
                                   mixed.compute.backward_flops, "backward FLOPs");
  (void)need.compute.total();  // checked here, not first in a caller's printf
  need.graph_vertices = ex(base.vertices, two.vertices, mixed.vertices, "graph vertices");
  need.graph_ops = ex(base.ops, two.ops, mixed.ops, "graph ops");
  need.graph_forward_ops =
      ex(base.forward_ops, two.forward_ops, mixed.forward_ops, "graph forward ops");
  need.trace_host_bytes = checked_mul(need.graph_vertices, kTraceHostBytesPerVertex, ex.label,
                                      ": host bytes of the trace");
  return need;
}

}  // namespace

TrainingNeed estimate_training_need(const ModelRef& ref, int64_t batch, int64_t seq_len,
                                    const TraceOptions& options, const std::string& optimizer,
                                    std::optional<BlockwiseGradients> blockwise) {
  seq_len = checked_need_args(ref, batch, seq_len, options, optimizer, blockwise);
  return need_from(ref, batch, seq_len, options, optimizer, blockwise,
                   [&](int64_t layers, const TraceOptions& o, std::optional<BlockwiseGradients> bw,
                       TrainingNeed* blocks_out) {
                     return sample(ref, layers, batch, seq_len, o, optimizer, bw, blocks_out);
                   });
}

std::vector<TrainingNeed> estimate_training_needs(const ModelRef& ref,
                                                  const std::vector<int64_t>& batches,
                                                  int64_t seq_len, const TraceOptions& options,
                                                  const std::string& optimizer,
                                                  std::optional<BlockwiseGradients> blockwise) {
  ACC_CHECK(!batches.empty(), "estimate_training_needs: no batch sizes given");
  for (const int64_t b : batches) {
    seq_len = checked_need_args(ref, b, seq_len, options, optimizer, blockwise);
  }
  std::vector<TrainingNeed> out;
  if (!ref.is_registry()) {
    // A user's module: nothing is known of how its tensors grow with the batch.
    for (const int64_t b : batches) {
      out.push_back(estimate_training_need(ref, b, seq_len, options, optimizer, blockwise));
    }
    return out;
  }
  // Each of the need's traces (block count, options) at BatchTraces::kLow and one more samples,
  // and its blocks; a smaller batch is traced itself, or taken from the pair (below).
  using Key = std::tuple<int64_t, bool, int, int64_t, bool>;
  std::map<Key, std::pair<BatchTraces, std::vector<BlockGroup>>> pairs;
  // Whether the step at one sample is like the pair at 2 blocks, by the options' kind (all blocks
  // plain, or all recomputed): what the model's cache notes, for a model without one.
  static_assert(BatchTraces::kLow == 2, "the batches under kLow are one sample");
  std::map<TraceOptions::KeyFields, bool> like_pair;
  // The batches from kLow up first, so that one sample's deeper traces find their pairs made.
  std::vector<size_t> order(batches.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_partition(order.begin(), order.end(),
                        [&](size_t i) { return batches[i] >= BatchTraces::kLow; });
  out.resize(batches.size());
  for (const size_t i : order) {
    const int64_t b = batches[i];
    out[i] = need_from(
        ref, b, seq_len, options, optimizer, blockwise,
        [&](int64_t layers, const TraceOptions& o, std::optional<BlockwiseGradients> bw,
            TrainingNeed* blocks_out) {
          const Key key{layers, o.backward, static_cast<int>(o.recompute), o.recompute_blocks,
                        o.bf16_activations};
          const std::string what = figures_what(optimizer, bw);
          if (b < BatchTraces::kLow) {
            // One sample: a transpose can leave a tensor contiguous there, and the trace then
            // lacks a copy every larger batch makes, so the pair stands for it only where the
            // step at one sample has the pair's structure. Its blocks are alike (one module's
            // code on the same shapes, the embedding's and the head's ends the same at any
            // depth), so that is noted at 2 blocks, where the trace is made anyway (the time
            // model reads it), and a deeper trace at one sample (the memory model's cut of the
            // first, middle and last blocks) is then the pair's line at 1 instead of a trace.
            // Only where every block is of one kind (all plain, or all recomputed alike): 2
            // blocks do not show a recomputed block after another that a mixed trace has.
            const std::optional<TraceOptions::KeyFields> kind = uniform_kind(o, layers);
            const auto it = pairs.find(key);
            const bool paired = kind && it != pairs.end() && it->second.first.affine();
            if (paired && layers == 2) {
              return taken(*ref.figures(layers, b, seq_len, o, what,
                                        [&] {
                                          const auto traced = ref.traced(layers, b, seq_len, o);
                                          const bool like = BatchTraces::same_structure(
                                              traced->trace, it->second.first.low());
                                          like_pair.try_emplace(*kind, like);
                                          ref.note_one_sample_like_pair(seq_len, o, like);
                                          return figures_of(traced->trace, traced->blocks,
                                                            optimizer, bw);
                                        }),
                           blocks_out);
            }
            if (paired && layers > 2) {
              std::optional<bool> like = ref.one_sample_like_pair(seq_len, o);
              if (const auto l = like_pair.find(*kind); !like && l != like_pair.end()) {
                like = l->second;
              }
              if (like == true) {
                return taken(*ref.figures(layers, b, seq_len, o, what,
                                          [&] {
                                            auto& [traces, groups] = it->second;
                                            return figures_of(traces.at_one(), groups, optimizer,
                                                              bw);
                                          }),
                             blocks_out);
              }
            }
            return sample(ref, layers, b, seq_len, o, optimizer, bw, blocks_out);
          }
          // Evaluated once per trace where the model keeps its traces: the pair is made only for
          // figures not kept yet.
          const auto f = ref.figures(
              layers, b, seq_len, o, what, [&]() -> std::shared_ptr<const TraceFigures> {
                auto it = pairs.find(key);
                if (it == pairs.end()) {
                  // Shared, not copied, when the model keeps its traces.
                  const auto low = ref.traced(layers, BatchTraces::kLow, seq_len, o);
                  const auto next = ref.traced(layers, BatchTraces::kLow + 1, seq_len, o);
                  it = pairs
                           .emplace(key,
                                    std::pair{BatchTraces(
                                                  std::shared_ptr<const Trace>(low, &low->trace),
                                                  std::shared_ptr<const Trace>(next, &next->trace)),
                                              low->blocks})
                           .first;
                }
                auto& [traces, groups] = it->second;
                if (b > BatchTraces::kLow + 1 && !traces.affine()) {
                  const auto traced = ref.traced(layers, b, seq_len, o);
                  return figures_of(traced->trace, traced->blocks, optimizer, bw);
                }
                return figures_of(traces.at(b), groups, optimizer, bw);
              });
          return taken(*f, blocks_out);
        });
  }
  return out;
}

std::optional<std::vector<StageHighs>> stage_highs(const TrainingNeed& need,
                                                   const std::vector<int64_t>& stage_blocks) {
  // The search asks this of every pipeline rank of every candidate: one allocation, the result.
  auto label = [&] {
    return need.model_type + " " + need.layers_key + " " + std::to_string(need.num_layers) +
           ": stage highs";
  };
  ACC_CHECK(!stage_blocks.empty(), label(), ": no stages given");
  int64_t total = 0;
  for (const int64_t b : stage_blocks) {
    ACC_CHECK(b >= 1, label(), ": a stage of ", b, " blocks (each needs at least one)");
    total = checked_add(total, b, "stage blocks");
  }
  ACC_CHECK(total == need.num_layers, label(), ": the stages hold ", total, " blocks, the model ",
            need.num_layers);
  if (!need.timeline) return std::nullopt;
  const TimelineCut& cut = *need.timeline;
  const size_t N = cut.counts.size(), V = stage_blocks.size();
  int64_t deep = 0;
  for (const int64_t c : cut.counts) deep = checked_add(deep, c, "stage highs");
  ACC_CHECK_INTERNAL(
      cut.live.size() == 2 * N + 3 && cut.accumulating.size() == cut.live.size() && deep == total,
      label(), ": a timeline cut of ", N, " blocks standing for ", deep, " with ", cut.live.size(),
      " segments");
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  std::vector<StageHighs> out(V, StageHighs{kNone, kNone, kNone});
  // The highest of a segment starting at `start` over its repetitions [a, b) (each r x delta
  // higher), the level it starts from included, into `slot`.
  auto raise = [](int64_t& slot, const Segment& sg, int64_t start, int64_t a, int64_t b) {
    const int64_t lift = std::max(checked_mul(a, sg.delta, "stage highs"),
                                  checked_mul(b - 1, sg.delta, "stage highs"));
    const int64_t top = checked_add(checked_add(start, lift, "stage highs"),
                                    sg.any ? std::max<int64_t>(0, sg.high) : 0, "stage highs");
    slot = std::max(slot, top);
  };
  for (const bool accumulating : {false, true}) {
    const std::vector<Segment>& curve = accumulating ? cut.accumulating : cut.live;
    auto slot = [&](size_t stage, bool backward) -> int64_t& {
      return !backward      ? out[stage].forward
             : accumulating ? out[stage].backward_accumulating
                            : out[stage].backward;
    };
    int64_t start = 0;
    // Forward segments: block i of the cut runs deep blocks [lo, lo + counts[i]) in order.
    int64_t lo = 0;
    for (size_t s = 0; s < curve.size(); ++s) {
      const Segment& sg = curve[s];
      if (s == 0 || s == N + 1 || s == 2 * N + 2) {
        // The ends: the embedding (the first stage's), the head and loss (the last stage's).
        if (s != 0 || !accumulating) raise(slot(s == N + 1 ? V - 1 : 0, s != 0), sg, start, 0, 1);
        start = checked_add(start, sg.delta, "stage highs");
        continue;
      }
      const bool backward = s > N + 1;
      const size_t i = backward ? 2 * N + 1 - s : s - 1;
      if (backward && s == N + 2) lo = total;  // the backwards run the blocks from the last
      const int64_t count = cut.counts[i];
      const int64_t first = backward ? lo - count : lo;  // the run's deep blocks [first, +count)
      // Each stage the run overlaps (forwards make no gradient: the live figure only): forward
      // repetition r runs deep block first + r, backward repetition r runs first + count - 1 - r.
      int64_t begin = 0;
      for (size_t st = 0; st < V && !(accumulating && !backward); ++st) {
        const int64_t end = begin + stage_blocks[st];
        const int64_t from = std::max(first, begin), to = std::min(first + count, end);
        begin = end;
        if (from >= to) continue;
        if (backward) {
          raise(slot(st, true), sg, start, first + count - to, first + count - from);
        } else {
          raise(slot(st, false), sg, start, from - first, to - first);
        }
      }
      lo = backward ? first : first + count;
      start = checked_add(start, checked_mul(count, sg.delta, "stage highs"), "stage highs");
    }
  }
  return out;
}

int64_t blockwise_live_peak(const Trace& t, const std::vector<std::string>& blocks,
                            const BlockwiseGradients& blockwise) {
  const Timeline tl = timeline(t, blocks, blockwise);
  ACC_CHECK(tl.plain(), "blockwise_live_peak: the trace's blocks do not run one after another");
  const int64_t peak = peak_of(tl.blockwise, std::vector<int64_t>(blocks.size(), 1), "trace",
                               "blockwise peak bytes");
  return blockwise.accumulated
             ? checked_add(peak, estimate_memory(t).gradients, "trace", ": blockwise peak bytes")
             : peak;
}

// The hash covers the trace's JSON dump: a field added to every dump changes every model's hash
// (and so every checkpoint's and strategy cache's key); dump.cpp adds new fields only where
// present.
std::string model_trace_hash(const std::string& model_type, const nlohmann::json& config) {
  DefaultDeviceGuard meta(Device::kMeta);
  // The config with its defaults filled in, at its own depth (the model itself is never built).
  const nlohmann::json filled = models::config_with_num_layers(
      model_type, models::create_meta_model(model_type, config, 1)->config_json(),
      models::config_num_layers(model_type, config));
  auto shallow = models::create_meta_model(model_type, config, 2);
  const int64_t t = std::min<int64_t>(8, shallow->max_seq_len());
  const Tensor idx = empty({1, t}, {DType::kInt64, Device::kMeta});
  const nlohmann::json facts = {{"model_type", model_type},
                                {"config", filled},
                                {"trace", to_json(trace(*shallow, {idx, idx}))}};
  return fnv1a64_hex(facts.dump());
}

void check_fits(const TrainingNeed& need, int64_t available_bytes, const std::string& what) {
  if (need.total() <= available_bytes) return;
  const MemoryEstimate& m = need.memory;
  ACC_THROW(ValueError, what, ": a training step of ", need.model_type, " ", need.layers_key, " ",
            need.num_layers, " at batch ", need.batch, " x seq ", need.seq_len, " needs ",
            human_bytes(static_cast<double>(need.total())), " (", need.total(),
            " bytes: parameters ", human_bytes(static_cast<double>(m.parameters)), ", gradients ",
            human_bytes(static_cast<double>(m.gradients)), ", ", need.optimizer, " state ",
            human_bytes(static_cast<double>(m.optimizer_state)), ", activations peak ",
            human_bytes(static_cast<double>(m.activations_peak)), "), more than the ",
            human_bytes(static_cast<double>(available_bytes)), " (", available_bytes,
            " bytes) of memory available");
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024 && u < 6) {
    b /= 1024;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.2f %s", b, units[u]);
  return buf;
}

}  // namespace acc::trace
