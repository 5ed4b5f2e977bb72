// End-to-end tests of PSClient over the local and tcp transports against map-based tables.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "client/ps_client.h"
#include "common/errors.h"
#include "server/tcp_server.h"
#include "shard/ps_shard.h"
#include "tests/ps_client_test_util.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"
#include "transport/local_channel.h"
#include "transport/socket.h"
#include "transport/tcp_channel.h"

using namespace bagpipe;
using namespace bagpipe::client;
using namespace bagpipe::shard;
using bagpipe::testing::MapTable;

namespace {

using bagpipe::testing::Batch;
using bagpipe::testing::ChannelOpts;
using bagpipe::testing::MakeShard;

constexpr uint32_t kDim = bagpipe::testing::kClientDim;

ClientOptions Options(uint32_t rank, uint32_t world, uint32_t max_rows = 3, uint32_t inflight = 2) {
  return bagpipe::testing::ClientOpts(/*session=*/7, rank, world, max_rows, inflight);
}

// Deterministic per-(step, rank) gradients with duplicates and empty batches.
Batch MakeBatch(int step, uint32_t rank) {
  return bagpipe::testing::SeededBatch(step * 131 + rank, /*max_rows=*/9, /*num_keys=*/23);
}

std::unique_ptr<MapTable> Reference(int steps, uint32_t world) {
  return bagpipe::testing::ReferenceModel(steps, world, MakeBatch);
}

void RunRank(PSClient& client, int steps, uint32_t rank) {
  for (int t = 0; t < steps; ++t) {
    auto b = MakeBatch(t, rank);
    auto op = client.CommitAsync(t, b.keys.data(), b.keys.size(), b.grads.data());
    op->Wait(DeadlineAfter(20));
  }
}

void CheckEqualsReference(PSClient& client, int steps, uint32_t world) {
  auto ref = Reference(steps, world);
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 23; ++k) keys.push_back(k);
  std::vector<float> got(keys.size() * kDim);
  client.GetAsync(keys.data(), keys.size(), steps - 1, got.data())->Wait(DeadlineAfter(20));
  bagpipe::testing::CheckRows(keys, got, *ref);
}

}  // namespace

TEST_CASE(client_local_two_ranks_two_shards_equal_reference) {
  const int steps = 25;
  std::vector<std::shared_ptr<PSShard>> shards{MakeShard(0, 2), MakeShard(1, 2)};
  std::vector<std::unique_ptr<PSClient>> clients;
  for (uint32_t r = 0; r < 2; ++r) {
    auto o = Options(r, 2);
    std::vector<std::unique_ptr<transport::Channel>> chans;
    for (auto& s : shards) chans.push_back(std::make_unique<transport::LocalChannel>(s, ChannelOpts(o)));
    clients.push_back(std::make_unique<PSClient>(o, std::move(chans)));
  }
  std::thread t1([&] { RunRank(*clients[1], steps, 1); });
  RunRank(*clients[0], steps, 0);
  t1.join();
  CHECK_EQ(clients[0]->CommittedStep(), int64_t{steps - 1});
  CheckEqualsReference(*clients[0], steps, 2);
  const auto st = clients[0]->stats();
  CHECK(st.packets >= static_cast<uint64_t>(steps * 2));  // a marker per shard per step at least
  CHECK_EQ(st.slot_waits, uint64_t{0});  // local replies come back inside Post
  clients[0]->Close(5);
  clients[1]->Close(5);
  // Both ranks left cleanly: the session is over, the table stays.
  CHECK_EQ(shards[0]->GetTable("emb")->attached_ranks(), 0);
  CHECK_EQ(shards[0]->GetTable("emb")->committed_step(), int64_t{steps - 1});
}

