// Unit tests of the UCX layer (ucx_context / ucx_memory / ucx_endpoint / ucx_acceptor) over
// shared memory and over TCP: one-sided writes into the registered slot ring, flush +
// doorbell ordering, eager and rendezvous replies landing in caller buffers, and the error
// paths (unreachable peer, torn connection, remote-key mismatch, refused bootstrap).
//
// The test protocol on top of the layer: a client frame is {u64 id, u32 reply_len, u32 fill}
// followed by filler; the server answers with head {u64 id, u64 frame_len, u64 checksum}
// and reply_len payload bytes of Pattern(id, i).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "tests/test_harness.h"
#include "server/ucx_acceptor.h"
#include "transport/ucx_endpoint.h"

namespace bagpipe::transport::ucx {
namespace {

using namespace std::chrono_literals;

const char* const kTls[] = {"sm", "tcp"};
// Whether EchoServer drives its endpoints from a shared ProgressPool (set by ForEachTls).
bool g_shared_progress = false;
const char* const kToken = "test-token";

uint8_t Pattern(uint64_t id, size_t i) { return static_cast<uint8_t>((id * 131 + i * 7) & 0xff); }

uint64_t Checksum(const uint8_t* p, size_t n) { return KeyDigest(p, n); }

struct FrameHead {
  uint64_t id;
  uint32_t reply_len;
  uint32_t fill;
};
// A frame whose fill is this makes EchoServer send a notice from another thread first.
constexpr uint32_t kCrossThreadFill = 0xC0550001u;
constexpr uint64_t kNoticeOffset = 1000000;
struct ReplyHead {
  uint64_t id;
  uint64_t frame_len;
  uint64_t checksum;
};

// A shard-side echo server: every ring frame gets one reply message.
class EchoServer {
 public:
  explicit EchoServer(const std::string& tls, BootFault fault = BootFault::kNone,
                      size_t max_ring_bytes = size_t{1} << 30) {
    server::UcxAcceptorOptions o;
    o.config.tls = tls;
    o.limits.fault = fault;
    o.limits.max_ring_bytes = max_ring_bytes;
    o.handshake_timeout = 5;
    if (g_shared_progress) o.limits.progress = std::make_shared<ProgressPool>(1);
    acceptor_ = std::make_unique<server::UcxAcceptor>(
        o, [](const std::string& t, std::string*) { return t == kToken; },
        [this](const std::shared_ptr<Endpoint>& ep) { return Attach(ep); });
  }
  ~EchoServer() {
    acceptor_->Stop();
    std::vector<std::shared_ptr<Endpoint>> eps;
    {
      std::lock_guard<std::mutex> lock(mu_);
      eps.swap(endpoints_);
    }
    for (auto& e : eps) e->Close();
  }
  uint16_t port() const { return acceptor_->port(); }
  server::UcxAcceptor& acceptor() { return *acceptor_; }

  // Waits until n connections are attached; returns them.
  std::vector<std::shared_ptr<Endpoint>> WaitEndpoints(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    CHECK(cv_.wait_for(lock, 10s, [&] { return endpoints_.size() >= n; }));
    return endpoints_;
  }
  std::vector<Failure> Failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  bool WaitFailures(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return failures_.size() >= n; });
  }
  uint64_t frames() const { return frames_.load(); }

 private:
  EndpointHandlers Attach(const std::shared_ptr<Endpoint>& ep) {
    std::weak_ptr<Endpoint> weak = ep;
    {
      std::lock_guard<std::mutex> lock(mu_);
      endpoints_.push_back(ep);
      cv_.notify_all();
    }
    EndpointHandlers h;
    h.on_ring_frame = [this, weak](const RingFrame& f) {
      auto self = weak.lock();
      if (!self) return;
      FrameHead fh;
      std::memcpy(&fh, f.data, sizeof(fh));
      frames_.fetch_add(1);
      // The doorbell's tag is the frame id: the write landed before its doorbell.
      if (fh.id != f.tag) {
        self->Fail("frame in slot does not match its doorbell");
        return;
      }
      if (fh.fill == kCrossThreadFill) {
        // Another thread sends notice id + kNoticeOffset first, and its SendMessage returns
        // (queued: this progress thread is busy here) before this reply is sent.
        std::thread other([&] {
          ReplyHead nh{fh.id + kNoticeOffset, 0, 0};
          self->SendMessage(&nh, sizeof(nh), nullptr, 0, [](bool) {});
        });
        other.join();
      }
      ReplyHead rh{fh.id, f.len, Checksum(f.data, f.len)};
      auto payload = std::make_shared<std::vector<uint8_t>>(fh.reply_len);
      for (size_t i = 0; i < payload->size(); ++i) (*payload)[i] = Pattern(fh.id, i);
      self->SendMessage(&rh, sizeof(rh), payload->data(), payload->size(),
                      [payload](bool) {});
    };
    h.on_failure = [this](const Failure& f) {
      std::lock_guard<std::mutex> lock(mu_);
      failures_.push_back(f);
      cv_.notify_all();
    };
    return h;
  }

