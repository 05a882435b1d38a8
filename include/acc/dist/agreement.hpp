#pragma once
// A check that every rank of a group is about to run the same thing. Ranks that disagree on the
// model, the strategy or the batch issue collectives of different sizes or in a different order;
// MPI then fails deep inside a collective ("MPI Error in NBC subrequest: 15") or corrupts memory.
// One cheap check before the first such collective turns that into a message naming the first
// difference.

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "acc/dist/process_group.hpp"

namespace acc::dist {

/// Every rank passes its `facts` (any JSON; objects are compared key by key). One allgather of a
/// 64-bit hash of the canonical text (sorted keys) when the ranks agree; when they do not, the
/// texts are gathered and every rank throws the same acc::ValueError naming, for each rank that
/// differs from rank 0, the first differing entry by its dotted path and both values:
///   "ranks disagree on what to run (checked before training): rank 1 has model.config.n_layer =
///    3, rank 0 has 2"
/// `what` prefixes the message. A collective over `group` (the group's usual timeout); nothing to
/// do on a group of one.
void check_agreement(ProcessGroup& group, const nlohmann::json& facts,
                     const std::string& what = "ranks disagree on what to run");

/// Root's `text` on every rank of `group` (what the others pass is ignored): how rank 0's
/// decision or file contents reach the others. Two broadcasts (the length, then the bytes); a
/// collective with the group's usual timeout. Returns `text` on a group of one.
std::string broadcast_text(ProcessGroup& group, const std::string& text, int root = 0);

/// Every rank's `text`, on every rank, in rank order: how the ranks' own findings (pieces of a
/// checkpoint, step counts, error messages) reach everyone. Two all-gathers (the lengths, then
/// the bytes padded to the longest); a collective with the group's usual timeout. {text} on a
/// group of one.
std::vector<std::string> allgather_text(ProcessGroup& group, const std::string& text);

/// "rank 1: <text>; rank 3: <text>" of the non-empty texts (allgather_text's order), "" if none.
std::string rank_messages(const std::vector<std::string>& texts);

}  // namespace acc::dist
