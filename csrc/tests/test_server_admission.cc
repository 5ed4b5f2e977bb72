// Unit tests of the shard servers' building blocks: Admission (which unauthenticated
// connections are kept) against a plain reference model under random operations, and the
// EventLoop's guarantees (one handler run at a time per registration, no lost events,
// OnRemoved exactly once, Stop removes what is left).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "server/admission.h"
#include "server/event_loop.h"
#include "tests/test_harness.h"

namespace bagpipe::server {
namespace {

using namespace std::chrono_literals;

// The reference: pending connections in accept order with their host; authenticated ones.
struct Model {
  AdmissionLimits limits;
  std::deque<std::pair<uint64_t, std::string>> pending;
  std::set<uint64_t> authenticated;

  size_t total() const { return pending.size() + authenticated.size(); }
  void Erase(uint64_t id) {
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](const auto& p) { return p.first == id; }),
                  pending.end());
  }
  // Mirrors Admission::Admit without a Spare predicate.
  std::pair<bool, std::vector<uint64_t>> Admit(uint64_t id, const std::string& host) {
    std::vector<uint64_t> shed;
    if (total() >= limits.max_connections) {
      if (pending.empty()) return {false, shed};
      shed.push_back(pending.front().first);
      pending.pop_front();
    }
    size_t from_host = 0;
    for (const auto& p : pending) from_host += p.second == host;
    if (from_host >= limits.max_unauthenticated_per_host) {
      auto it = std::find_if(pending.begin(), pending.end(),
                             [&](const auto& p) { return p.second == host; });
      shed.push_back(it->first);
      pending.erase(it);
    }
    if (pending.size() >= limits.max_unauthenticated) {
      shed.push_back(pending.front().first);
      pending.pop_front();
    }
    pending.emplace_back(id, host);
    return {true, shed};
  }
};

TEST_CASE(admission_matches_reference_model) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 20; ++round) {
    AdmissionLimits limits{3 + rng() % 20, 1 + rng() % 10, 1 + rng() % 5};
    Admission a(limits);
    Model m{limits, {}, {}};
    uint64_t next = 1;
    std::vector<uint64_t> open;  // ids the server would still hold open
    for (int op = 0; op < 2000; ++op) {
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 6) {
        const std::string host(1, static_cast<char>('a' + rng() % 4));
        const uint64_t id = next++;
        const auto d = a.Admit(id, host, Clock::now());
        const auto want = m.Admit(id, host);
        CHECK_EQ(d.admit, want.first);
        CHECK(d.shed == want.second);
        for (uint64_t s : d.shed) open.erase(std::find(open.begin(), open.end(), s));
        if (d.admit) open.push_back(id);
      } else if (kind < 8 && !m.pending.empty()) {
        const auto p = m.pending[rng() % m.pending.size()];
        a.Authenticated(p.first);
        m.Erase(p.first);
        m.authenticated.insert(p.first);
      } else if (!open.empty()) {
        const size_t i = rng() % open.size();
        const uint64_t id = open[i];
        open.erase(open.begin() + static_cast<long>(i));
        a.Closed(id);
        m.Erase(id);
        m.authenticated.erase(id);
      }
      // Invariants 1 and 2.
      CHECK_EQ(a.unauthenticated(), m.pending.size());
      CHECK_EQ(a.total(), m.total());
      CHECK(a.unauthenticated() <= limits.max_unauthenticated);
      CHECK(a.total() <= limits.max_connections);
      std::map<std::string, size_t> per_host;
      for (const auto& p : m.pending) ++per_host[p.second];
      for (const auto& [h, n] : per_host) CHECK(n <= limits.max_unauthenticated_per_host);
    }
    // Invariant 4: closing an unknown or already shed id changes nothing.
    const size_t before = a.total();
    a.Closed(next + 100);
    a.Authenticated(next + 100);
    CHECK_EQ(a.total(), before);
  }
}