TEST_CASE(client_get_waits_for_its_step_and_never_for_unsent_work) {
  auto shard = MakeShard(0, 1);
  auto o0 = Options(0, 2);
  auto o1 = Options(1, 2);
  std::vector<std::unique_ptr<transport::Channel>> c0, c1;
  c0.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o0)));
  c1.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o1)));
  PSClient a(o0, std::move(c0));
  PSClient b(o1, std::move(c1));
  int64_t key = 3;
  float grad[kDim] = {1, 2, 3, 4};
  auto commit_a = a.CommitAsync(0, &key, 1, grad);
  float out[kDim];
  auto get = a.GetAsync(&key, 1, 0, out);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!get->Done());  // step 0 needs rank 1
  CHECK(!commit_a->Done());
  auto commit_b = b.CommitAsync(0, nullptr, 0, nullptr);
  get->Wait(DeadlineAfter(5));
  commit_a->Wait(DeadlineAfter(5));
  commit_b->Wait(DeadlineAfter(5));
  for (uint32_t c = 0; c < kDim; ++c) {
    float u = grad[c] / 2.0f;
    u = u * 0.125f;
    CHECK(out[c] == 0.5f + 3e-3f + static_cast<float>(c) * 1e-4f - u);
  }
  // Key bound and step checks are synchronous ValueErrors.
  CHECK_THROWS(ValueError, a.CommitAsync(-1, nullptr, 0, nullptr));
}

TEST_CASE(client_get_of_a_step_never_submitted_times_out) {
  auto shard = MakeShard(0, 1);
  auto o = Options(0, 1);
  o.timeout = 0.3;
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o)));
  PSClient client(o, std::move(c));
  int64_t key = 1;
  float out[kDim];
  auto get = client.GetAsync(&key, 1, 5, out);
  CHECK_THROWS(TimeoutError, get->Wait(DeadlineAfter(5)));
  try {
    get->Wait(DeadlineAfter(1));
  } catch (const TimeoutError& e) {
    CHECK(std::string(e.what()).find("must follow the commit") != std::string::npos);
  }
}

TEST_CASE(client_out_of_order_step_is_a_session_error) {
  auto shard = MakeShard(0, 1);
  auto o = Options(0, 1);
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o)));
  PSClient client(o, std::move(c));
  auto op = client.CommitAsync(3, nullptr, 0, nullptr);
  CHECK_THROWS(SessionError, op->Wait(DeadlineAfter(5)));
  // Sticky: every later operation fails with the session's error.
  CHECK_THROWS(SessionError, client.CommitAsync(0, nullptr, 0, nullptr)->Wait(DeadlineAfter(5)));
  client.Close(5);  // a failed client still closes without raising
}

TEST_CASE(client_open_refusal_names_the_field) {
  auto shard = MakeShard(0, 1);
  auto o = Options(0, 2);
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o)));
  PSClient first(o, std::move(c));
  auto o2 = Options(1, 2);
  o2.world_size = 3;
  std::vector<std::unique_ptr<transport::Channel>> c2;
  c2.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o2)));
  try {
    PSClient second(o2, std::move(c2));
    throw bagpipe::testing::CheckFailure("open with another world_size was accepted");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()).find("world_size") != std::string::npos);
  }
  // Another optimizer than the table holds: refused at open, naming the table.
  auto o3 = Options(1, 2);
  o3.optimizer.kind = store::OptimizerKind::kAdam;
  std::vector<std::unique_ptr<transport::Channel>> c3;
  c3.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o3)));
  try {
    PSClient third(o3, std::move(c3));
    throw bagpipe::testing::CheckFailure("open with another optimizer was accepted");
  } catch (const ValueError& e) {
    const std::string what = e.what();
    CHECK(what.find("optimizer.kind") != std::string::npos);
    CHECK(what.find("'emb'") != std::string::npos);
  }
}

