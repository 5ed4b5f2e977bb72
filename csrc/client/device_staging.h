// DeviceStager: gradients that live in GPU memory, staged asynchronously into pinned host
// buffers for a PSClient commit. A native worker waits for the producer stream's event
// (the backward pass that wrote the gradients) before it reads them, copies them on its own
// stream into a pooled pinned buffer, and the client's worker — whose commit was queued with
// that buffer and a `ready` hook that waits for it (PSClient::CommitAsync) — packs it into
// transport slots. Keys never touch the device: they come from the CPU-side plans.
//
// Thread safety: Stage is thread-safe; StagedRows::Wait may be called from any thread.
//
// Invariants:
//   1. A source is read only after its event completed (EventDone), never before.
//   2. The pinned buffer of a StagedRows lives until the StagedRows is destroyed (the
//      commit's ready hook holds it until the commit op is gone), then returns to the pool. The source
//      memory must stay allocated until Wait returned or failed (the Python client keeps the
//      tensor and its event in the commit's handle until the commit is done).
//   3. Every wait is bounded: the event and the copy each by the stager's timeout
//      (TimeoutError naming the device), Wait by its deadline.
//   4. Jobs run in submission order; after the destructor returns, no job runs and pending
//      ones failed.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_api.h"
#include "common/deadline.h"

namespace bagpipe::client {

struct DeviceSource {
  const void* src = nullptr;  // device pointer to bytes of float32 rows
  size_t bytes = 0;
  int device = 0;
  void* event = nullptr;      // cudaEvent_t recorded on the producer stream after the writes
};

struct StagerStats {
  uint64_t staged = 0;       // jobs copied
  uint64_t bytes = 0;
  uint64_t event_polls = 0;  // EventDone queries that found the producer still running
  uint64_t failed = 0;
  uint64_t pinned_bytes = 0; // pinned memory held by the pool and in-use buffers
};

class PinnedPool;

class StagedRows {
 public:
  // Returns the pinned buffer to the pool (invariant 2).
  ~StagedRows();
  // The rows (n x dim), readable while this object lives. Throws TimeoutError at the
  // deadline (or when the producer's event never completed), or the staging error.
  const float* Wait(Deadline deadline);
  bool Done() const;
  // The pinned buffer the rows land in (nullptr for zero bytes); readable after Wait.
  const float* data() const { return static_cast<const float*>(buffer_); }

 private:
  friend class DeviceStager;
  StagedRows(std::shared_ptr<PinnedPool> pool, size_t bytes);

  const std::shared_ptr<PinnedPool> pool_;
  const size_t bytes_;
  void* buffer_ = nullptr;  // pinned; set by Stage, written by the worker before done_
  size_t capacity_ = 0;     // of buffer_ (its pool size class)

  mutable std::mutex mu_;  // guards done_ and error_
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  bool timed_out_ = false;
};

class DeviceStager {
 public:
  // REQUIRES: api != nullptr; timeout > 0 (seconds, per event wait and per copy).
  DeviceStager(std::shared_ptr<DeviceApi> api, double timeout);
  ~DeviceStager();
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  // Takes a pinned buffer and queues the staging of `source` into it; returns at once.
  // Throws ValueError for a null source with bytes > 0, std::runtime_error if pinned memory
  // cannot be allocated.
  std::shared_ptr<StagedRows> Stage(const DeviceSource& source);
  StagerStats stats() const;

 private:
  struct Job {
    DeviceSource source;
    std::shared_ptr<StagedRows> rows;
  };
  void Loop();
  void Run(Job& job);
  void Finish(StagedRows& rows, const std::string& error, bool timed_out);

  const std::shared_ptr<DeviceApi> api_;
  const double timeout_;
  const std::shared_ptr<PinnedPool> pool_;
  std::map<int, void*> streams_;  // worker thread only: one copy stream per device

  mutable std::mutex mu_;  // guards queue_, stop_, stats_
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  StagerStats stats_;
  std::thread worker_;
};

}  // namespace bagpipe::client
