#include "common/thread_pool.h"

#include <chrono>
#include <stdexcept>
#include <string>

namespace bagpipe {

namespace {
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls done() for up to spin_us microseconds; returns whether it became true.
template <typename Done>
bool SpinUntil(int spin_us, Done done) {
  if (spin_us <= 0) return done();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return done();
  }
}
}  // namespace

ThreadPool::ThreadPool(int num_threads, int spin_us)
    : num_threads_(num_threads < 1 ? 1 : num_threads), spin_us_(spin_us < 0 ? 0 : spin_us) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(sleep_mu_);
    stop_.store(true);
    gen_.fetch_add(1);  // ends any poll
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Drain(uint32_t gen) {
  const uint64_t tag = uint64_t{gen} << 32;
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    // The word counts the job's unclaimed tasks down. A claim succeeds only while it still
    // names job `gen` with a task left, so that job's Run has not returned: fn_ and n_ are
    // that job's (published before the word, made visible by the acquire).
    if ((c & ~uint64_t{0xFFFFFFFFu}) != tag || (c & 0xFFFFFFFFu) == 0) return;
    if (!claim_.compare_exchange_weak(c, c - 1, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;
    }
    const uint32_t n = n_.load(std::memory_order_relaxed);
    try {
      (*fn_)(n - static_cast<uint32_t>(c & 0xFFFFFFFFu));
    } catch (...) {
      std::lock_guard<std::mutex> g(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
    if (finished_.fetch_add(1, std::memory_order_seq_cst) + 1 == n &&
        caller_waiting_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      done_cv_.notify_all();
    }
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::WorkerLoop() {
  uint32_t seen = 0;
  // stop_ is part of the wake condition, not only the generation: a worker that read its
  // `seen` after the destructor's generation bump would otherwise wait for a job that never
  // comes (stop_ is set under sleep_mu_, so a sleeper cannot miss it).
  const auto woken = [&] {
    return stop_.load(std::memory_order_seq_cst) || gen_.load(std::memory_order_seq_cst) != seen;
  };
  for (;;) {
    if (!SpinUntil(spin_us_, woken)) {
      std::unique_lock<std::mutex> lock(sleep_mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      work_cv_.wait(lock, woken);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }
    if (stop_.load()) return;
    seen = gen_.load(std::memory_order_acquire);
    Drain(seen);
  }
}

void ThreadPool::Run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n > kMaxTasks) {
    throw std::invalid_argument("ThreadPool::Run: n = " + std::to_string(n) + " exceeds " +
                                std::to_string(kMaxTasks) + " tasks");
  }
  if (num_threads_ == 1 || n == 1) {
    // Same contract as the parallel path: every task runs, the first error is rethrown last.
    std::exception_ptr err;
    for (size_t i = 0; i < n; ++i) {
      try {
        fn(i);
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  fn_ = &fn;
  n_.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(error_mu_);
    error_ = nullptr;
  }
  const uint32_t gen = gen_.load(std::memory_order_relaxed) + 1;
  claim_.store(uint64_t{gen} << 32 | n, std::memory_order_release);
  gen_.store(gen, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> lock(sleep_mu_); }  // a sleeper between its check and wait
    work_cv_.notify_all();
  }
  Drain(gen);
  // Every task is claimed now; wait for the ones other threads are still running.
  if (!SpinUntil(spin_us_, [&] { return finished_.load(std::memory_order_acquire) == n; })) {
    std::unique_lock<std::mutex> lock(sleep_mu_);
    caller_waiting_.store(true, std::memory_order_seq_cst);
    done_cv_.wait(lock, [&] { return finished_.load(std::memory_order_seq_cst) == n; });
    caller_waiting_.store(false, std::memory_order_relaxed);
  }
  fn_ = nullptr;
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> g(error_mu_);
    err = error_;
    error_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace bagpipe
