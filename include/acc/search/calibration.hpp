#pragma once
// Calibration for the strategy search's cost model: what this machine and this job's process
// groups really deliver, so that a candidate's traced FLOPs, bytes and collective sizes become
// seconds.
//
//  - MachineCalibration: GEMM throughput at the shapes the traced model runs (through
//    acc::kernels::gemm, the path every linear and matmul of the engine takes, in the layout each
//    call site uses) and the bandwidth of a memory-bound kernel the engine runs (the elementwise
//    add of residuals and gradient accumulation) over arrays well beyond the last-level cache.
//    Cached per machine: <cache_dir>/machine-<fingerprint key>-t<threads>.json, so a second run
//    measures only the shapes the cache lacks.
//  - CommCalibration: alpha-beta fits of allreduce, reduce_scatter, allgather and broadcast,
//    measured on the job's own groups at start (never cached: the network, the placement of ranks
//    and the load of the other jobs change from one job to the next).
//
// Figures are medians over repeats (each point: one warm-up call, then calls until
// seconds_per_point has passed), so a neighbour's burst moves a figure less than it moves a mean;
// on a shared machine they still vary from run to run (on this 2-core one, shared with other
// jobs: GEMM figures by about 10%, collective points by up to 50%). Measuring disturbs nothing the
// caller owns: tensors are allocated and freed (through the caching allocator), random values
// come from a private generator, the thread count is restored.
//
// Gemm dimension letters as in acc::kernels::gemm: C (m, n) = op(A) (m, k) @ op(B) (k, n), op a
// transpose when trans_a / trans_b.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "acc/dist/process_group.hpp"
#include "acc/trace/tracer.hpp"

namespace acc::search {

// ---- the machine ----

/// What decides a machine's compute figures. Two processes on the same machine and the same
/// AutoAcc build (every rank of a job, every run) get equal fingerprints and keys; a change of
/// CPU, core quota, memory, BLAS build or AutoAcc version gives another key, so a cache measured
/// elsewhere is never trusted.
struct HardwareFingerprint {
  std::string cpu_model;  // "model name" of /proc/cpuinfo ("unknown" when absent)
  /// The instruction-set extensions that change kernel speed, those of kIsaFlags this CPU has,
  /// in kIsaFlags order ("amx" when /proc/cpuinfo lists amx_tile).
  std::vector<std::string> isa;
  int cores = 0;                // acc::usable_cores(): affinity and cgroup quota applied
  int64_t memory_gib = 0;       // acc::physical_memory_bytes() rounded to the nearest GiB
  std::string blas_core;        // openblas_get_corename(): the kernel set OpenBLAS chose
  std::string blas_config;      // openblas_get_config(): version and build options
  std::string autoacc_version;  // PROJECT_VERSION of the build
  /// How the library was compiled, as far as it moves the engine's speed: "optimized" or
  /// "unoptimized", "+asan" / "+tsan" with a sanitizer. A sanitizer tree's figures (its per-op
  /// overhead 80x an optimised build's) are another machine's to an optimised build: its tests
  /// that search wrote them into the cache every build shares. "" in a file written before the
  /// field was (from_json): unlike any build's.
  std::string build;

  static constexpr const char* kIsaFlags[] = {"avx2", "fma", "avx512f", "avx512_bf16", "amx"};

  /// 16 lower-case hex digits: FNV-1a 64 of the canonical JSON text (sorted keys) of every field.
  std::string key() const;
  /// "cores: 2 vs 4" (this one's value, then the other's) for the first field that differs, ""
  /// when equal: what a log or an error says about a stale cache.
  std::string difference(const HardwareFingerprint& other) const;

  nlohmann::json to_json() const;
  /// Every field required, no others. Throws acc::ValueError "hardware fingerprint: field
  /// '<name>' ..." naming the missing, mistyped, unknown or invalid field.
  static HardwareFingerprint from_json(const nlohmann::json& j);

  bool operator==(const HardwareFingerprint&) const = default;
};

/// This machine's fingerprint, as this process sees it. Throws acc::IoError when /proc/meminfo
/// cannot be read.
HardwareFingerprint hardware_fingerprint();

/// One GEMM as acc::kernels::gemm runs it. The layout is part of the shape because the engine
/// runs the same (m, n, k) in different layouts (a linear's forward is NT, its input gradient NN,
/// its weight gradient TN) and a BLAS may be faster in one than another (on this machine's
/// OpenBLAS, an AMD EPYC with AVX-512, the three were within the run-to-run noise: 92-106 GFLOP/s
/// on one core at the 90M GPT's shapes).
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;

