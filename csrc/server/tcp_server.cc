#include "server/tcp_server.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "server/tcp_connection.h"
#include "transport/socket.h"

namespace bagpipe::server {

namespace {
constexpr int kBacklog = 4096;          // the kernel caps it at net.core.somaxconn
constexpr size_t kAcceptBatch = 64;     // then other registrations get a turn
constexpr double kTickSeconds = 0.1;    // deadline resolution
constexpr auto kAcceptBackoff = std::chrono::milliseconds(50);  // out of descriptors
}  // namespace

// The server's face towards its connections (counters, admission, the shard).
class TcpShardServer::Owner final : public TcpConnectionOwner {
 public:
  explicit Owner(TcpShardServer* s) : s_(s) {}
  transport::FrameHandler& shard() override { return *s_->shard_; }
  size_t max_queued_reply_bytes() const override { return s_->options_.max_queued_reply_bytes; }
  void CountIn(size_t frames, size_t bytes) override {
    s_->frames_.fetch_add(frames, std::memory_order_relaxed);
    s_->bytes_in_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void CountOut(size_t bytes) override { s_->bytes_out_.fetch_add(bytes, std::memory_order_relaxed); }
  void ConnectionAuthenticated(uint64_t id) override { s_->OnAuthenticated(id); }
  void ConnectionViolated(const std::string& peer) override { s_->NoteViolation(peer); }
  void ConnectionRemoved(uint64_t id) override { s_->OnRemoved(id); }

 private:
  TcpShardServer* const s_;
};

// The listener's handler.
class TcpShardServer::Acceptor final : public EventLoop::Handler {
 public:
  explicit Acceptor(TcpShardServer* s) : s_(s) {}
  uint32_t OnEvents(uint32_t) override { return s_->AcceptBatch(); }
  void OnRemoved() override {}

 private:
  TcpShardServer* const s_;
};

namespace {

std::string HostOf(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

}  // namespace

TcpShardServer::TcpShardServer(std::shared_ptr<transport::FrameHandler> shard,
                               TcpServerOptions options)
    : shard_(std::move(shard)),
      options_(std::move(options)),
      admission_(AdmissionLimits{options_.max_connections, options_.max_unauthenticated,
                                 options_.max_unauthenticated_per_host}) {
  if (!shard_) throw ValueError("TcpShardServer needs a shard");
  if (options_.job_token.size() > protocol::wire::kMaxTokenBytes) {
    throw ValueError("job_token is longer than " + std::to_string(protocol::wire::kMaxTokenBytes) +
                     " bytes");
  }
  if (!(options_.handshake_timeout > 0)) throw ValueError("handshake_timeout must be > 0");
  if (!(options_.idle_timeout >= 0)) throw ValueError("idle_timeout must be >= 0");
  if (options_.io_threads == 0 || options_.io_threads > 64) {
    throw ValueError("io_threads must be in [1, 64]");
  }
  if (options_.job_token.empty() && !options_.allow_no_token &&
      !transport::IsLoopbackHost(options_.host)) {
    throw ValueError("refusing to serve on " + options_.host +
                     " without a job token: anyone who reaches this address could read and "
                     "write every table; set a job token (BAGPIPE_JOB_TOKEN / --job-token), "
                     "bind 127.0.0.1, or allow it explicitly (--allow-no-token)");
  }
  owner_ = std::make_unique<Owner>(this);
  listen_fd_ = transport::ListenTcp(options_.host, options_.port, kBacklog, &port_);
  transport::SetNonBlocking(listen_fd_, true);
  try {
    loop_ = std::make_unique<EventLoop>(options_.io_threads, [this] { Tick(); }, kTickSeconds);
    listener_ = loop_->Add(listen_fd_, std::make_shared<Acceptor>(this), EPOLLIN);
  } catch (...) {
    if (loop_) loop_->Stop();
    ::close(listen_fd_);
    throw;
  }
}

TcpShardServer::~TcpShardServer() {
  Stop(0);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

// ---- accepting ----------------------------------------------------------------------------------

uint32_t TcpShardServer::AcceptBatch() {
  for (size_t i = 0; i < kAcceptBatch; ++i) {
    if (!accepting_.load()) return EventLoop::kKeepDisarmed;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Admit(fd);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return EPOLLIN;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // Out of descriptors: shed the oldest unauthenticated connection if there is one,
      // else pause accepting for a moment (the tick re-arms the listener).
      std::shared_ptr<TcpConnection> victim;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (const auto id = admission_.ShedOldest()) {
          auto it = conns_.find(*id);
          if (it != conns_.end()) victim = it->second;
        }
        if (!victim) accept_paused_until_ = Clock::now() + kAcceptBackoff;
      }
      if (!victim) return EventLoop::kKeepDisarmed;
      shed_.fetch_add(1);
      victim->Kill();
      continue;
    }
    return EPOLLIN;  // a transient error on one connection attempt
  }
  return EPOLLIN;
}

void TcpShardServer::Admit(int fd) {
  transport::SetNoDelay(fd);
  const std::string peer = transport::PeerName(fd);
  std::shared_ptr<TcpConnection> conn;
  std::vector<std::shared_ptr<TcpConnection>> shed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    const auto d = admission_.Admit(id, HostOf(peer), Clock::now(), [&](uint64_t pending) {
      auto it = conns_.find(pending);
      return it != conns_.end() && it->second->HelloWaiting();
    });
    for (uint64_t victim : d.shed) {
      auto it = conns_.find(victim);
      if (it != conns_.end()) shed.push_back(it->second);
    }
    if (d.admit) {
      conn = std::make_shared<TcpConnection>(owner_.get(), id, fd, peer);
      conn->expected_token = options_.job_token;
      conns_.emplace(id, conn);
    }
  }
  for (auto& v : shed) {
    shed_.fetch_add(1);
    v->Kill();
  }
  if (!shed.empty()) Note(shed_, "shed unauthenticated connections to admit new ones");
  if (!conn) {
    refused_.fetch_add(1);
    ::close(fd);
    return;
  }
  accepted_.fetch_add(1);
  try {
    auto reg = loop_->Add(fd, conn, EPOLLIN);
    conn->Attach(loop_.get(), reg);
  } catch (const std::exception&) {
    conn->OnRemoved();  // closes fd, forgets the connection
    return;
  }
  // Admitted while Stop was collecting the connections to close: close it too.
  if (!accepting_.load()) conn->Kill();
}

void TcpShardServer::OnAuthenticated(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  admission_.Authenticated(id);
}

void TcpShardServer::OnRemoved(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  admission_.Closed(id);
  conns_.erase(id);
  cv_.notify_all();
}

// ---- deadlines ------------------------------------------------------------------------------------

void TcpShardServer::Tick() {
  const auto now = Clock::now();
  std::vector<std::shared_ptr<TcpConnection>> expired, idle, overdue;
  bool rearm = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto cutoff =
        now - std::chrono::duration_cast<Clock::duration>(
                  std::chrono::duration<double>(options_.handshake_timeout));
    for (uint64_t id : admission_.Expired(cutoff)) {
      auto it = conns_.find(id);
      if (it != conns_.end()) expired.push_back(it->second);
    }
    const auto idle_bound = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options_.idle_timeout));
    for (auto& [id, c] : conns_) {
      if (c->overdue(now)) {
        overdue.push_back(c);
      } else if (options_.idle_timeout > 0 && c->authed() && now - c->last_received() > idle_bound) {
        idle.push_back(c);
      }
    }
    if (accept_paused_until_ != Clock::time_point{} && now >= accept_paused_until_) {
      accept_paused_until_ = Clock::time_point{};
      rearm = true;
    }
  }
  for (auto& c : expired) {
    handshake_timeouts_.fetch_add(1);
    c->Kill();
  }
  if (!expired.empty()) Note(handshake_timeouts_, "closed connections that did not authenticate in time");
  for (auto& c : idle) {
    idle_timeouts_.fetch_add(1);
    c->Kill();
  }
  if (!idle.empty()) Note(idle_timeouts_, "closed idle authenticated connections");
  for (auto& c : overdue) c->Kill();
  if (rearm && accepting_.load()) loop_->Rearm(*listener_, EPOLLIN);
}

