#include "common/thread_pool.h"

#include <chrono>

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
  if (spin_us <= 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 0;; ++i) {
    if (done()) return true;
    CpuRelax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return false;
  }
}
}  // namespace

ThreadPool::ThreadPool(int num_threads, int spin_us)
    : num_threads_(num_threads < 1 ? 1 : num_threads), spin_us_(spin_us < 0 ? 0 : spin_us) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    generation_seen_.fetch_add(1, std::memory_order_release);  // ends any spin
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  while (next_ < n_) {
    size_t i = next_++;
    const auto* fn = fn_;
    lock.unlock();
    try {
      (*fn)(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    busy_.fetch_sub(1, std::memory_order_release);
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!stop_ && generation_ == seen && spin_us_ > 0) {
      lock.unlock();
      SpinUntil(spin_us_, [&] { return generation_seen_.load(std::memory_order_acquire) != seen; });
      lock.lock();
    }
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    ++active_;
    busy_.fetch_add(1, std::memory_order_relaxed);
    lock.unlock();
    Drain();
    lock.lock();
    busy_.fetch_sub(1, std::memory_order_release);
    if (--active_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::Run(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (num_threads_ == 1 || n == 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    remaining_ = n;
    error_ = nullptr;
    busy_.store(n, std::memory_order_relaxed);
    ++generation_;
    generation_seen_.store(generation_, std::memory_order_release);
  }
  work_cv_.notify_all();
  Drain();
  SpinUntil(spin_us_, [&] { return busy_.load(std::memory_order_acquire) == 0; });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Wait for all tasks and for every worker to leave Drain (fn_ must outlive them).
    done_cv_.wait(lock, [&] { return remaining_ == 0 && active_ == 0; });
    fn_ = nullptr;
    n_ = 0;
    err = error_;
    error_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace bagpipe