  /// 2 m n k. Throws acc::ValueError naming the shape when it does not fit in 64 bits.
  int64_t flops() const;
  /// "2048x2304x768 NT" (m x n x k, then the layouts of A and B).
  std::string str() const;

  auto operator<=>(const GemmShape&) const = default;
  /// Writes str(): what checked_mul formats, only when it throws.
  friend std::ostream& operator<<(std::ostream& os, const GemmShape& s) { return os << s.str(); }
};

/// How often a traced training step runs one GEMM shape.
struct GemmCount {
  GemmShape shape;
  int64_t forward = 0;   // calls in the forward pass
  int64_t backward = 0;  // calls in the backward pass, recomputed forwards included
};

/// The GEMMs of a traced step, one entry per distinct shape (sorted by shape), read from its
/// matrix-product ops:
///   Linear          x (..., IN), w (OUT, IN), M = rows of x:  (M, OUT, IN) NT
///   LinearBackward  dx = g w: (M, IN, OUT) NN;  dw = g^T x: (OUT, IN, M) TN (each when computed)
///   Bmm             L x (M, N, K) NN (the layout of strided operands is not in the trace)
///   BmmBackward     dA = G B^T: L x (M, K, N) NT;  dB = A^T G: L x (K, N, M) TN
/// A backward op that computes only one of its two products is told apart by its output's shape;
/// where both would have the same shape, they are the same (m, n, k) and only the layout may be
/// wrong. The fused attention op has its own tile kernels, not a GEMM, and is not listed (its
/// FLOPs are on its vertex). Throws acc::InternalError when an op's FLOPs do not match its shapes.
std::vector<GemmCount> gemm_counts(const trace::Trace& t);
/// Whether gemm_counts() reads a vertex of this op (Linear, LinearBackward, Bmm, BmmBackward).
bool is_gemm_op(const std::string& op);
/// The distinct shapes of gemm_counts(t): what calibrate_machine() should measure for `t`.
std::vector<GemmShape> gemm_shapes(const trace::Trace& t);

/// How a MachineCalibration was obtained; not stored in the cache.
struct CalibrationSource {
  int gemm_from_cache = 0;  // shapes taken from the cache file
  int gemm_measured = 0;    // shapes measured by this call
  bool memory_from_cache = false;
  double seconds = 0;      // wall time of this call (reading, measuring, writing)
  std::string cache_file;  // the file read or written ("" for calibrate_machine)
  /// Why a cache file was not used or not written; "" when it was used or there was none.
  std::string note;
};

struct MachineCalibration {
  HardwareFingerprint hardware;
  int threads = 1;             // acc::set_num_threads during the measurement
  std::string gemm_threading;  // "openblas" or "tbb" (acc::gemm_threading())
  /// How the GEMMs were timed: "cold", each call on the next of several copies of its operands
  /// spanning 16 MiB (as a training step finds them: out of the core's caches); "hot", the same
  /// operands every call (files written before 2026-11-29, which a search measures again).
  std::string gemm_operands = "cold";
  std::map<GemmShape, double> gemm_gflops;  // measured GFLOP/s (1e9 FLOP/s) per shape
  /// Seconds every op of the engine costs beyond its work (dispatch, the caching allocator, the
  /// autograd node, and running that node in backward): measured on a chain of elementwise ops
  /// over 8 elements, forward and backward, per op executed. 0 in a file written before it was
  /// measured (load_or_calibrate_machine then measures it).
  double op_overhead_s = 0;
  double memory_gbps = 0;  // GB/s (1e9 B/s) of logical bytes: read + written, as the trace counts
  /// measure_compute_contention's factor by the number of ranks computing at once on one machine
  /// (the job's largest local world), as measured by earlier searches: a search on as many local
  /// ranks takes it from here instead of measuring (about 0.1 s, a few steps of a small model).
  std::map<int, double> contention;
  CalibrationSource source;