TEST_CASE(client_tcp_and_mixed_transports_equal_reference) {
  const int steps = 20;
  std::vector<std::shared_ptr<PSShard>> shards{MakeShard(0, 2), MakeShard(1, 2)};
  server::TcpServerOptions so;
  so.job_token = "job-a";
  server::TcpShardServer srv0(shards[0], so), srv1(shards[1], so);
  std::vector<std::unique_ptr<PSClient>> clients;
  for (uint32_t r = 0; r < 2; ++r) {
    auto o = Options(r, 2, 2, 3);
    std::vector<std::unique_ptr<transport::Channel>> chans;
    // Rank 0 hosts shard 0 in-process; everything else goes over loopback TCP.
    if (r == 0) {
      chans.push_back(std::make_unique<transport::LocalChannel>(shards[0], ChannelOpts(o)));
    } else {
      chans.push_back(transport::TcpChannel::Connect("127.0.0.1", srv0.port(), "job-a", ChannelOpts(o), 5));
    }
    chans.push_back(transport::TcpChannel::Connect("127.0.0.1", srv1.port(), "job-a", ChannelOpts(o), 5));
    clients.push_back(std::make_unique<PSClient>(o, std::move(chans)));
  }
  std::thread t1([&] { RunRank(*clients[1], steps, 1); });
  RunRank(*clients[0], steps, 0);
  t1.join();
  CheckEqualsReference(*clients[1], steps, 2);
  for (auto& c : clients) c->Close(5);
  srv0.Stop(1);
  srv1.Stop(1);
  CHECK_EQ(srv1.stats().accepted, uint64_t{2});
}

TEST_CASE(tcp_refuses_strangers_and_survives_garbage) {
  auto shard = MakeShard(0, 1);
  server::TcpServerOptions so;
  so.job_token = "secret";
  server::TcpShardServer srv(shard, so);
  auto o = Options(0, 1);
  CHECK_THROWS(TransportError, transport::TcpChannel::Connect("127.0.0.1", srv.port(), "other", ChannelOpts(o), 5));
  // Raw garbage, then a truncated frame, then silence are all dropped.
  for (int i = 0; i < 3; ++i) {
    int fd = transport::ConnectTcp("127.0.0.1", srv.port(), DeadlineAfter(5)).Release();
    std::vector<uint8_t> junk(i == 0 ? 100 : 20, static_cast<uint8_t>(0xAB + i));
    if (i < 2) transport::WriteAll(fd, junk.data(), junk.size(), "srv");
    if (i == 1) ::shutdown(fd, SHUT_WR);
    ::close(fd);
  }
  // A frame of another protocol version is answered with an error naming the version, even
  // though its body is never read, and then the connection is closed.
  {
    int fd = transport::ConnectTcp("127.0.0.1", srv.port(), DeadlineAfter(5)).Release();
    std::vector<uint8_t> frame(protocol::wire::kHeaderBytes + 5000, 0x11);
    auto h = protocol::wire::MakeHeader(protocol::wire::MsgType::kHello, 0, 5000);
    h.version = protocol::wire::kProtocolVersion + 1;
    protocol::wire::StoreHeader(frame.data(), h);
    transport::WriteAll(fd, frame.data(), frame.size(), "srv");
    transport::SetRecvTimeout(fd, 5);
    uint8_t hb[protocol::wire::kHeaderBytes];
    CHECK(transport::ReadFull(fd, hb, sizeof(hb), false, "srv"));
    const auto reply = protocol::wire::LoadHeader(hb);
    CHECK(reply.type == static_cast<uint16_t>(protocol::wire::MsgType::kError));
    std::string body(reply.body_len, '\0');
    transport::ReadFull(fd, body.data(), body.size(), false, "srv");
    const std::string want =
        "protocol version " + std::to_string(protocol::wire::kProtocolVersion + 1) + " is not supported";
    CHECK(body.find(want) != std::string::npos);
    CHECK(!transport::ReadFull(fd, hb, 1, true, "srv"));  // then EOF
    ::close(fd);
  }
  // A well-formed client is still served.
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(transport::TcpChannel::Connect("127.0.0.1", srv.port(), "secret", ChannelOpts(o), 5));
  PSClient client(o, std::move(c));
  client.CommitAsync(0, nullptr, 0, nullptr)->Wait(DeadlineAfter(5));
  CHECK_EQ(client.CommittedStep(), int64_t{0});
  client.Close(5);
  srv.Stop(1);
  CHECK(srv.stats().closed_by_server >= 2);
}