  std::unique_ptr<server::UcxAcceptor> acceptor_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Endpoint>> endpoints_;
  std::vector<Failure> failures_;
  std::atomic<uint64_t> frames_{0};
};

// A client with its own slot buffers and a reply book-keeping table.
class TestClient {
 public:
  TestClient(const std::string& tls, uint16_t port, uint32_t slots, size_t slot_bytes,
             const std::string& token = kToken, double timeout = 5.0)
      : slot_bytes_(slot_bytes), buffers_(slots, std::vector<uint8_t>(slot_bytes)) {
    ConnectOptions o;
    o.host = "127.0.0.1";
    o.port = port;
    o.token = token;
    o.config.tls = tls;
    o.num_slots = slots;
    o.slot_bytes = slot_bytes;
    for (auto& b : buffers_) o.source_slots.push_back(b.data());
    EndpointHandlers h;
    h.on_message = [this](const uint8_t* head, size_t len, size_t payload_len) {
      Landing l;
      CHECK_EQ(len, sizeof(ReplyHead));
      ReplyHead rh;
      std::memcpy(&rh, head, sizeof(rh));
      auto out = std::make_shared<std::vector<uint8_t>>(payload_len);
      l.dst = out->data();
      l.done = [this, rh, out](bool ok) {
        std::lock_guard<std::mutex> lock(mu_);
        order_.push_back(rh.id);
        replies_[rh.id] = {rh, ok, std::move(*out)};
        cv_.notify_all();
      };
      return l;
    };
    h.on_failure = [this](const Failure& f) {
      std::lock_guard<std::mutex> lock(mu_);
      failure_ = f;
      failed_ = true;
      cv_.notify_all();
    };
    ep_ = Endpoint::Connect(o, std::move(h), DeadlineAfter(timeout));
  }
  ~TestClient() {
    if (ep_) ep_->Close();
  }

  // Stages frame `id` into `slot` and posts it (no flush).
  size_t Stage(uint32_t slot, uint64_t id, uint32_t reply_len, size_t frame_len,
               uint32_t fill = 0) {
    auto& b = buffers_[slot];
    FrameHead fh{id, reply_len, fill};
    std::memcpy(b.data(), &fh, sizeof(fh));
    for (size_t i = sizeof(fh); i < frame_len; ++i) b[i] = static_cast<uint8_t>(id + i);
    sent_[id] = Checksum(b.data(), frame_len);
    ep_->PostPut(slot, frame_len, id);
    return frame_len;
  }
  bool WaitReply(uint64_t id, std::chrono::milliseconds t = 10s) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool ok = cv_.wait_for(lock, t, [&] { return replies_.count(id) != 0 || failed_; }) &&
                    replies_.count(id) != 0;
    return ok;
  }
  bool WaitFailure(std::chrono::milliseconds t = 10s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, t, [&] { return failed_; });
  }
  void CheckReply(uint64_t id, size_t frame_len, uint32_t reply_len) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& r = replies_.at(id);
    CHECK(r.ok);
    CHECK_EQ(r.head.frame_len, frame_len);
    CHECK_EQ(r.head.checksum, sent_.at(id));
    CHECK_EQ(r.payload.size(), size_t{reply_len});
    for (size_t i = 0; i < r.payload.size(); ++i) {
      if (r.payload[i] != Pattern(id, i)) CHECK_EQ(int(r.payload[i]), int(Pattern(id, i)));
    }
  }
  std::vector<uint64_t> Order() {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }
  Failure failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  Endpoint& ep() { return *ep_; }
  size_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Reply {
    ReplyHead head;
    bool ok;
    std::vector<uint8_t> payload;
  };
  const size_t slot_bytes_;
  std::vector<std::vector<uint8_t>> buffers_;
  std::shared_ptr<Endpoint> ep_;
  std::map<uint64_t, uint64_t> sent_;  // id -> checksum (test thread only)
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Reply> replies_;
  std::vector<uint64_t> order_;
  bool failed_ = false;
  Failure failure_;
};

