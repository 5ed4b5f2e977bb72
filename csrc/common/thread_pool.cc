#include "common/thread_pool.h"

namespace bagpipe {

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
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
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    ++active_;
    lock.unlock();
    Drain();
    lock.lock();
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
    ++generation_;
  }
  work_cv_.notify_all();
  Drain();
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