TEST_CASE(tcp_dead_shard_fails_pending_work_at_once) {
  auto shard = MakeShard(0, 1);
  server::TcpServerOptions so;
  auto srv = std::make_unique<server::TcpShardServer>(shard, so);
  auto o = Options(0, 2);
  o.timeout = 30;
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(transport::TcpChannel::Connect("127.0.0.1", srv->port(), "", ChannelOpts(o), 5));
  PSClient client(o, std::move(c));
  auto op = client.CommitAsync(0, nullptr, 0, nullptr);  // waits for rank 1 forever
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = Clock::now();
  srv->Stop(0);  // the shard goes away
  CHECK_THROWS(TransportError, op->Wait(DeadlineAfter(10)));
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));  // not the 30 s timeout
  CHECK_THROWS(TransportError, client.CommitAsync(1, nullptr, 0, nullptr)->Wait(DeadlineAfter(5)));
  client.Close(1);
}

TEST_CASE(client_commit_ready_hook_runs_on_the_worker_before_staging) {
  auto shard = MakeShard(0, 1);
  auto o = Options(0, 1);
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(std::make_unique<transport::LocalChannel>(shard, ChannelOpts(o)));
  PSClient client(o, std::move(c));
  int64_t key = 2;
  float grad[kDim] = {0, 0, 0, 0};
  std::thread::id ran_on;
  // The "producer" fills the gradient only inside the hook: the worker must read it after.
  client.CommitAsync(0, &key, 1, grad, [&] {
    ran_on = std::this_thread::get_id();
    for (float& g : grad) g = 8.0f;
  })->Wait(DeadlineAfter(5));
  CHECK(ran_on != std::this_thread::get_id());
  float out[kDim];
  client.GetAsync(&key, 1, 0, out)->Wait(DeadlineAfter(5));
  CHECK(out[0] == 0.5f + 2e-3f - 1.0f);
  auto failing = client.CommitAsync(1, nullptr, 0, nullptr, [] { throw ValueError("event failed"); });
  CHECK_THROWS(ValueError, failing->Wait(DeadlineAfter(5)));
}

// A TCP "shard" that answers Hello and Open, then either never answers anything else
// (hang) or closes the connection (die_after_open).
class FakeShard {
 public:
  FakeShard(uint32_t shard_id, uint32_t num_shards, bool die_after_open)
      : lfd_(transport::ListenTcp("127.0.0.1", 0, 4, &port_)) {
    thread_ = std::thread([=, this] { Serve(shard_id, num_shards, die_after_open); });
  }
  ~FakeShard() {
    thread_.join();
    ::close(lfd_);
  }
  uint16_t port() const { return port_; }

