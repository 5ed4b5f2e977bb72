#include <atomic>
#include <stdexcept>

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
