// A fixed-size pool that runs one parallel loop at a time.
//
// Thread safety: Run() may be called from any thread, but calls are serialized by an
// internal mutex; the calling thread takes part in the work.
// Latency: with spin_us > 0, idle workers poll for the next job (and Run polls for the
// workers to finish) for up to spin_us microseconds before blocking, so back-to-back short
// jobs do not pay a futex wake-up each. spin_us = 0 always blocks.
// Invariants:
//   1. A pool of N threads owns N-1 worker threads; the caller is the N-th.
//   2. Run(n, fn) returns only after fn(i) has returned for every i in [0, n).
//   3. The first exception thrown by any fn(i) is rethrown by Run on the caller's thread
//      after every task has finished; later exceptions are dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace bagpipe {

class ThreadPool {
 public:
  // REQUIRES: num_threads >= 1, spin_us >= 0.
  explicit ThreadPool(int num_threads, int spin_us = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(0) ... fn(n-1), spread over the pool. Tasks are claimed dynamically.
  void Run(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();
  void Drain();  // claims tasks of the current job until none are left

  const int num_threads_;
  const int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes Run() calls

  std::mutex mu_;  // guards every field below
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(size_t)>* fn_ = nullptr;  // set by Run for one job
  size_t n_ = 0;
  size_t next_ = 0;
  size_t active_ = 0;      // workers currently inside Drain for this job
  size_t remaining_ = 0;   // tasks not finished yet
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  // Lock-free mirrors of generation_ and (remaining_ + active_) for polling only; every
  // decision is re-checked under mu_.
  std::atomic<uint64_t> generation_seen_{0};
  std::atomic<size_t> busy_{0};
};

}  // namespace bagpipe
