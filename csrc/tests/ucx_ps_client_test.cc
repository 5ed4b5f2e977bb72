// End-to-end tests of PSClient over the rdma (UCX) backend against map-based tables, with
// UCX over shared memory (frames written one-sided into the shard's ring) and over TCP
// (frames carried by their doorbells): equality with the reference SGD, slot reuse with more
// gets and commits in flight than slots, and the failure paths.
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "client/ps_client.h"
#include "common/errors.h"
#include "server/ucx_server.h"
#include "shard/ps_shard.h"
#include "tests/ps_client_test_util.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"
#include "transport/local_channel.h"
#include "transport/ucx_channel.h"

using namespace bagpipe;
using namespace bagpipe::client;
using namespace bagpipe::shard;
using bagpipe::testing::MapTable;

namespace {

using bagpipe::testing::Batch;
using bagpipe::testing::ChannelOpts;
using bagpipe::testing::MakeShard;
using bagpipe::testing::CheckRows;

constexpr uint32_t kDim = bagpipe::testing::kClientDim;
constexpr int64_t kKeys = 23;
const char* const kTlsList[] = {"sm", "tcp"};

ClientOptions Options(uint32_t rank, uint32_t world, uint32_t max_rows, uint32_t inflight) {
  return bagpipe::testing::ClientOpts(/*session=*/9, rank, world, max_rows, inflight);
}

Batch MakeBatch(int step, uint32_t rank, int max_rows = 9) {
  return bagpipe::testing::SeededBatch(step * 977 + rank * 13 + 1, max_rows, kKeys);
}

std::unique_ptr<MapTable> Reference(int steps, uint32_t world, int max_rows = 9) {
  return bagpipe::testing::ReferenceModel(
      steps, world, [max_rows](int t, uint32_t r) { return MakeBatch(t, r, max_rows); });
}

struct Env {
  explicit Env(const char* tls) { setenv("UCX_TLS", tls, 1); }
  ~Env() { unsetenv("UCX_TLS"); }
};

template <typename F>
void ForEachTls(F f) {
  for (const char* tls : kTlsList) {
    Env env(tls);
    try {
      f(std::string(tls));
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("[UCX_TLS=") + tls + "] " + e.what());
    }
  }
}

std::unique_ptr<server::UcxShardServer> Serve(const std::shared_ptr<PSShard>& s,
                                                 const std::string& token) {
  server::UcxServerOptions so;
  so.job_token = token;
  so.handshake_timeout = 5;
  return std::make_unique<server::UcxShardServer>(s, so);
}

}  // namespace

TEST_CASE(ucx_client_two_ranks_two_shards_equal_reference) {
  ForEachTls([](const std::string& tls) {
    const int steps = 30;
    std::vector<std::shared_ptr<PSShard>> shards{MakeShard(0, 2), MakeShard(1, 2)};
    auto srv0 = Serve(shards[0], "job");
    auto srv1 = Serve(shards[1], "job");
    std::vector<std::unique_ptr<PSClient>> clients;
    for (uint32_t r = 0; r < 2; ++r) {
      // Small packets and a window of 2: most steps need more packets than slots.
      auto o = Options(r, 2, 2, 2);
      std::vector<std::unique_ptr<transport::Channel>> chans;
      if (r == 0) {  // rank 0 hosts shard 0 in-process, like a trainer-hosted shard
        chans.push_back(std::make_unique<transport::LocalChannel>(shards[0], ChannelOpts(o)));
      } else {
        chans.push_back(transport::UcxChannel::Connect("127.0.0.1", srv0->port(), "job",
                                                       ChannelOpts(o), 10));
      }
      auto ch = transport::UcxChannel::Connect("127.0.0.1", srv1->port(), "job", ChannelOpts(o), 10);
      CHECK(ch->frame_mode() == (tls == "sm" ? transport::ucx::FrameMode::kPut
                                             : transport::ucx::FrameMode::kMessage));
      chans.push_back(std::move(ch));
      clients.push_back(std::make_unique<PSClient>(o, std::move(chans)));
    }
    auto run = [&](uint32_t rank) {
      for (int t = 0; t < steps; ++t) {
        auto b = MakeBatch(t, rank);
        clients[rank]->CommitAsync(t, b.keys.data(), b.keys.size(), b.grads.data())
            ->Wait(DeadlineAfter(20));
      }
    };
    std::thread t1([&] { run(1); });
    run(0);
    t1.join();
    auto ref = Reference(steps, 2);
    std::vector<int64_t> keys;
    for (int64_t k = 0; k < kKeys; ++k) keys.push_back(k);
    for (auto& c : clients) {
      std::vector<float> got(keys.size() * kDim);
      c->GetAsync(keys.data(), keys.size(), steps - 1, got.data())->Wait(DeadlineAfter(20));
      CheckRows(keys, got, *ref);
    }
    // Every shard heard from every rank every step (markers included).
    CHECK_EQ(shards[1]->GetTable("emb")->committed_step(), int64_t{steps - 1});
    for (auto& c : clients) c->Close(5);
    CHECK_EQ(shards[1]->GetTable("emb")->attached_ranks(), 0);
    // Every client left: draining returns as soon as the server noticed, not at its timeout.
    const auto t0 = Clock::now();
    srv0->Stop(30);
    srv1->Stop(30);
    CHECK(Clock::now() - t0 < std::chrono::seconds(10));
    CHECK_EQ(srv1->stats().accepted, uint64_t{2});
    CHECK_EQ(srv1->stats().closed_by_server, uint64_t{0});
  });
}