 private:
  void Serve(uint32_t shard_id, uint32_t num_shards, bool die_after_open) {
    const int fd = ::accept(lfd_, nullptr, nullptr);
    auto reply = [&](protocol::wire::MsgType type, const void* body, size_t len, uint64_t tag,
                     uint32_t slot) {
      std::vector<uint8_t> f(protocol::wire::kHeaderBytes + len);
      protocol::wire::StoreHeader(f.data(), protocol::wire::MakeHeader(type, protocol::wire::TokenDigest(""),
                                                                   len, protocol::wire::Status::kOk,
                                                                   tag, slot));
      std::memcpy(f.data() + protocol::wire::kHeaderBytes, body, len);
      transport::WriteAll(fd, f.data(), f.size(), "fake");
    };
    try {
      for (;;) {
        uint8_t hb[protocol::wire::kHeaderBytes];
        if (!transport::ReadFull(fd, hb, sizeof(hb), true, "fake")) break;
        const auto h = protocol::wire::LoadHeader(hb);
        std::vector<uint8_t> body(h.body_len);
        transport::ReadFull(fd, body.data(), body.size(), false, "fake");
        if (h.type == static_cast<uint16_t>(protocol::wire::MsgType::kHello)) {
          protocol::wire::HelloOkBody ok{shard_id, num_shards, protocol::wire::kDefaultMaxFrameBytes, 1};
          reply(protocol::wire::MsgType::kHelloOk, &ok, sizeof(ok), h.tag, h.slot);
        } else if (h.type == static_cast<uint16_t>(protocol::wire::MsgType::kOpen)) {
          protocol::wire::OpenOkBody ok{-1, kDim, 0};
          reply(protocol::wire::MsgType::kOpenOk, &ok, sizeof(ok), h.tag, h.slot);
        } else if (die_after_open) {
          break;
        }
      }
    } catch (const std::exception&) {
    }
    ::close(fd);
  }

  uint16_t port_ = 0;
  int lfd_;
  std::thread thread_;
};

TEST_CASE(client_close_is_bounded_when_a_shard_hangs) {
  FakeShard fake(0, 1, /*die_after_open=*/false);
  auto o = Options(0, 1, /*max_rows=*/1, /*inflight=*/1);
  o.timeout = 30;  // far longer than the Close below
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(transport::TcpChannel::Connect("127.0.0.1", fake.port(), "", ChannelOpts(o), 5));
  auto client = std::make_unique<PSClient>(o, std::move(c));
  std::vector<int64_t> keys{1, 2, 3};
  std::vector<float> grads(3 * kDim, 1.0f);
  auto op = client->CommitAsync(0, keys.data(), keys.size(), grads.data());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the worker waits for a slot
  const auto t0 = Clock::now();
  bool timed_out = false;
  try {
    client->Close(0.3);
  } catch (const TimeoutError&) {
    timed_out = true;
  }
  const bool prompt = Clock::now() - t0 < std::chrono::seconds(5);
  bool failed_fast = false;  // the commit ends with the closed connection, not a timeout
  try {
    op->Wait(DeadlineAfter(1));
  } catch (const TransportError&) {
    failed_fast = true;
  } catch (const SessionError&) {
    failed_fast = true;
  }
  client.reset();
  CHECK(timed_out);
  CHECK(prompt);
  CHECK(failed_fast);
}

TEST_CASE(client_failure_stops_a_worker_blocked_on_another_shard) {
  FakeShard dies(0, 2, /*die_after_open=*/true);
  FakeShard hangs(1, 2, /*die_after_open=*/false);
  auto o = Options(0, 1, /*max_rows=*/1, /*inflight=*/1);
  o.partition = protocol::PartitionKind::kModulo;
  o.timeout = 30;
  std::vector<std::unique_ptr<transport::Channel>> c;
  c.push_back(transport::TcpChannel::Connect("127.0.0.1", dies.port(), "", ChannelOpts(o), 5));
  c.push_back(transport::TcpChannel::Connect("127.0.0.1", hangs.port(), "", ChannelOpts(o), 5));
  auto client = std::make_unique<PSClient>(o, std::move(c));
  // Odd keys go to the hanging shard: the worker blocks on its one-slot window, then shard 0
  // dies (it closes on the first chunk) and the client fails.
  std::vector<int64_t> keys{1, 3, 5, 0};
  std::vector<float> grads(4 * kDim, 1.0f);
  auto op = client->CommitAsync(0, keys.data(), keys.size(), grads.data());
  const auto t0 = Clock::now();
  CHECK_THROWS(TransportError, op->Wait(DeadlineAfter(10)));
  client->Close(30);  // a failed client: no error, and no 30 s wait for the hung shard
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));
  client.reset();
}
