#pragma once
// Gradient synchronisation and optimizer sharding: what a data-parallel method (ddp, zero1, zero2,
// fsdp) contributes to the training plan, and the local one (one rank, nothing to synchronise).
// Private to the strategies library.
//
// A GradSync is built on the model and undoes everything it did when destroyed: its hooks are
// removed and parameters moved into flat buffers or sharded go back into storage of their own
// (fsdp gathers them first, a collective: see ~Fsdp). Gradients are dropped.

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "acc/autograd/engine.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/process_group.hpp"
#include "acc/dist/sharding.hpp"
#include "acc/models/language_model.hpp"

namespace acc::strategies {

using nn::NamedTensors;
// The placement table's types (acc/dist/sharding.hpp), used throughout the strategies.
using dist::Box;
using dist::FlatRange;
using dist::PlacementEntry;
using dist::PlacementTable;
using dist::ShardingSpec;
using dist::TensorKind;

struct GradSyncOptions {
  int64_t bucket_bytes = 25 << 20;
  bool bf16_communication = false;  // amp
};

/// What this rank's optimizer updates: a leaf tensor (the parameter itself, or a 1-D piece of a
/// flat buffer holding `range` of the parameter) whose grad() the GradSync keeps attached, and
/// where it lies (the optimizer state entries of the placement table copy it).
struct OptimPiece {
  std::string name;  // the parameter's dotted name
  Tensor leaf;
  FlatRange range;  // within the flattened parameter (all of it when whole)
  ShardingSpec spec;
  int replica = 0;
  int replicas = 1;
};

class GradSync {
 public:
  virtual ~GradSync() = default;
  /// Before the first micro-batch of a step.
  virtual void begin_step() {}
  /// False: gradients accumulate locally and are not synchronised (all but the last micro-batch).
  virtual void set_sync(bool sync) { sync_ = sync; }
  /// After the backward of a micro-batch: waits for the reductions launched during it and attaches
  /// the synchronised gradients to the optimizer pieces. Idempotent.
  virtual void finish_backward() {}
  /// After backward passes that all ran with set_sync(false) (a pipeline schedule's
  /// micro-batches): synchronises the gradients accumulated so far as the last micro-batch's
  /// backward would have, and attaches them (finish_backward then has nothing left to do). Throws
  /// acc::InternalError for a method that cannot (fsdp: pipeline_parallel refuses it).
  virtual void sync_accumulated();
  /// After the optimizer step (e.g. gather the updated parameter shards).
  virtual void end_step() {}
  /// This rank's optimizer pieces, in the model's parameter order.
  virtual std::vector<OptimPiece> optimizer_pieces() = 0;
  /// Appends the parameter and gradient entries of this rank to `table`.
  virtual void add_placements(PlacementTable& table) const = 0;
  /// fsdp: the most parameter bytes gathered at once.
  virtual int64_t peak_gathered_bytes() const { return 0; }

