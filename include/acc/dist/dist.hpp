#pragma once
// Process start-up for multi-process runs. Every multi-process run goes through mpirun:
//
//   mpirun -np 4 build/examples/train_gpt --strategy '[{"name": "ddp"}]' ...
//
// init() calls MPI_Init_thread, reads rank, world size and local rank, starts the communication
// thread, prefixes every log line with "[r<rank>/<world>]", and sizes the threads (ACC_NUM_THREADS,
// default 1 per rank so that ranks x threads never exceeds the cores). A process started without
// mpirun is a world of one.

#include "acc/dist/agreement.hpp"
#include "acc/dist/device_mesh.hpp"
#include "acc/dist/functional.hpp"
#include "acc/dist/process_group.hpp"

namespace acc::dist {

/// Idempotent. Throws acc::CommError when MPI cannot be initialised with at least
/// MPI_THREAD_SERIALIZED.
void init(int* argc = nullptr, char*** argv = nullptr);
inline void init(int& argc, char**& argv) {
  init(&argc, &argv);
}
/// Drains the communication thread and finalises MPI. Safe to call twice or without init.
void finalize();
bool is_initialized();

int rank();
int world_size();
/// Rank among the processes of this node (OMPI_COMM_WORLD_LOCAL_RANK), 0 without mpirun.
int local_rank();
/// Processes of this job on this node (OMPI_COMM_WORLD_LOCAL_SIZE), 1 without mpirun.
int local_world_size();

/// RAII: init() on construction, finalize() on destruction.
class Session {
 public:
  Session(int& argc, char**& argv) { init(argc, argv); }
  ~Session() { finalize(); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
};

}  // namespace acc::dist
