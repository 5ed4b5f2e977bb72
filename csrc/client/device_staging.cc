#include "client/device_staging.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "common/errors.h"

namespace bagpipe::client {

// Pinned buffers, reused by size (a buffer serves any request up to its capacity).
class PinnedPool {
 public:
  explicit PinnedPool(std::shared_ptr<DeviceApi> api) : api_(std::move(api)) {}
  ~PinnedPool() {
    for (auto& [cap, p] : free_) api_->FreePinned(p);
  }
  void* Take(size_t bytes, size_t* capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end()) {
        *capacity = it->first;
        void* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    // Round up so that a slightly larger step reuses the buffer.
    size_t cap = 4096;
    while (cap < bytes) cap *= 2;
    void* p = api_->AllocPinned(cap);
    std::lock_guard<std::mutex> lock(mu_);
    held_ += cap;
    *capacity = cap;
    return p;
  }
  void Give(void* p, size_t capacity) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() >= kMaxFree) {
      api_->FreePinned(p);
      held_ -= capacity;
      return;
    }
    free_.emplace(capacity, p);
  }
  uint64_t held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  static constexpr size_t kMaxFree = 8;
  const std::shared_ptr<DeviceApi> api_;
  mutable std::mutex mu_;  // guards free_, held_
  std::multimap<size_t, void*> free_;
  uint64_t held_ = 0;
};

// ---- StagedRows ------------------------------------------------------------------------------

StagedRows::StagedRows(std::shared_ptr<PinnedPool> pool, size_t bytes)
    : pool_(std::move(pool)), bytes_(bytes) {}

StagedRows::~StagedRows() {
  if (buffer_ != nullptr) pool_->Give(buffer_, capacity_);
}

const float* StagedRows::Wait(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return done_; })) {
    throw TimeoutError("gradients staged from device memory were not ready within the timeout");
  }
  if (!error_.empty()) {
    if (timed_out_) throw TimeoutError(error_);
    throw std::runtime_error(error_);
  }
  return static_cast<const float*>(buffer_);
}

bool StagedRows::Done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

// ---- DeviceStager ----------------------------------------------------------------------------

DeviceStager::DeviceStager(std::shared_ptr<DeviceApi> api, double timeout)
    : api_(std::move(api)), timeout_(timeout), pool_(std::make_shared<PinnedPool>(api_)) {
  if (!api_) throw ValueError("DeviceStager needs a device API");
  if (!(timeout > 0)) throw ValueError("DeviceStager timeout must be > 0");
  worker_ = std::thread([this] { Loop(); });
}

DeviceStager::~DeviceStager() {
  std::deque<Job> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  worker_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  for (auto& j : left) Finish(*j.rows, "the gradient stager was shut down", false);
  for (auto& [dev, s] : streams_) api_->DestroyStream(s);
}

std::shared_ptr<StagedRows> DeviceStager::Stage(const DeviceSource& source) {
  if (source.bytes > 0 && (source.src == nullptr || source.event == nullptr)) {
    throw ValueError("a device source needs a pointer and a CUDA event");
  }
  std::shared_ptr<StagedRows> rows(new StagedRows(pool_, source.bytes));
  // The pinned buffer is taken now, so its address is known before the copy is done (a
  // commit can be queued with it and wait for the copy on the client's worker).
  if (source.bytes > 0) rows->buffer_ = pool_->Take(source.bytes, &rows->capacity_);
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) throw std::runtime_error("the gradient stager is shut down");
  queue_.push_back(Job{source, rows});
  cv_.notify_all();
  return rows;
}

StagerStats DeviceStager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  StagerStats s = stats_;
  s.pinned_bytes = pool_->held();
  return s;
}

void DeviceStager::Finish(StagedRows& rows, const std::string& error, bool timed_out) {
  std::lock_guard<std::mutex> lock(rows.mu_);
  rows.error_ = error;
  rows.timed_out_ = timed_out;
  rows.done_ = true;
  rows.cv_.notify_all();
}

void DeviceStager::Loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(job);
  }
}

void DeviceStager::Run(Job& job) {
  const DeviceSource& s = job.source;
  StagedRows& rows = *job.rows;
  const std::string dev = "device " + std::to_string(s.device);
  try {
    if (s.bytes > 0) {
      api_->SetDevice(s.device);
      // Invariant 1: poll the producer's event (bounded) before touching the source.
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(timeout_));
      auto pause = std::chrono::microseconds(10);
      uint64_t polls = 0;
      while (!api_->EventDone(s.event)) {
        ++polls;
        if (Clock::now() >= deadline) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            stats_.event_polls += polls;
            ++stats_.failed;
          }
          Finish(rows, "gradients on " + dev + ": the producer stream's CUDA event did not "
                       "complete within " + std::to_string(timeout_) + " s", true);
          return;
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(1000));
      }
      void*& stream = streams_[s.device];
      if (stream == nullptr) stream = api_->CreateStream();
      api_->CopyToHostAsync(rows.buffer_, s.src, s.bytes, stream);
      pause = std::chrono::microseconds(5);
      while (!api_->StreamDone(stream)) {
        if (Clock::now() >= deadline) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            stats_.event_polls += polls;
            ++stats_.failed;
          }
          Finish(rows, "gradients on " + dev + ": the copy to pinned memory did not complete "
                       "within " + std::to_string(timeout_) + " s", true);
          return;
        }
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(500));
      }
      std::lock_guard<std::mutex> lock(mu_);
      stats_.event_polls += polls;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.staged;
      stats_.bytes += s.bytes;
    }
    Finish(rows, "", false);
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.failed;
    }
    Finish(rows, "staging gradients from " + dev + " failed: " + e.what(), false);
  }
}

}  // namespace bagpipe::client
