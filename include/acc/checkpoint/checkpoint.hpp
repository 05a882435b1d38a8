#pragma once
// Sharded checkpoints: every rank writes the parameters and optimizer state it holds, as the
// placement table says (acc/dist/sharding.hpp), and any rank of any layout reads back exactly the
// regions it holds. No case per strategy: a whole replica (ddp) is written once (by replica 0's
// holder), a flat shard (zero, fsdp) by its owner, and a loader of another world size or method
// finds its regions in the chunks that overlap them.
//
// Commit protocol (save): the shards go into ROOT/.tmp-step-NNNNNNNN-<id>/ and are fsynced; the
// ranks then agree that every one succeeded (any failure fails the save on every rank, naming the
// ranks and their errors, and nothing is committed); rank 0 writes metadata.json (temporary +
// fsync + rename), renames the directory to ROOT/step-NNNNNNNN, fsyncs ROOT, and points
// ROOT/latest at it the same way. A reader therefore sees a committed step whole or not at all; a
// crash at any point leaves the previous committed step loadable (a leftover .tmp-* directory is
// removed by the next save, which holds the root's lock: root_lock.hpp).
//
// The library is split as PyTorch's DCP splits it, one header per concept:
//   format.hpp         metadata.json and the chunks' bytes (parse, validate, decode)
//   layout.hpp         where a checkpoint's pieces live on disk; root_lock.hpp: one writer a root
//   save.hpp           save(): a placement table saved and committed over a group
//   load.hpp           read_metadata() and load(): a placement table filled from a step
//   async_saver.hpp    AsyncSaver: a Trainer's save written while training goes on
//   trainer_state.hpp  save_trainer(), load_trainer(), resume(): a Trainer's whole state
//   export.hpp         export_safetensors(): the weights, whole
// This header includes them all.
//
// Format: acc/checkpoint/format.hpp and checkpoint/README.md. The namespace is acc::ckpt
// (acc::recompute, acc/autograd/recompute.hpp, is activation recomputation; the strategy method
// that applies it keeps the name "checkpoint" in strategy JSON, as ATorch calls it).

#include "acc/checkpoint/async_saver.hpp"
#include "acc/checkpoint/export.hpp"
#include "acc/checkpoint/format.hpp"
#include "acc/checkpoint/layout.hpp"
#include "acc/checkpoint/load.hpp"
#include "acc/checkpoint/root_lock.hpp"
#include "acc/checkpoint/save.hpp"
#include "acc/checkpoint/trainer_state.hpp"