  /// Seconds of one GEMM: its FLOPs at the measured throughput of that shape; for a shape not
  /// measured, at the throughput of the nearest measured one, nearest by |log(m n k) - log(m' n'
  /// k')|, equally near ones told apart by the per-dimension distance sum |log m - log m'| + ...,
  /// then by having the same layout. 0 for an empty product. Throws acc::ValueError for a negative
  /// dimension or when no GEMM was measured.
  double gemm_seconds(const GemmShape& shape) const;
  /// gemm_seconds({m, n, k}) (layout NN; a measured layout of the same m, n, k is the nearest).
  double gemm_seconds(int64_t m, int64_t n, int64_t k) const;
  /// bytes / memory_gbps: the time of memory-bound ops that read and write `bytes` in all. Throws
  /// acc::ValueError for negative bytes or when memory_gbps is not positive.
  double memory_seconds(int64_t bytes) const;

  /// {"hardware": {...}, "threads": 1, "gemm_threading": "openblas", "gemm_operands": "cold",
  ///  "memory_gbps": 23.7,
  ///  "op_overhead_us": 3.1,
  ///  "gemm": [{"m": 2048, "n": 2304, "k": 768, "trans_a": false, "trans_b": true,
  ///            "gflops": 105.3}, ...], "contention": [{"local_ranks": 2, "factor": 1.08}]}
  nlohmann::json to_json() const;
  /// Every field required but "contention", "op_overhead_us" and "gemm_operands" (files written
  /// before they existed), no others; GFLOP/s and GB/s positive and finite, dimensions >= 1, no
  /// shape twice, factors >= 1 and finite, local ranks >= 2 and not twice. Throws acc::ValueError
  /// "machine calibration: field '<path>' ..." naming the field by its path ("gemm[2].gflops",
  /// "hardware.cores", "contention[0].factor").
  static MachineCalibration from_json(const nlohmann::json& j);
};

struct CalibrationOptions {
  int threads = 1;
  /// Per point: one warm-up call, then calls until this much time has passed (at least one);
  /// the figure is the median of those calls.
  double seconds_per_point = 0.05;
  /// "" means default_cache_dir().
  std::string cache_dir;
};

/// $ACC_CACHE_DIR, else $XDG_CACHE_HOME/autoacc, else $HOME/.cache/autoacc. Throws
/// acc::ValueError when none of the three is set.
std::string default_cache_dir();

/// <cache_dir or default_cache_dir()>/machine-<hardware_fingerprint().key()>-t<threads>.json.
std::string machine_cache_path(const CalibrationOptions& options);

/// Measures every shape (duplicates once) and the memory bandwidth with options.threads threads.
/// A shape over 4 GFLOP a call is timed with its largest dimensions halved until under (its rate
/// is the kernel's saturated one either way), so a 175B model's shapes take milliseconds each.
/// Not collective, and not to be run by several ranks of a machine at once: they would share the
/// cores and the memory bus and measure each other (measure on one rank per machine and share the
/// result with broadcast_calibration). Throws acc::ValueError for threads < 1,
/// seconds_per_point not positive and finite, or a shape with a dimension < 1.
MachineCalibration calibrate_machine(const std::vector<GemmShape>& shapes,
                                     const CalibrationOptions& options);

/// calibrate_machine through the cache file machine_cache_path(options):
///  - the shapes the file holds are taken from it (source.gemm_from_cache), the others measured
///    (source.gemm_measured), the memory figure measured only when there is no usable file;
///  - when anything was measured the file is rewritten with everything known (the shapes of the
///    file not asked for too), atomically: a temporary file renamed into place, so a reader or
///    another process writing at the same time sees a whole file, old or new;
///  - a file of another machine (fingerprint), or measured under another GEMM threading mode, is
///    not used: logged with the first difference (source.note) and replaced;
///  - a malformed file (not JSON, truncated, a field missing or wrong) is acc::ValueError naming
///    the file and the field, and is left as it is: measuring over it would hide whatever wrote
///    it; the caller decides (delete it, or call calibrate_machine).
/// A file that cannot be written (the directory cannot be created, a read-only file system) is
/// logged as a warning and said in source.note; the figures are returned all the same. Throws
/// acc::IoError when an existing file cannot be read, and what calibrate_machine throws.
MachineCalibration load_or_calibrate_machine(const std::vector<GemmShape>& shapes,
                                             const CalibrationOptions& options);

