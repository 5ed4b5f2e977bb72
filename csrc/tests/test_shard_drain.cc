// The drain of a shard (PSShard::BeginShutdown) and what its clients hear: every refusal
// after the drain began names its reason, whether the request raced the drain or came after
// it, and whether it was refused by the shard (Dispatch) or by a table (coordinator).
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/ps_client.h"
#include "common/errors.h"
#include "shard/ps_shard.h"
#include "tests/ps_client_test_util.h"
#include "tests/test_harness.h"
#include "transport/local_channel.h"

using namespace bagpipe;
using namespace bagpipe::client;
using bagpipe::testing::ChannelOpts;
using bagpipe::testing::MakeShard;

namespace {

constexpr uint32_t kDim = bagpipe::testing::kClientDim;
const char* const kDrained = "PS shard 0 is shutting down: SIGTERM";

std::unique_ptr<PSClient> Connect(const std::shared_ptr<shard::PSShard>& shard, uint32_t rank,
                                  uint32_t world, uint64_t session = 7,
                                  const std::string& table = "emb") {
  auto o = bagpipe::testing::ClientOpts(session, rank, world, /*max_rows=*/3, /*inflight=*/2);
  o.table = table;
  o.timeout = 10;
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o)));
  return std::make_unique<PSClient>(o, std::move(c));
}

bool NamesTheReason(const std::string& what) { return what.find(kDrained) != std::string::npos; }

}  // namespace

TEST_CASE(drain_every_refusal_after_it_names_the_reason) {
  auto shard = MakeShard(0, 1);
  auto a = Connect(shard, 0, 2);  // rank 1 never comes: step 0 stays pending
  int64_t key = 1;
  float grad[kDim] = {1, 1, 1, 1};
  auto pending = a->CommitAsync(0, &key, 1, grad);
  shard->BeginShutdown("SIGTERM");
  shard->BeginShutdown("a second reason");  // the first one stays
  // The attached rank was told (its pending commit fails with the notice).
  try {
    pending->Wait(DeadlineAfter(5));
    CHECK(false);
  } catch (const ShuttingDownError& e) {
    CHECK(NamesTheReason(e.what()));
  }
  // A client that was not attached opens after the drain began: the shard refuses it.
  try {
    auto late = Connect(shard, 0, 1, /*session=*/8);
    CHECK(false);
  } catch (const TransportError& e) {
    CHECK(NamesTheReason(e.what()));
  }
  a->Close(5);
}

// A drain from one thread while others open, read and commit: every kShuttingDown refusal
// any of them sees names the reason (the reason is in place before the drain flag is up).
TEST_CASE(drain_racing_requests_every_refusal_names_the_reason) {
  for (int round = 0; round < 20; ++round) {
    auto shard = MakeShard(0, 1);
    std::atomic<bool> go{false};
    std::atomic<int> refusals{0};
    std::atomic<int> unnamed{0};
    std::mutex mu;
    std::string first_unnamed;
    std::vector<std::thread> senders;
    for (uint64_t t = 0; t < 3; ++t) {
      senders.emplace_back([&, t] {
        while (!go.load()) std::this_thread::yield();
        for (int i = 0; i < 100000; ++i) {
          try {
            // A table of its own per session (a new job on a fresh table).
            std::string table = "t";
            table += std::to_string(t);
            table += '_';
            table += std::to_string(i);
            auto c = Connect(shard, 0, 1, /*session=*/100 + t * 1000 + i, table);
            int64_t key = static_cast<int64_t>(i);
            float grad[kDim] = {1, 2, 3, 4};
            float out[kDim];
            c->CommitAsync(0, &key, 1, grad)->Wait(DeadlineAfter(5));
            c->GetAsync(&key, 1, 0, out)->Wait(DeadlineAfter(5));
            c->Close(5);
          } catch (const std::exception& e) {
            ++refusals;
            if (!NamesTheReason(e.what())) {
              ++unnamed;
              std::lock_guard<std::mutex> lock(mu);
              if (first_unnamed.empty()) first_unnamed = e.what();
            }
            return;  // the shard drains (the only way a request here can fail)
          }
        }
      });
    }
    go = true;
    std::this_thread::sleep_for(std::chrono::microseconds(200 * (round % 5)));
    shard->BeginShutdown("SIGTERM");
    for (auto& s : senders) s.join();
    if (unnamed.load() != 0) {
      throw bagpipe::testing::CheckFailure("round " + std::to_string(round) + ": " +
                                           std::to_string(unnamed.load()) +
                                           " refusals without the reason, e.g. " + first_unnamed);
    }
    CHECK(refusals.load() > 0);
  }
}