template <typename F>
void ForEachTls(F f) {
  for (const char* tls : kTls) {
    // Shard endpoints with a progress thread each, then driven by a shared ProgressGroup.
    for (const bool shared : {false, true}) {
      g_shared_progress = shared;
      try {
        f(std::string(tls));
      } catch (const std::exception& e) {
        g_shared_progress = false;
        throw std::runtime_error(std::string("[UCX_TLS=") + tls + (shared ? ", shared progress" : "") +
                                 "] " + e.what());
      }
    }
  }
  g_shared_progress = false;
}

}  // namespace

TEST_CASE(ucx_context_and_registration) {
  ForEachTls([](const std::string& tls) {
    UcxConfig c{tls, ""};
    auto a = Context::Get(c);
    auto b = Context::Get(c);
    CHECK(a.get() == b.get());  // one context per configuration
    auto r = Region::Allocate(a, 1000);
    CHECK(r->size() >= 1000);
    CHECK_EQ(int(r->data()[999]), 0);
    auto key = r->PackKey();
    CHECK(!key.empty());
    CHECK_EQ(KeyDigest(key.data(), key.size()), KeyDigest(key.data(), key.size()));
    std::vector<uint8_t> mine(4096);
    auto att = Region::Attach(a, mine.data(), mine.size());
    CHECK(att->data() == mine.data());
    CHECK_THROWS(ValueError, Region::Attach(a, nullptr, 0));
  });
  CHECK_THROWS(TransportError, Context::Get(UcxConfig{"no_such_transport", ""}));
}

TEST_CASE(ucx_frames_land_in_ring_and_replies_in_order) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    const uint32_t slots = 4;
    TestClient client(tls, server.port(), slots, 64 * 1024);
    CHECK(client.ep().num_slots() == slots);
    // Several writes in flight before one flush + doorbell; replies small (eager) and large
    // (rendezvous into the landing buffer).
    const uint32_t reply_lens[] = {0, 100, 200000, 3 << 20, 17, 65536, 1 << 20, 5};
    uint64_t id = 1;
    std::vector<uint64_t> expect;
    std::map<uint64_t, std::pair<size_t, uint32_t>> shapes;
    for (int round = 0; round < 6; ++round) {
      std::vector<uint64_t> ids;
      for (uint32_t s = 0; s < slots; ++s, ++id) {
        const uint32_t rl = reply_lens[id % 8];
        const size_t fl = 16 + (id * 977) % (client.slot_bytes() - 16);
        client.Stage(s, id, rl, fl);
        shapes[id] = {fl, rl};
        ids.push_back(id);
        expect.push_back(id);
      }
      client.ep().FlushAndRing();
      for (uint64_t i : ids) CHECK(client.WaitReply(i));
    }
    for (auto& [i, shape] : shapes) client.CheckReply(i, shape.first, shape.second);
    CHECK(client.Order() == expect);  // replies delivered in send order
    const auto st = client.ep().stats();
    CHECK_EQ(st.frames, uint64_t{24});
    if (tls == "sm") {
      // Shared memory has native RMA (CMA): one-sided writes, one flush + doorbell per round.
      CHECK(client.ep().frame_mode() == FrameMode::kPut);
      CHECK_EQ(st.puts, uint64_t{24});
      CHECK_EQ(st.flushes, uint64_t{6});
      CHECK_EQ(st.doorbells, uint64_t{6});
    } else {
      // TCP has none: each frame is its own doorbell's payload.
      CHECK(client.ep().frame_mode() == FrameMode::kMessage);
      CHECK_EQ(st.puts, uint64_t{0});
      CHECK_EQ(st.flushes, uint64_t{0});
      CHECK_EQ(st.doorbells, uint64_t{24});
    }
    CHECK_EQ(st.messages_received, uint64_t{24});
    CHECK(st.rendezvous_receives > 0);
    CHECK_EQ(server.frames(), uint64_t{24});
    auto eps = server.WaitEndpoints(1);
    CHECK_EQ(eps[0]->stats().ring_frames, uint64_t{24});
  });
}

