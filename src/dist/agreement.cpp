#include "acc/dist/agreement.hpp"

#include <algorithm>

#include <cstring>
#include <map>
#include <vector>

#include "acc/util/error.hpp"
#include "acc/util/hash.hpp"

namespace acc::dist {
namespace {

// Objects become dotted paths; everything else (arrays included) is one entry, its JSON text.
void flatten(const nlohmann::json& j, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  out[prefix.empty() ? "(facts)" : prefix] = j.dump();
}

// The first entry (in path order) where `theirs` differs from `ours`.
std::string first_difference(const std::map<std::string, std::string>& ours,
                             const std::map<std::string, std::string>& theirs, int their_rank) {
  auto a = ours.begin();
  auto b = theirs.begin();
  const std::string absent = "(absent)";
  while (a != ours.end() || b != theirs.end()) {
    const std::string* key;
    const std::string *va = &absent, *vb = &absent;
    if (b == theirs.end() || (a != ours.end() && a->first < b->first)) {
      key = &a->first;
      va = &a->second;
      ++a;
    } else if (a == ours.end() || b->first < a->first) {
      key = &b->first;
      vb = &b->second;
      ++b;
    } else {
      key = &a->first;
      va = &a->second;
      vb = &b->second;
      ++a;
      ++b;
    }
    if (*va != *vb) {
      return ::acc::detail::str_cat("rank ", their_rank, " has ", *key, " = ", *vb, ", rank 0 has ",
                                    *va);
    }
  }
  return ::acc::detail::str_cat("rank ", their_rank, " differs from rank 0");  // a hash collision
}

}  // namespace

void check_agreement(ProcessGroup& group, const nlohmann::json& facts, const std::string& what) {
  const int n = group.size();
  if (n == 1) return;
  const std::string text = facts.dump();
  Tensor mine = from_vector(
      std::vector<int64_t>{static_cast<int64_t>(fnv1a64(text)), static_cast<int64_t>(text.size())},
      {2});
  Tensor all = empty({2 * static_cast<int64_t>(n)}, {DType::kInt64});
  group.allgather(all, mine)->wait();
  const auto summary = all.to_vector<int64_t>();
  int64_t longest = 0;
  bool same = true;
  for (int r = 0; r < n; ++r) {
    same = same && summary[2 * r] == summary[0];
    longest = std::max(longest, summary[2 * r + 1]);
  }
  if (same) return;

  // Disagreement: gather the texts (one i32 per byte; only on this failure path) and name the
  // first difference of each rank from rank 0. Every rank computes the same message.
  std::vector<int32_t> chars(static_cast<size_t>(longest), 0);
  for (size_t i = 0; i < text.size(); ++i) chars[i] = static_cast<unsigned char>(text[i]);
  Tensor padded = from_vector(chars, {longest});
  Tensor texts = empty({longest * n}, {DType::kInt32});
  group.allgather(texts, padded)->wait();
  const auto bytes = texts.to_vector<int32_t>();
  std::vector<std::map<std::string, std::string>> flat(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    std::string s(static_cast<size_t>(summary[2 * r + 1]), '\0');
    for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(bytes[r * longest + i]);
    flatten(nlohmann::json::parse(s), "", flat[static_cast<size_t>(r)]);
  }
  std::string msg = what + " (checked before the first collective of the run):";
  for (int r = 1; r < n; ++r) {
    if (summary[2 * r] == summary[0]) continue;
    msg += ' ';
    msg += first_difference(flat[0], flat[static_cast<size_t>(r)], r);
    msg += ';';
  }
  msg.pop_back();
  throw ValueError(msg);
}

std::string broadcast_text(ProcessGroup& group, const std::string& text, int root) {
  ACC_CHECK(root >= 0 && root < group.size(), "broadcast_text: root ", root,
            " is not a rank of group '", group.name(), "' of ", group.size());
  if (group.size() == 1) return text;
  Tensor length = from_vector(std::vector<int64_t>{static_cast<int64_t>(text.size())}, {1});
  group.broadcast(length, root)->wait();
  const int64_t n = length.data<int64_t>()[0];
  Tensor bytes =
      zeros({(n + 3) / 4}, TensorOptions{.dtype = DType::kInt32, .device = Device::kCPU});
  if (n == 0) {                            // an empty tensor has no storage to copy into or out of
    group.broadcast(bytes, root)->wait();  // every rank issues the same collectives
    return {};
  }
  if (group.rank() == root) std::memcpy(bytes.data<int32_t>(), text.data(), text.size());
  group.broadcast(bytes, root)->wait();
  return {reinterpret_cast<const char*>(bytes.data<int32_t>()), static_cast<size_t>(n)};
}

std::vector<std::string> allgather_text(ProcessGroup& group, const std::string& text) {
  const int W = group.size();
  if (W == 1) return {text};
  Tensor mine = from_vector(std::vector<int64_t>{static_cast<int64_t>(text.size())}, {1});
  Tensor lengths = zeros({W}, TensorOptions{.dtype = DType::kInt64, .device = Device::kCPU});
  group.allgather(lengths, mine)->wait();
  const std::vector<int64_t> n = lengths.to_vector<int64_t>();
  const int64_t words = (*std::max_element(n.begin(), n.end()) + 3) / 4;
  if (words == 0) return std::vector<std::string>(static_cast<size_t>(W));  // same on every rank
  const TensorOptions i32{.dtype = DType::kInt32, .device = Device::kCPU};
  Tensor own = zeros({words}, i32), all = zeros({words * W}, i32);
  if (!text.empty()) std::memcpy(own.data<int32_t>(), text.data(), text.size());
  group.allgather(all, own)->wait();
  std::vector<std::string> out;
  const char* base = reinterpret_cast<const char*>(all.data<int32_t>());
  for (int r = 0; r < W; ++r) {
    out.emplace_back(base + static_cast<size_t>(r) * static_cast<size_t>(words) * 4,
                     static_cast<size_t>(n[static_cast<size_t>(r)]));
  }
  return out;
}

std::string rank_messages(const std::vector<std::string>& texts) {
  std::string out;
  for (size_t r = 0; r < texts.size(); ++r) {
    if (texts[r].empty()) continue;
    out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + texts[r];
  }
  return out;
}

}  // namespace acc::dist