TEST_CASE(admission_expires_oldest_first_and_spares_connections_about_to_authenticate) {
  Admission a(AdmissionLimits{100, 3, 3});
  const auto t0 = Clock::now();
  for (uint64_t id = 1; id <= 3; ++id) a.Admit(id, "h", t0 + std::chrono::seconds(id));
  // A fourth sheds the oldest, unless it is spared (then the next oldest goes).
  auto d = a.Admit(4, "h", t0 + 4s, [](uint64_t id) { return id == 1; });
  CHECK(d.admit);
  CHECK(d.shed == std::vector<uint64_t>{2});
  // Everyone spared: the oldest after all (the bound holds).
  d = a.Admit(5, "h", t0 + 5s, [](uint64_t) { return true; });
  CHECK(d.shed == std::vector<uint64_t>{1});
  CHECK_EQ(a.unauthenticated(), size_t{3});
  // Expired: accept order, each once.
  CHECK(a.Expired(t0 + 4500ms) == std::vector<uint64_t>({3, 4}));
  CHECK(a.Expired(t0 + 4500ms).empty());
  CHECK_EQ(a.unauthenticated(), size_t{1});
  CHECK_EQ(a.total(), size_t{3});  // expired ones count until the server closed them
  a.Closed(3);
  a.Closed(4);
  CHECK_EQ(a.total(), size_t{1});
  CHECK(a.ShedOldest() == std::optional<uint64_t>(5));
  CHECK(!a.ShedOldest());
  CHECK_EQ(a.total(), size_t{0});
  // Authenticated connections are never shed: past max_connections new ones are refused.
  Admission full(AdmissionLimits{2, 2, 2});
  full.Admit(1, "h", t0);
  full.Admit(2, "h", t0);
  full.Authenticated(1);
  full.Authenticated(2);
  CHECK(!full.Admit(3, "h", t0).admit);
  CHECK_THROWS(ValueError, Admission(AdmissionLimits{0, 1, 1}));
}

// ---- EventLoop -------------------------------------------------------------------------------

class PipeHandler : public EventLoop::Handler {
 public:
  explicit PipeHandler(int fd) : fd_(fd) {}
  uint32_t OnEvents(uint32_t events) override {
    const int now = running.fetch_add(1) + 1;
    max_running = std::max(max_running.load(), now);
    if (events & EPOLLIN) {
      char buf[64];
      ssize_t n;
      while ((n = ::read(fd_, buf, sizeof(buf))) > 0) bytes += n;
      if (n == 0) eof = true;
    }
    if (events & EPOLLOUT) ++outs;
    std::this_thread::sleep_for(1ms);  // widen the window for overlapping runs
    running.fetch_sub(1);
    return eof ? 0u : static_cast<uint32_t>(EPOLLIN);
  }
  void OnRemoved() override {
    removed.fetch_add(1);
    ::close(fd_);
  }
  int fd_;
  std::atomic<int> running{0};
  std::atomic<int> max_running{0};
  std::atomic<long> bytes{0};
  std::atomic<int> outs{0};
  std::atomic<int> removed{0};
  bool eof = false;
};

bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds t = 5000ms) {
  const auto end = Clock::now() + t;
  while (Clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return pred();
}

TEST_CASE(event_loop_runs_one_handler_at_a_time_and_loses_no_event) {
  std::atomic<int> ticks{0};
  EventLoop loop(4, [&] { ticks.fetch_add(1); }, 0.01);
  int sv[2];
  CHECK_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
  ::fcntl(sv[1], F_SETFL, ::fcntl(sv[1], F_GETFL) & ~O_NONBLOCK);  // the writer blocks
  auto h = std::make_shared<PipeHandler>(sv[0]);
  auto reg = loop.Add(sv[0], h, EPOLLIN);
  long sent = 0;
  for (int i = 0; i < 500; ++i) {
    const char b[7] = "abcdef";
    sent += ::write(sv[1], b, sizeof(b));
    if (i % 50 == 0) loop.AddInterest(*reg, EPOLLOUT);  // from another thread, during runs
  }
  if (!WaitFor([&] { return h->bytes.load() == sent; })) {
    std::printf("read %ld of %ld bytes, outs %d\n", h->bytes.load(), sent, h->outs.load());
    CHECK(false);
  }
  CHECK(WaitFor([&] { return h->outs.load() > 0; }));
  CHECK_EQ(h->max_running.load(), 1);  // invariant 1
  ::close(sv[1]);                      // EOF: the handler deregisters
  CHECK(WaitFor([&] { return h->removed.load() == 1; }));
  CHECK_EQ(loop.registrations(), size_t{0});
  CHECK(WaitFor([&] { return ticks.load() > 3; }));
  loop.Stop();
  CHECK_EQ(h->removed.load(), 1);  // invariant 2: exactly once
}

TEST_CASE(event_loop_stop_and_remove_release_every_registration) {
  EventLoop loop(2, nullptr, 0.05);
  std::vector<std::shared_ptr<PipeHandler>> hs;
  std::vector<int> peers;
  for (int i = 0; i < 50; ++i) {
    int sv[2];
    CHECK_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv), 0);
    auto h = std::make_shared<PipeHandler>(sv[0]);
    auto reg = loop.Add(sv[0], h, EPOLLIN);
    if (i % 2 == 0) loop.Remove(reg);
    hs.push_back(h);
    peers.push_back(sv[1]);
  }
  CHECK_EQ(loop.registrations(), size_t{25});
  loop.Stop();  // invariant 3
  CHECK_EQ(loop.registrations(), size_t{0});
  for (auto& h : hs) CHECK_EQ(h->removed.load(), 1);
  for (int p : peers) ::close(p);
}

}  // namespace
}  // namespace bagpipe::server