// A shard handler (on the progress thread) that answers right after another thread sent a
// notice must not overtake it: messages leave in SendMessage call order across threads (a
// drain notice, then the refusal of a request that saw the drain).
TEST_CASE(ucx_sends_from_several_threads_keep_call_order) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    TestClient client(tls, server.port(), 2, 4096);
    std::vector<uint64_t> expect;
    for (uint64_t id = 1; id <= 6; ++id) {
      client.Stage(static_cast<uint32_t>(id % 2), id, id % 3 == 0 ? 100000 : 8, 64,
                   id % 2 ? kCrossThreadFill : 0);
      client.ep().FlushAndRing();
      CHECK(client.WaitReply(id));
      if (id % 2) expect.push_back(id + kNoticeOffset);
      expect.push_back(id);
    }
    CHECK(client.Order() == expect);
  });
}

TEST_CASE(ucx_pipelined_flushes_keep_post_order) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    const uint32_t slots = 8;
    TestClient client(tls, server.port(), slots, 4096);
    // One flush per frame, all eight in flight at once: doorbells must still arrive in order.
    for (uint32_t s = 0; s < slots; ++s) {
      client.Stage(s, 100 + s, 8, 64);
      client.ep().FlushAndRing();
    }
    for (uint32_t s = 0; s < slots; ++s) CHECK(client.WaitReply(100 + s));
    std::vector<uint64_t> expect;
    for (uint32_t s = 0; s < slots; ++s) expect.push_back(100 + s);
    CHECK(client.Order() == expect);
    CHECK_EQ(client.ep().stats().doorbells, uint64_t{8});
    // A flush with nothing posted sends no doorbell.
    client.ep().FlushAndRing();
    client.Stage(0, 200, 1, 64);
    client.ep().FlushAndRing();
    CHECK(client.WaitReply(200));
    CHECK_EQ(client.ep().stats().doorbells, uint64_t{9});
    CHECK_EQ(client.ep().stats().flushes, uint64_t{tls == "sm" ? 9u : 0u});
  });
}

TEST_CASE(ucx_put_bounds_are_checked) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    TestClient client(tls, server.port(), 2, 256);
    CHECK_THROWS(ValueError, client.ep().PostPut(2, 16, 1));
    CHECK_THROWS(ValueError, client.ep().PostPut(0, 257, 1));
    CHECK_THROWS(ValueError, client.ep().PostPut(0, 0, 1));
  });
}

TEST_CASE(ucx_unreachable_peer_fails_within_timeout) {
  ForEachTls([](const std::string& tls) {
    // Nothing listens: refused at once.
    uint16_t dead_port;
    {
      Listener l("127.0.0.1", 0);
      dead_port = l.port();
    }
    const auto t0 = Clock::now();
    CHECK_THROWS(TransportError, TestClient(tls, dead_port, 2, 256, kToken, 5.0));
    CHECK(Clock::now() - t0 < 4s);
    // Something listens but never answers the bootstrap: TimeoutError at the deadline.
    Listener mute("127.0.0.1", 0);
    const auto t1 = Clock::now();
    CHECK_THROWS(TimeoutError, TestClient(tls, mute.port(), 2, 256, kToken, 0.5));
    const auto took = Clock::now() - t1;
    CHECK(took >= 400ms);
    CHECK(took < 4s);
  });
}

TEST_CASE(ucx_wrong_token_and_oversized_ring_are_refused) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls, BootFault::kNone, /*max_ring_bytes=*/1 << 20);
    try {
      TestClient c(tls, server.port(), 2, 256, "not-the-token");
      CHECK(false);
    } catch (const TransportError& e) {
      CHECK(std::string(e.what()).find("unauthorized") != std::string::npos);
    }
    try {
      TestClient c(tls, server.port(), 64, 1 << 20);
      CHECK(false);
    } catch (const TransportError& e) {
      CHECK(std::string(e.what()).find("too large") != std::string::npos);
    }
    // Garbage on the control port is refused and the shard still serves a good client.
    {
      Socket s = ConnectTcp("127.0.0.1", server.port(), DeadlineAfter(2));
      SetNonBlocking(s.fd(), true);
      std::vector<uint8_t> junk(200, 0xab);
      SendAll(s.fd(), junk.data(), junk.size(), DeadlineAfter(2), "test");
      uint8_t buf[64];
      RecvAll(s.fd(), buf, sizeof(buf), DeadlineAfter(5), "test");
      wire::BootReply r;
      std::memcpy(&r, buf, sizeof(r));
      CHECK_EQ(r.status, int32_t(wire::BootStatus::kBadRequest));
    }
    TestClient good(tls, server.port(), 2, 256);
    good.Stage(0, 7, 10, 64);
    good.ep().FlushAndRing();
    CHECK(good.WaitReply(7));
    good.CheckReply(7, 64, 10);
    CHECK(server.acceptor().refused() >= 3);
  });
}

