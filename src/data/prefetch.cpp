#include "acc/data/prefetch.hpp"

#include <utility>

#include "acc/util/error.hpp"

namespace acc::data {

PrefetchLoader::PrefetchLoader(std::unique_ptr<Loader> inner, PrefetchOptions options)
    : inner_(std::move(inner)), options_(options) {
  ACC_CHECK(options_.depth >= 1, "prefetch loader: depth must be >= 1, got ", options_.depth);
  ACC_CHECK(inner_ != nullptr, "prefetch loader: the inner loader is null");
  start();
}

PrefetchLoader::~PrefetchLoader() {
  stop();
}

void PrefetchLoader::start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
    running_ = true;
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    throw;
  }
}

void PrefetchLoader::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  not_full_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void PrefetchLoader::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      not_full_.wait(lock,
                     [&] { return stop_ || static_cast<int64_t>(queue_.size()) < options_.depth; });
      if (stop_) break;
    }
    // The batch in hand when a stop comes is queued all the same (the queue has room for it):
    // stopping loses nothing, so the inner loader's position and the queue always agree.
    std::lock_guard<std::mutex> inner_lock(inner_mu_);
    try {
      nlohmann::json before = inner_->state();
      Batch batch = inner_->next();
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(before), std::move(batch)});
    } catch (...) {
      // Anything, not only acc::Error: the training thread rethrows it as it was thrown, and
      // an exception escaping a thread's function would be std::terminate.
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
      break;
    }
    not_empty_.notify_one();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  not_empty_.notify_all();
}

Batch PrefetchLoader::next() {
  std::unique_lock<std::mutex> lock(mu_);
  not_empty_.wait(lock, [&] { return !queue_.empty() || error_ || !running_; });
  if (!queue_.empty()) {
    Batch batch = std::move(queue_.front().batch);
    queue_.pop_front();
    lock.unlock();
    not_full_.notify_one();
    return batch;
  }
  if (error_) std::rethrow_exception(error_);
  ACC_THROW(InternalError,
            "prefetch loader: the background thread stopped with no batch queued "
            "and no error");
}

nlohmann::json PrefetchLoader::state() const {
  // Only this (the training) thread pops, so a batch queued now is still queued below.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty()) return queue_.front().state;
  }
  // Nothing queued: the inner loader's own state, once the batch being built (if any) is queued.
  std::lock_guard<std::mutex> inner_lock(inner_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty()) return queue_.front().state;
  }
  return inner_->state();
}

void PrefetchLoader::load_state(const nlohmann::json& state) {
  stop();
  // The thread has ended: nobody else calls the inner loader until start().
  try {
    inner_->load_state(state);
  } catch (...) {
    // The inner loader has not moved (Loader's contract): the queue still matches its position.
    if (!error_) start();
    throw;
  }
  queue_.clear();
  error_ = nullptr;
  start();
}

}  // namespace acc::data