 protected:
  bool sync_ = true;
};

/// How a parameter that a model transform sharded along tp lies (tensor parallel): the module
/// holds a local tensor, and the GradSyncs and the optimizer see only that (its shape, its flat
/// ranges); the layout says which regions of the global parameter the local tensor's elements
/// are. The local tensor's row-major flattening is the segments' boxes, each in row-major order,
/// one after another from `local_offset` (a fused q|k|v weight: three row blocks); local elements
/// in no segment are padding (a vocabulary padded to a multiple of tp), in no table and no norm.
struct ParamLayout {
  Shape global_shape;
  int tensor_dim = 0;  // Shard(tensor_dim) along tp
  struct Segment {
    Box box;
    int64_t local_offset = 0;
  };
  std::vector<Segment> segments;
  /// Ranks along tp that hold the same regions (kv heads shared by query heads of several ranks):
  /// this rank's index among them and their count; the replica count multiplies by it.
  int tp_replica = 0;
  int tp_replicas = 1;
};
/// By parameter name. Filled by the transforms when they are applied, emptied by their undo.
using ParamLayouts = std::map<std::string, ParamLayout>;

/// `table` with every entry of a parameter in `layouts` (its parameter, gradient and optimizer
/// state entries, which the GradSyncs and the Trainer write in local terms: a global shape that
/// is the local shape, the whole box, maybe a flat range of it) replaced by one entry per segment
/// it overlaps, in global terms: the global shape, the segment's box, the flat range within the
/// box, the spec with Shard(tensor_dim) along tp and the replica counted over the tp sharers.
/// `local` stays a view of the held elements. Throws acc::InternalError for an entry whose box is
/// not its whole local tensor.
PlacementTable lift_layouts(PlacementTable table, const ParamLayouts& layouts,
                            const dist::ParallelContext* ctx);

/// Without a data-parallel method: nothing to synchronise (one rank, or ranks that only replicate
/// along mesh dimensions no method uses; the context places the replicas; null: one process
/// without acc::dist).
std::unique_ptr<GradSync> make_local(nn::Module& model, const dist::ParallelContext* ctx);
/// The data-parallel methods reduce gradients over the context's dp x cp group.
std::unique_ptr<GradSync> make_ddp(nn::Module& model, const dist::ParallelContext& ctx,
                                   const GradSyncOptions& o);
/// ZeRO stage 1 (optimizer state sharded) or 2 (+ gradients sharded).
std::unique_ptr<GradSync> make_zero(nn::Module& model, const dist::ParallelContext& ctx, int stage,
                                    const GradSyncOptions& o);
/// `config`: the method's, for its "units" (unit_names).
std::unique_ptr<GradSync> make_fsdp(nn::Module& model, const dist::ParallelContext& ctx,
                                    const GradSyncOptions& o, const nlohmann::json& config = {});

// ---- shared pieces ----

/// Rank 0's parameters and buffers on every rank, so that all replicas start identical.
void broadcast_model_state(nn::Module& model, dist::ProcessGroup& group);

/// How a whole (unsharded) parameter lies on the mesh: replicated along every dimension; this
/// rank's replica index and the count (dist::replica_of / replicas_of).
struct WholePlacement {
  ShardingSpec spec;
  int replica = 0;
  int replicas = 1;
};
WholePlacement whole_placement(const dist::ParallelContext* ctx);
/// The same with the flat split of zero/fsdp over the dp x cp group (ShardFlat along dp and cp):
/// the replicas are the copies along tp.
WholePlacement flat_placement(const dist::ParallelContext& ctx);

/// The placement entry of a whole parameter or gradient of `shape` held in `local` (undefined for
/// a gradient not computed yet).
void add_whole(PlacementTable& table, const std::string& name, const Shape& shape,
               const Tensor& local, TensorKind kind, const WholePlacement& where);

/// Every parameter of `model` whole (local, ddp): the optimizer pieces, and the placement entries
/// of the parameters and their gradients.
std::vector<OptimPiece> whole_pieces(const nn::Module& model, const WholePlacement& w);
void add_whole_params_and_grads(PlacementTable& table, const nn::Module& model,
                                const WholePlacement& where);

/// The units fsdp shards by and recomputation and amp wrap: the modules the method's config names
/// in "units" (a ModuleList stands for its children: {"units": ["encoder.layers"]}), else the
/// model's repeated blocks (trace::find_blocks' largest group), else none (the model is one
/// unit). Throws acc::ValueError naming `method` and the value for "units" that is not a non-empty
/// list of strings, a name that is no module of the model (listing the children at the level where
/// it goes wrong), the root, or a unit named twice or inside another.
std::vector<std::string> unit_names(const nn::Module& model, const nlohmann::json& config,
                                    const std::string& method);
/// Validates a config's "units" (when present) without a model, for a method's apply.
void check_units_config(const nlohmann::json& config, const std::string& method);

/// Parameters in reverse registration order (the order gradients become ready), grouped into
/// buckets of at most `bucket_bytes` (a larger parameter gets a bucket of its own), each bucket
/// padded to a multiple of `world` elements so it splits into equal chunks.
struct BucketLayout {
  struct Slot {
    std::string name;
    Tensor param;
    int64_t offset = 0;  // within the bucket, in elements
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t numel = 0;        // real elements
    int64_t padded = 0;       // multiple of world
    int64_t flat_offset = 0;  // start within the flat concatenation of all buckets
  };
  BucketLayout(const NamedTensors& params, int world, int64_t bucket_bytes);
  std::vector<Bucket> buckets;
  int64_t total = 0;  // padded elements over all buckets
  /// bucket index of each parameter name
  std::vector<std::pair<std::string, size_t>> index;
  size_t bucket_of(const std::string& name) const;
};

/// The part of a parameter inside this rank's chunk of a bucket (shard_range).
struct SlotShard {
  const BucketLayout::Slot* slot;
  FlatRange in_param;  // elements of the parameter, flattened
  int64_t in_chunk;    // where they start within this rank's chunk
};
/// Every parameter of `bucket` with a non-empty part in chunk `rank`, in slot order.
std::vector<SlotShard> shards_of(const BucketLayout::Bucket& bucket, int world, int rank);

/// A piece of a parameter this rank owns under a sharded strategy (zero, fsdp): its place in the
/// parameter and the 1-D leaf the optimizer updates.
struct ShardPiece {
  std::string name;
  Shape shape;      // the parameter's
  FlatRange range;  // within the flattened parameter
  Tensor leaf;      // 1-D view of the strategy's flat parameter buffer
  size_t bucket = 0;
  int64_t in_bucket = 0;  // where it starts within its bucket
  int64_t in_chunk = 0;   // where it starts within this rank's chunk of the bucket
  Tensor grad;            // fsdp: 1-D view of the gradient shard (zero re-derives it per step)
};
/// `pieces` in the model's parameter order (buckets run in reverse), as optimizers list them.
void sort_by_model(std::vector<ShardPiece>& pieces, const nn::Module& model);
/// The optimizer pieces of a sharded strategy: split over the dp x cp ranks (`where`:
/// flat_placement).
std::vector<OptimPiece> optim_pieces(const std::vector<ShardPiece>& pieces,
                                     const WholePlacement& where);
/// The placement entry of a piece's parameter or gradient held in `local`.
void add_piece(PlacementTable& table, const ShardPiece& piece, TensorKind kind, const Tensor& local,
               const WholePlacement& where);

/// Writes the gradients of `bucket`'s parameters times `scale` into `dst` (bucket.padded
/// elements; a parameter without a gradient and the padding become zeros). Data-parallel
/// strategies pass 1 / world: the average's division is folded into this copy (PyTorch DDP
/// pre-divides too), so the reduction is a plain sum and nobody makes another pass over the
/// bucket. With `drop_grads` each parameter's own gradient is released once copied.
void pack_bucket_grads(const BucketLayout::Bucket& bucket, float* dst, float scale,
                       bool drop_grads);

/// Makes `param` a view of `storage` at `offset` (elements), keeping it the same tensor (same
/// TensorImpl, so the module and autograd see it).
void repoint(Tensor& param, const std::shared_ptr<Storage>& storage, int64_t offset);
/// Gives `param` storage of its own holding `values` (same numel), as before a strategy moved it.
void repoint_to_own(Tensor& param, const Tensor& values);

/// A 1-D leaf view of `base` elements [start, start + n) that requires grad: an optimizer piece.
Tensor piece_of(const Tensor& base, int64_t start, int64_t n);

/// The round of one synchronised backward, shared by the bucket reducer and fsdp: the first
/// gradient that becomes ready starts it (Derived::reset_round() clears the per-round state) and,
/// when a backward pass is running, queues Derived::finish() to run as it ends; finish() checks
/// round_active and ends the round (end_round()). Derived is owned by a shared_ptr.
template <class Derived>
struct BackwardRounds : std::enable_shared_from_this<Derived> {
  bool round_active = false;
  void start_round() {
    if (round_active) return;
    round_active = true;
    static_cast<Derived*>(this)->reset_round();
    if (autograd::in_backward()) {
      std::weak_ptr<Derived> weak = this->shared_from_this();
      autograd::queue_callback([weak] {
        if (auto s = weak.lock()) s->finish();
      });
    }
  }
  void end_round() { round_active = false; }
};

/// Post-accumulate-grad hooks registered on parameters, removed on destruction.
class ParamHooks {
 public:
  ParamHooks() = default;
  ~ParamHooks() { remove_all(); }
  ParamHooks(const ParamHooks&) = delete;
  ParamHooks& operator=(const ParamHooks&) = delete;
  void add(Tensor param, std::function<void(Tensor&)> fn);
  void remove_all();

 private:
  std::vector<std::pair<Tensor, int>> hooks_;
};

}  // namespace acc::strategies