TEST_CASE(ucx_remote_key_mismatch_is_detected) {
  ForEachTls([](const std::string& tls) {
    for (BootFault f : {BootFault::kWrongKey, BootFault::kCorruptKey, BootFault::kWrongRingId}) {
      EchoServer server(tls, f);
      // A corrupted key is caught by its digest, before UCX ever unpacks it. A well-formed key
      // of another region, or a ring id that does not match, is caught by reading the ring
      // header back one-sided: in put mode (shared memory here, RC verbs on a fabric). In
      // message mode (TCP) the key is never used, so the connection is sound and must work.
      const bool expect_error = f == BootFault::kCorruptKey || tls == "sm";
      try {
        TestClient c(tls, server.port(), 2, 256);
        CHECK(!expect_error);
        CHECK(c.ep().frame_mode() == FrameMode::kMessage);
        c.Stage(1, 5, 3, 100);
        c.ep().FlushAndRing();
        CHECK(c.WaitReply(5));
        c.CheckReply(5, 100, 3);
      } catch (const TransportError& e) {
        const std::string what = e.what();
        if (!expect_error || what.find("remote key mismatch") == std::string::npos) {
          throw std::runtime_error("unexpected error for fault " + std::to_string(int(f)) +
                                   ": " + what);
        }
      }
    }
  });
}

TEST_CASE(ucx_torn_connection_fails_both_sides) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    TestClient client(tls, server.port(), 2, 4096);
    client.Stage(0, 1, 10, 64);
    client.ep().FlushAndRing();
    CHECK(client.WaitReply(1));
    // The shard side vanishes without a goodbye (a crashed shard process).
    auto eps = server.WaitEndpoints(1);
    eps[0]->Close(/*graceful=*/false);
    const auto t0 = Clock::now();
    CHECK(client.WaitFailure(5s));
    CHECK(Clock::now() - t0 < 5s);
    CHECK(client.failure().message.find("torn") != std::string::npos);
    CHECK(!client.failure().peer_closed);
    CHECK_THROWS(TransportError, client.ep().PostPut(1, 64, 2));
    CHECK_THROWS(TransportError, client.ep().FlushAndRing());
  });
}

TEST_CASE(ucx_a_failed_endpoint_tells_its_peer_before_it_is_closed) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    TestClient client(tls, server.port(), 2, 4096);
    client.Stage(0, 1, 10, 64);
    client.ep().FlushAndRing();
    CHECK(client.WaitReply(1));
    // The shard gives up on the connection (a protocol violation, a failed send) but its
    // owner has not closed the endpoint yet: the client must learn of it now, from the
    // control connection, whatever UCX itself reports (shared memory reports nothing).
    auto eps = server.WaitEndpoints(1);
    eps[0]->Fail("test: the shard gives up on this connection");
    CHECK(client.WaitFailure(5s));
    CHECK(client.failure().message.find("torn") != std::string::npos);
    CHECK(!client.failure().peer_closed);
  });
}

TEST_CASE(ucx_graceful_close_is_reported_as_such) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    {
      TestClient client(tls, server.port(), 2, 4096);
      client.Stage(0, 1, 3 << 20, 64);
      client.ep().FlushAndRing();
      CHECK(client.WaitReply(1));
      client.CheckReply(1, 64, 3 << 20);
    }
    CHECK(server.WaitFailures(1));
    CHECK(server.Failures()[0].peer_closed);
  });
}

TEST_CASE(ucx_client_vanishing_mid_flight_fails_shard_side) {
  ForEachTls([](const std::string& tls) {
    EchoServer server(tls);
    {
      TestClient client(tls, server.port(), 4, 4096);
      for (uint32_t s = 0; s < 4; ++s) client.Stage(s, 10 + s, 1 << 20, 128);
      client.ep().FlushAndRing();
      client.ep().Close(/*graceful=*/false);
    }
    CHECK(server.WaitFailures(1));
    CHECK(!server.Failures()[0].peer_closed);
  });
}

}  // namespace bagpipe::transport::ucx