/// How much slower compute runs when every rank of `group` computes at once than when one rank
/// computes alone: the machine calibration is measured by one rank alone, but a job's ranks share
/// the machine's cores (two vCPUs are often two hyperthreads of one core), memory bandwidth and
/// caches, and more ranks x threads than cores time-slice. The workload is the largest of
/// `shapes` (by FLOPs; a 256^3 GEMM when empty) plus an elementwise add over 8 MiB arrays, as a
/// training step mixes them. Rank 0 runs it alone while the others wait,
/// then all ranks run it together, the same number of calls each time, timed whole (time slicing
/// shows in the whole, not in a median per call); the factor is the slowest rank's together
/// ÷ alone, at least 1 (1 on a group of one). About 3 x seconds_per_point. A collective over
/// `group`: every rank gets the same factor.
double measure_compute_contention(dist::ProcessGroup& group, const std::vector<GemmShape>& shapes,
                                  double seconds_per_point = 0.03);

/// The job's largest local world (its ranks on one machine, agreed over `group`) and the largest
/// share of a machine's cores its ranks take: a node's ranks x `threads` over the CPUs of the
/// union of their affinity masks (dist::node_cores; above 1: they time-slice the cores). Ranks
/// bound to a core each count the node's cores together, not their own one. A collective over
/// `group`: every rank gets the same figures.
struct JobCores {
  int local_ranks = 1;
  double share = 1.0;
};
JobCores job_cores(dist::ProcessGroup& group, int threads);

/// The contention factor for `group`'s job: from `machine.contention` when it holds one for the
/// job's largest local world (agreed over `group`), else measured (measure_compute_contention)
/// and added to `machine`, and rank 0 writes `machine` back to its cache file (a file that cannot
/// be written is logged, not fatal). At least job_cores' share (ranks that time-slice cannot
/// compute faster than their share, whatever one measurement saw).
/// `machine` must be the same on every rank (broadcast_calibration); `from_cache` says which it
/// was, `cores` (when given) the job_cores it agreed on (a group of one: one rank, share 1). A
/// collective over `group`.
double contention_for_job(dist::ProcessGroup& group, MachineCalibration& machine,
                          const std::vector<GemmShape>& shapes, const CalibrationOptions& options,
                          bool* from_cache = nullptr, JobCores* cores = nullptr);

/// Every rank of `group` gets root's `calibration` (what the others pass is ignored; source
/// included). A collective over `group`: all ranks call it. Throws what the collectives throw.
MachineCalibration broadcast_calibration(dist::ProcessGroup& group,
                                         const MachineCalibration& calibration, int root = 0);

// ---- the collectives ----

/// t(bytes) = alpha + beta * bytes.
struct AlphaBeta {
  double alpha_s = 0;          // latency, seconds
  double beta_s_per_byte = 0;  // inverse bandwidth, seconds per byte
  /// Throws acc::ValueError for negative bytes.
  double seconds(int64_t bytes) const;
};

/// One measured point of a collective: the fastest round's max over ranks of the ranks' median
/// times (calibrate_collectives).
struct CommPoint {
  int64_t bytes = 0;
  double seconds = 0;
};

