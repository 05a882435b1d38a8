#include "acc/data/batch.hpp"

#include "acc/util/error.hpp"

namespace acc::data {

Batch::Batch(Tensor idx, Tensor targets)
    : Batch(std::vector<Entry>{{"idx", std::move(idx)}, {"targets", std::move(targets)}}) {}

Batch::Batch(std::vector<Entry> tensors) : tensors_(std::move(tensors)) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const std::string& name = tensors_[i].first;
    ACC_CHECK(!name.empty(), "batch: tensor ", i, " has an empty name");
    ACC_CHECK(tensors_[i].second.defined(), "batch: tensor '", name, "' is undefined");
    for (size_t j = 0; j < i; ++j) {
      ACC_CHECK(tensors_[j].first != name, "batch: the name '", name, "' is given twice");
    }
  }
}

const Tensor& Batch::at(const std::string& name) const {
  for (const auto& [n, t] : tensors_) {
    if (n == name) return t;
  }
  std::string have;
  for (const auto& [n, t] : tensors_) have += (have.empty() ? "" : ", ") + n;
  ACC_THROW(ValueError, "batch: no tensor named '", name, "' (the batch has ",
            have.empty() ? std::string("none") : have, ")");
}

bool Batch::contains(const std::string& name) const {
  for (const auto& [n, t] : tensors_) {
    if (n == name) return true;
  }
  return false;
}

int64_t Batch::size() const {
  ACC_CHECK(!tensors_.empty(), "batch: it holds no tensor, so it has no size");
  int64_t n = -1;
  for (const auto& [name, t] : tensors_) {
    ACC_CHECK_AS(ShapeError, t.dim() >= 1, "batch: tensor '", name,
                 "' has no dimension to hold samples (shape ", to_string(t.shape()), ")");
    if (n < 0) n = t.size(0);
    ACC_CHECK_AS(ShapeError, t.size(0) == n, "batch: tensors disagree on the batch dimension: '",
                 tensors_.front().first, "' has ", n, " sample(s), '", name, "' has ", t.size(0),
                 " (", describe(), ")");
  }
  return n;
}

Batch Batch::narrow(int64_t start, int64_t n) const {
  const int64_t total = size();
  ACC_CHECK(start >= 0 && n >= 0 && start + n <= total, "batch: samples [", start, ", ", start + n,
            ") are outside its ", total);
  Batch out;
  for (const auto& [name, t] : tensors_) out.tensors_.emplace_back(name, t.narrow(0, start, n));
  return out;
}

std::vector<Batch> Batch::split(int parts, const std::string& what) const {
  ACC_CHECK(parts >= 1, what, ": cannot split a batch into ", parts, " parts");
  const int64_t total = size();
  ACC_CHECK(total % parts == 0, what, ": a batch of ", total, " sample(s) does not split into ",
            parts, " equal micro-batch(es) (", describe(), ")");
  const int64_t each = total / parts;
  std::vector<Batch> out;
  for (int i = 0; i < parts; ++i) out.push_back(narrow(i * each, each));
  return out;
}

std::string Batch::describe() const {
  std::string out;
  for (const auto& [name, t] : tensors_) {
    out +=
        (out.empty() ? "" : ", ") + name + " " + to_string(t.shape()) + " " + dtype_name(t.dtype());
  }
  return out.empty() ? "empty" : out;
}

}  // namespace acc::data
