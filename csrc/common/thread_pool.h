// A fixed-size pool that runs one parallel loop at a time.
//
// Thread safety: Run() may be called from any thread, but calls are serialized by an
// internal mutex; the calling thread takes part in the work. fn must not call Run on the
// same pool (it would deadlock on that mutex). The destructor must not race a Run.
// Scheduling: tasks are claimed one at a time through a single atomic word that holds the
// job's generation and its count of unclaimed tasks, so a claim never takes a lock, a
// worker that wakes late cannot claim a task of a job other than the one it saw start, and
// a descheduled worker leaves its share to the others (once the caller has drained the
// word it waits only for tasks already claimed, never for idle workers to wake).
// Latency: with spin_us > 0, idle workers poll for the next job (and Run polls for claimed
// tasks to finish) for up to spin_us microseconds before blocking, so back-to-back short
// jobs do not pay a futex wake-up each. spin_us = 0 always blocks.
// Invariants:
//   1. A pool of N threads owns N-1 worker threads; the caller is the N-th.
//   2. Run(n, fn) returns only after fn(i) has returned for every i in [0, n), and no
//      thread calls fn after Run returns.
//   3. The first exception thrown by any fn(i) is rethrown by Run on the caller's thread
//      after every task has finished; later exceptions are dropped.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
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

  // As constructed: the caller's thread plus num_threads - 1 workers run each Run.
  int num_threads() const { return num_threads_; }

  // Largest n accepted by Run (the claim word keeps the count in 32 bits).
  static constexpr size_t kMaxTasks = 0xFFFFFFFFu;

  // Runs fn(0) ... fn(n-1), spread over the pool. Tasks are claimed dynamically.
  // Throws std::invalid_argument when n > kMaxTasks (before running anything).
  void Run(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs tasks of job `gen` until none are left.
  void Drain(uint32_t gen);

  const int num_threads_;
  const int spin_us_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes Run() calls

  // The current job. Run (holding run_mu_) writes fn_, n_ and resets finished_ before it
  // publishes the job in claim_ (release); other threads read fn_ and n_ only after a
  // successful claim (acquire), which proves that job's Run has not returned.
  const std::function<void(size_t)>* fn_ = nullptr;
  std::atomic<uint32_t> n_{0};
  // generation << 32 | tasks not claimed yet. Run stores it; claimers CAS it down.
  std::atomic<uint64_t> claim_{0};
  // Generation of the latest job; workers poll it. Written by Run and by the destructor.
  std::atomic<uint32_t> gen_{0};
  // Tasks of the current job that have returned; incremented by whoever ran the task.
  std::atomic<size_t> finished_{0};
  std::atomic<bool> stop_{false};  // set once, by the destructor

  std::mutex error_mu_;       // guards error_
  std::exception_ptr error_;  // first error of the current job

  // Blocking. An idle worker registers in sleepers_ and waits on work_cv_ (both under
  // sleep_mu_) for gen_ to change; Run, after storing gen_, notifies when sleepers_ > 0.
  // A caller that stops polling sets caller_waiting_ and waits on done_cv_ (under
  // sleep_mu_) for finished_ == n; the thread finishing the last task notifies when it sees
  // caller_waiting_. Both handshakes are store-then-load on seq_cst atomics on each side,
  // so at least one side sees the other and no wake-up is lost.
  std::mutex sleep_mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
};

}  // namespace bagpipe