struct CommCalibration {
  int world = 1;  // ranks of the group measured
  /// "allreduce", "reduce_scatter", "allgather", "broadcast". `bytes` is always the size of the
  /// whole tensor: the one reduced or broadcast, the input of reduce_scatter, the output of
  /// allgather (what a bucket, a ZeRO shard set or an FSDP block holds in full).
  std::map<std::string, AlphaBeta> ops;
  std::map<std::string, std::vector<CommPoint>> points;  // what the fits were made from
  /// Seconds each collective over the group waits beyond its fit when the ranks compute between
  /// collectives with more ranks x threads than cores: a peer the kernel descheduled holds it up
  /// (measure_collective_wait, 4 KiB after wait_gap_s of compute). 0 when every rank has its
  /// cores; a time model adds wait_seconds() to every collective of the group's size (and, the
  /// 2-rank figure, to each of a pipeline's messages).
  double wait_s = 0;
  /// The same wait for a collective of wait_bulk_bytes (0: measured at 4 KiB only). Between
  /// ranks that time-slice cores it grows with the size: 4 ranks on these 2 vCPUs, 2026-12-03,
  /// an all-reduce of 4 KiB between GEMMs waited 0-0.5 ms beyond its fit, of 256 KiB 0.5-0.9 ms
  /// and 1 MiB 0.6-0.8 ms (bench_collectives' in_step_wait_ms), whatever the GEMM between them;
  /// a 256 KiB all-reduce of a tp 4 step took 1.26 ms against the fit's 0.45 (bench_tp).
  double wait_bulk_s = 0;
  int64_t wait_bulk_bytes = 0;
  /// The compute between the collectives wait_s and wait_bulk_s were measured with (a GEMM's
  /// seconds on one rank alone), and the small collective's wait with a longer compute between
  /// (wait_long_s after wait_long_gap_s; 0: not measured). The longer the ranks compute between
  /// collectives, the further apart time slicing sets them: a 4 KiB all-reduce of 4 ranks here
  /// waited 0 after a GEMM of microseconds, 0.1-0.2 ms after 0.1 ms and 0.3-0.55 ms after
  /// 0.3-1 ms (bench_collectives --wait-gemm, 2026-12-03).
  double wait_gap_s = 0;
  double wait_long_s = 0, wait_long_gap_s = 0;
  /// The wait of a collective of `bytes` after `gap_s` of compute (seconds on one rank alone):
  /// the larger of the small collective's (wait_s up to wait_gap_s, wait_long_s from
  /// wait_long_gap_s, linear in the gap between) and the size's (wait_s up to 4 KiB,
  /// wait_bulk_s from wait_bulk_bytes on, linear in the bytes between). wait_s alone when
  /// neither a bulk size nor a long gap was measured.
  double wait_seconds(int64_t bytes, double gap_s = 0) const;

  /// ops.at(op).seconds(bytes). Throws acc::ValueError naming an unknown op (and the known ones)
  /// or negative bytes.
  double seconds(const std::string& op, int64_t bytes) const;

  /// {"world": 2, "ops": {"allreduce": {"alpha_s": ..., "beta_s_per_byte": ...}, ...},
  ///  "points": {"allreduce": [[4096, 2.1e-05], ...], ...}, "wait_s": 2.1e-04,
  ///  "wait_bulk": [262144, 5.1e-04], "wait_gap_s": 2e-05, "wait_long": [1e-03, 4e-04]}
  /// ("wait_s" only when not 0, "wait_bulk", "wait_gap_s" and "wait_long" only when measured).
  nlohmann::json to_json() const;
  /// "points", "wait_s" (finite, >= 0), "wait_bulk" ([bytes > 4096, seconds >= 0]),
  /// "wait_gap_s" (>= 0) and "wait_long" ([gap_s > wait_gap_s, seconds >= 0]) may be absent;
  /// nothing else. Throws acc::ValueError
  /// "comm calibration: field '<path>' ..." naming the field (alpha and beta must be finite and
  /// >= 0).
  static CommCalibration from_json(const nlohmann::json& j);
};

/// The fit calibrate_collectives makes (below): least squares weighted by 1 / t, alpha and beta
/// kept >= 0. Zeros for no points; alpha 0 for one size.
AlphaBeta fit_alpha_beta(const std::vector<CommPoint>& points);

/// 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB.
std::vector<int64_t> default_collective_sizes();