void TcpShardServer::Note(std::atomic<uint64_t>& counter, const std::string& what) {
  const uint64_t n = counter.load();
  const auto& log = shard_->log();
  // A few lines, then one per 10000: a flood must not flood the log too.
  if (log && (n <= 10 || n % 10000 == 0)) log(what + " (" + std::to_string(n) + " so far)");
}

void TcpShardServer::NoteViolation(const std::string& peer) {
  const uint64_t n = closed_by_server_.fetch_add(1) + 1;
  const auto& log = shard_->log();
  if (log && (n <= 10 || n % 10000 == 0)) {
    log("closed connection from " + peer + ": protocol or authentication violation (" +
        std::to_string(n) + " so far)");
  }
}

// ---- stop and stats -----------------------------------------------------------------------------

void TcpShardServer::Stop(double drain_timeout) {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopped_.load()) return;
  accepting_.store(false);
  if (listener_) loop_->Remove(listener_);  // returns once no thread accepts
  if (listen_fd_ >= 0) ::close(listen_fd_);  // new connection attempts are refused
  listen_fd_ = -1;
  const auto deadline = DeadlineAfter(drain_timeout > 0 ? drain_timeout : 1e-6);
  std::vector<std::shared_ptr<TcpConnection>> rest;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return conns_.empty(); });
    for (auto& [id, c] : conns_) rest.push_back(c);
  }
  for (auto& c : rest) c->Kill();
  rest.clear();
  {
    // Every connection's handler removes it promptly (a handler busy applying a step
    // finishes that first).
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return conns_.empty(); });
  }
  loop_->Stop();
  stopped_.store(true);
}

ServerStats TcpShardServer::stats() {
  ServerStats s;
  s.accepted = accepted_.load();
  s.refused = refused_.load();
  s.shed = shed_.load();
  s.handshake_timeouts = handshake_timeouts_.load();
  s.idle_timeouts = idle_timeouts_.load();
  s.frames = frames_.load();
  s.bytes_in = bytes_in_.load();
  s.bytes_out = bytes_out_.load();
  s.closed_by_server = closed_by_server_.load();
  s.threads = loop_ ? loop_->threads() : 0;
  std::lock_guard<std::mutex> lock(mu_);
  s.active = conns_.size();
  s.unauthenticated = admission_.unauthenticated();
  return s;
}

}  // namespace bagpipe::server