TEST_CASE(ucx_slot_reuse_under_pressure_stays_exact) {
  ForEachTls([](const std::string& tls) {
    (void)tls;
    const int steps = 12;
    const int rows = 40;  // one-row packets: up to 40 packets per step through 4 slots
    auto shard = MakeShard(0, 1);
    auto srv = Serve(shard, "job");
    auto o = Options(0, 1, 1, 4);
    std::vector<std::unique_ptr<transport::Channel>> chans;
    chans.push_back(transport::UcxChannel::Connect("127.0.0.1", srv->port(), "job", ChannelOpts(o), 10));
    auto* ucx_ch = static_cast<transport::UcxChannel*>(chans[0].get());
    PSClient client(o, std::move(chans));
    std::vector<int64_t> keys;
    for (int64_t k = 0; k < kKeys; ++k) keys.push_back(k);
    // Commits and reads of every step queued at once: far more requests than slots; each
    // read must see exactly the rows of its step (GET results are copied out of the slot's
    // reply before the slot is reused).
    std::vector<Batch> batches;
    for (int t = 0; t < steps; ++t) batches.push_back(MakeBatch(t, 0, rows));
    std::vector<std::vector<float>> outs(steps, std::vector<float>(keys.size() * kDim));
    std::vector<std::shared_ptr<ClientOp>> ops;
    for (int t = 0; t < steps; ++t) {
      ops.push_back(client.CommitAsync(t, batches[t].keys.data(), batches[t].keys.size(),
                                       batches[t].grads.data()));
      ops.push_back(client.GetAsync(keys.data(), keys.size(), t, outs[t].data()));
    }
    for (auto& op : ops) op->Wait(DeadlineAfter(30));
    for (int t = 0; t < steps; ++t) {
      auto ref = Reference(t + 1, 1, rows);
      CheckRows(keys, outs[t], *ref);
    }
    const auto cs = client.stats();
    CHECK(cs.slot_waits > 0);  // the window really was full
    CHECK(cs.packets > static_cast<uint64_t>(steps * 10));
    // Accounting: the endpoint wrote exactly the frames and bytes the channel posted.
    const auto es = ucx_ch->endpoint_stats();
    const auto chs = ucx_ch->stats();
    CHECK_EQ(es.frames, chs.frames_sent);
    CHECK(es.frames >= cs.packets);
    if (ucx_ch->frame_mode() == transport::ucx::FrameMode::kPut) {
      CHECK_EQ(es.puts, es.frames);
      CHECK_EQ(es.put_bytes, chs.bytes_sent);
      CHECK(es.doorbells <= es.flushes * 2);  // one doorbell per flush (entry batches <= 256)
      CHECK(es.flushes < es.frames);          // several writes per flush (every 2 here)
    }
    client.Close(5);
    srv->Stop(1);
  });
}

TEST_CASE(ucx_refuses_strangers_and_survives_malformed_frames) {
  ForEachTls([](const std::string& tls) {
    (void)tls;
    auto shard = MakeShard(0, 1);
    auto srv = Serve(shard, "secret");
    auto o = Options(0, 1, 3, 2);
    CHECK_THROWS(TransportError,
                 transport::UcxChannel::Connect("127.0.0.1", srv->port(), "other", ChannelOpts(o), 5));
    // A raw UCX peer that bootstraps correctly, then writes garbage into its slot: the shard
    // closes that connection (the peer sees it torn) and keeps serving others.
    {
      std::vector<uint8_t> slot(256, 0xAB);
      transport::ucx::ConnectOptions co;
      co.host = "127.0.0.1";
      co.port = srv->port();
      co.token = "secret";
      co.num_slots = 1;
      co.slot_bytes = slot.size();
      co.source_slots = {slot.data()};
      std::atomic<bool> failed{false};
      transport::ucx::EndpointHandlers h;
      h.on_failure = [&](const transport::ucx::Failure&) { failed = true; };
      auto ep = transport::ucx::Endpoint::Connect(co, h, DeadlineAfter(5));
      ep->PostPut(0, slot.size(), 1);
      ep->FlushAndRing();
      const auto t0 = Clock::now();
      while (!failed && Clock::now() - t0 < std::chrono::seconds(10)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      CHECK(failed.load());
      ep->Close();
    }
    std::vector<std::unique_ptr<transport::Channel>> c;
    c.push_back(transport::UcxChannel::Connect("127.0.0.1", srv->port(), "secret", ChannelOpts(o), 5));
    PSClient client(o, std::move(c));
    client.CommitAsync(0, nullptr, 0, nullptr)->Wait(DeadlineAfter(5));
    CHECK_EQ(client.CommittedStep(), int64_t{0});
    client.Close(5);
    srv->Stop(1);
    CHECK(srv->stats().closed_by_server >= 1);
    CHECK(srv->stats().refused >= 1);
  });
}

TEST_CASE(ucx_dead_shard_fails_pending_work_at_once) {
  ForEachTls([](const std::string& tls) {
    (void)tls;
    auto shard = MakeShard(0, 1);
    auto srv = Serve(shard, "");
    auto o = Options(0, 2, 3, 2);
    o.timeout = 30;
    std::vector<std::unique_ptr<transport::Channel>> c;
    c.push_back(transport::UcxChannel::Connect("127.0.0.1", srv->port(), "", ChannelOpts(o), 5));
    PSClient client(o, std::move(c));
    auto op = client.CommitAsync(0, nullptr, 0, nullptr);  // waits for rank 1 forever
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto t0 = Clock::now();
    srv->Stop(0);  // the shard goes away
    CHECK_THROWS(TransportError, op->Wait(DeadlineAfter(10)));
    CHECK(Clock::now() - t0 < std::chrono::seconds(5));  // not the 30 s timeout
    CHECK_THROWS(TransportError,
                 client.CommitAsync(1, nullptr, 0, nullptr)->Wait(DeadlineAfter(5)));
    client.Close(1);
  });
}