/// Measures the four collectives of `group` at each size (f32 tensors; sizes rounded up to a
/// multiple of 4 x world bytes) and fits t = alpha + beta * bytes to each. A collective over the
/// group: every rank calls it with the same arguments, and every rank gets the same result.
///  - Per point, in each of 3 rounds (a round times every point before the next round begins):
///    one warm-up call (all ranks then agree, through an allreduce of the slowest warm-up, on how
///    many timed calls fill a third of seconds_per_point: at least 1, at most 1000); each rank
///    times each call from issue to the end of wait() and takes the median; the round's time is
///    the max over ranks of those medians (one allreduce for all points), the point's the fastest
///    round's (a round can spend all its calls in a slow placement of the ranks' threads).
///  - The fit is least squares weighted by 1 / t, sum((alpha + beta b - t)^2 / t): a time's noise
///    grows with it, and the sizes span three orders of magnitude. Unweighted, the largest sizes
///    decide alpha (2 ranks here: -26..-30% at 4-64 KiB); weighted by 1 / t^2 (relative error),
///    the small sizes decide beta (-24% at 16 MiB, where a step's buckets are); 1 / t kept both
///    within -19..+26%, the largest size within 8%. alpha and beta are kept non-negative (a time
///    does not fall as the size grows, nor below zero at size 0): when the free fit gives a
///    negative one, that one is set to 0 and the other refitted alone; one size alone gives
///    alpha 0.
///  - Every rank fits the same all-reduced numbers with the same code, so the fits are identical.
/// A group of one: every fit is zero (nothing to communicate), no points. Collectives wait with
/// the group's own timeout (acc::dist::default_timeout()). Throws acc::ValueError for an empty
/// size list, a size < 1 or seconds_per_point not positive and finite, and what the collectives
/// throw (acc::TimeoutError, acc::CommError).
CommCalibration calibrate_collectives(
    dist::ProcessGroup& group, const std::vector<int64_t>& sizes_bytes = default_collective_sizes(),
    double seconds_per_point = 0.05);

/// calibrate_collectives as the search runs it: three sizes (4 KiB latency-bound, 256 KiB, 4 MiB
/// bandwidth-bound) at 10 ms a point. An alpha-beta fit needs no more, and at 6 sizes x 20 ms it
/// was 12-30 steps of a small model's search.
CommCalibration calibrate_collectives_for_search(dist::ProcessGroup& group);

/// calibrate_collectives_for_search on `world` split into contiguous groups of `size` ranks (as tp
/// groups are; groups of one size over one machine's shared memory behave alike), rank 0's group's
/// fits kept by every rank so that all of them price alike. A collective over `world`. Throws
/// acc::ValueError for a size that does not divide the world, and what the collectives throw.
CommCalibration calibrate_contiguous_groups(dist::ProcessGroup& world, int size);

/// Seconds an all-reduce of `bytes` (rounded down to whole f32s; 4 KiB by default) takes in a
/// step beyond `fit`'s figure for it, when every rank computes between collectives: `group` split
/// into contiguous groups of `group_size` (as a tp group is), every rank at once running `calls` x
/// (a GEMM of `shape`; the all-reduce over its group) against the same GEMMs alone, each pass timed
/// whole, the slowest rank's difference per call; the median of 3 such measurements, at least 0.
/// With more ranks than cores a peer the kernel descheduled holds each collective up (4 ranks on
/// these 2 vCPUs, 2026-11-30: 0.02-0.2 ms for a group of 2 and 0.1-0.5 ms for 4, varying that much
/// between runs, with the ranks' placement; seven rounds instead of three did not narrow it), which
/// calibrate_collectives, the ranks doing nothing else, does not see. A collective over `group`:
/// every rank gets the same figure. Throws acc::ValueError for a group size that does not divide
/// the group, calls < 1 or bytes < 4.
double measure_collective_wait(dist::ProcessGroup& group, int group_size, const GemmShape& shape,
                               int64_t calls, const CommCalibration& fit, int64_t bytes = 4 << 10,
                               int stride = 1);

/// What measure_collective_wait computes between collectives for a job whose steps run `shapes`
/// (non-empty): the median of them by FLOPs, and calls enough for about 20 ms a pass at
/// `machine`'s rate for it (16 to 256; every rank gets the same calls from the same machine
/// figures). Throws acc::ValueError for no shapes.
///
/// The bulk probe (CommCalibration::wait_bulk_s): the same GEMMs between all-reduces of
/// bulk_bytes (256 KiB, the middle size calibrate_collectives fits), bulk_calls of them (calls,
/// at most 24: about 1 ms each between 4 ranks here, so that the three rounds of two passes take
/// some 0.2 s a group size).
///
/// The long probe (CommCalibration::wait_long_s): the largest of the shapes by FLOPs, with calls
/// for about 20 ms a pass as well (long_calls, 8 to 256).
struct WaitProbe {
  GemmShape shape;
  int64_t calls = 0;
  GemmShape long_shape;
  int64_t long_calls = 0;
  int64_t bulk_bytes = 256 << 10;
  int64_t bulk_calls = 0;
};
WaitProbe collective_wait_probe(const std::vector<GemmShape>& shapes,
                                const MachineCalibration& machine);

}  // namespace acc::search
