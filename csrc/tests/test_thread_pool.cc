#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "tests/test_harness.h"

TEST_CASE(thread_pool_runs_every_task_once) {
  for (int threads : {1, 2, 4}) {
    bagpipe::ThreadPool pool(threads);
    for (size_t n : {0u, 1u, 7u, 1000u}) {
      std::vector<std::atomic<int>> hits(n);
      pool.Run(n, [&](size_t i) { hits[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) CHECK_EQ(hits[i].load(), 1);
    }
  }
}

TEST_CASE(thread_pool_rethrows_first_error) {
  bagpipe::ThreadPool pool(3);
  std::atomic<int> done{0};
  CHECK_THROWS(std::runtime_error, pool.Run(64, [&](size_t i) {
                 done.fetch_add(1);
                 if (i == 5) throw std::runtime_error("task 5");
               }));
  CHECK_EQ(done.load(), 64);
  // The pool stays usable after an error.
  std::atomic<int> again{0};
  pool.Run(10, [&](size_t) { again.fetch_add(1); });
  CHECK_EQ(again.load(), 10);
}

TEST_CASE(thread_pool_spinning_runs_back_to_back_jobs) {
  for (int spin : {0, 200}) {
    bagpipe::ThreadPool pool(2, spin);
    std::atomic<long> sum{0};
    for (int job = 0; job < 2000; ++job) {
      pool.Run(2, [&](size_t i) { sum.fetch_add(static_cast<long>(i) + 1); });
    }
    CHECK_EQ(sum.load(), 2000L * 3);
  }
}

TEST_CASE(thread_pool_late_workers_never_run_a_finished_job) {
  // Jobs of varying size back to back: a worker that wakes late must neither run a task of
  // a job whose Run has returned nor claim a task twice.
  for (int threads : {2, 3}) {
    for (int spin : {0, 50}) {
      bagpipe::ThreadPool pool(threads, spin);
      std::atomic<int> open_job{-1};
      std::atomic<int> violations{0};
      for (int job = 0; job < 3000; ++job) {
        const size_t n = 1 + static_cast<size_t>(job * 7919) % 9;
        std::vector<std::atomic<int>> hits(n);
        open_job.store(job);
        pool.Run(n, [&, job](size_t i) {
          if (open_job.load() != job || i >= n) violations.fetch_add(1);
          hits[i].fetch_add(1);
        });
        open_job.store(-1);
        for (size_t i = 0; i < n; ++i) CHECK_EQ(hits[i].load(), 1);
      }
      CHECK_EQ(violations.load(), 0);
    }
  }
}

TEST_CASE(thread_pool_serial_path_runs_every_task_then_rethrows) {
  // n == 1 and one-thread pools run inline; they keep the parallel path's error contract.
  for (int threads : {1, 2}) {
    bagpipe::ThreadPool pool(threads);
    std::atomic<int> done{0};
    const size_t n = threads == 1 ? 5 : 1;
    CHECK_THROWS(std::runtime_error, pool.Run(n, [&](size_t) {
                   done.fetch_add(1);
                   throw std::runtime_error("every task fails");
                 }));
    CHECK_EQ(done.load(), static_cast<int>(n));
  }
}

TEST_CASE(thread_pool_rejects_too_many_tasks_before_running_any) {
  bagpipe::ThreadPool pool(2);
  std::atomic<int> done{0};
  CHECK_THROWS(std::invalid_argument,
               pool.Run(bagpipe::ThreadPool::kMaxTasks + 1, [&](size_t) { done.fetch_add(1); }));
  CHECK_EQ(done.load(), 0);
}

TEST_CASE(thread_pool_destructor_stops_idle_spinning_and_sleeping_workers) {
  // Destroyed right after a job (workers spinning), after they fell asleep, and unused.
  for (int spin : {0, 1000}) {
    for (int round = 0; round < 50; ++round) {
      bagpipe::ThreadPool pool(4, spin);
      std::atomic<int> done{0};
      if (round % 3 != 2) pool.Run(8, [&](size_t) { done.fetch_add(1); });
      if (round % 3 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      CHECK_EQ(done.load(), round % 3 != 2 ? 8 : 0);
    }
  }
}

TEST_CASE(thread_pool_destroyed_right_after_short_jobs_never_hangs) {
  // A worker that wakes for a job the caller already finished can read the destructor's
  // generation bump as its next job; it must still see stop_ and exit.
  for (int spin : {0, 20}) {
    for (int round = 0; round < 3000; ++round) {
      bagpipe::ThreadPool pool(3, spin);
      std::atomic<int> done{0};
      pool.Run(1 + static_cast<size_t>(round % 3), [&](size_t) { done.fetch_add(1); });
      CHECK_EQ(done.load(), 1 + round % 3);
    }
  }
}
