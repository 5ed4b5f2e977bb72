#include "server/ucx_server.h"

#include <chrono>
#include <cstring>
#include <vector>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::server {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;
using protocol::wire::Status;

// One client connection as the shard sees it.
class UcxShardServer::Link : public transport::ServerLink, public std::enable_shared_from_this<Link> {
 public:
  Link(UcxShardServer* server, std::weak_ptr<ucx::Endpoint> endpoint, std::string describe)
      : server_(server), endpoint_(std::move(endpoint)), describe_(std::move(describe)) {}

  bool Send(MsgType type, Status status, uint64_t tag, uint32_t slot, const void* fixed,
            size_t fixed_len, size_t payload_len, const transport::PayloadFill& fill) override {
    auto ep = endpoint_.lock();
    if (!ep || ep->failed() || closed_.load()) return false;
    if (fixed_len > kMaxFixed) throw std::logic_error("fixed body larger than 64 bytes");
    uint8_t head[kHeaderBytes + kMaxFixed];
    protocol::wire::StoreHeader(head, protocol::wire::MakeHeader(type, job_digest,
                                                             fixed_len + payload_len, status, tag,
                                                             slot));
    if (fixed_len) std::memcpy(head + kHeaderBytes, fixed, fixed_len);
    std::shared_ptr<std::vector<uint8_t>> buf;
    if (payload_len) {
      buf = TakeBuffer(payload_len);
      try {
        fill(buf->data());
      } catch (...) {
        GiveBack(std::move(buf));
        throw;
      }
    }
    {
      std::lock_guard<std::mutex> lock(server_->mu_);
      server_->bytes_out_ += kHeaderBytes + fixed_len + payload_len;
    }
    ep->SendMessage(head, kHeaderBytes + fixed_len, buf ? buf->data() : nullptr, payload_len,
                    [self = shared_from_this(), buf](bool) mutable {
                      if (buf) self->GiveBack(std::move(buf));
                    });
    return true;
  }
  std::string Describe() const override { return describe_; }

  std::shared_ptr<ucx::Endpoint> endpoint() const { return endpoint_.lock(); }
  void MarkClosed() { closed_.store(true); }
  // True exactly once: the caller tells the shard this link's rank left.
  bool Leave() { return !left_.exchange(true); }

 private:
  // A pooled reply buffer of n bytes.
  std::shared_ptr<std::vector<uint8_t>> TakeBuffer(size_t n) {
    {
      std::lock_guard<std::mutex> lock(pool_mu_);
      for (size_t i = 0; i < pool_.size(); ++i) {
        if (pool_[i]->capacity() >= n) {
          auto b = std::move(pool_[i]);
          pool_[i] = std::move(pool_.back());
          pool_.pop_back();
          b->resize(n);
          return b;
        }
      }
    }
    return std::make_shared<std::vector<uint8_t>>(n);
  }
  void GiveBack(std::shared_ptr<std::vector<uint8_t>> b) {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (pool_.size() < kMaxPooled) pool_.push_back(std::move(b));
  }

  static constexpr size_t kMaxFixed = 64;
  static constexpr size_t kMaxPooled = 16;
  UcxShardServer* const server_;
  const std::weak_ptr<ucx::Endpoint> endpoint_;
  const std::string describe_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> left_{false};
  std::mutex pool_mu_;  // guards pool_
  std::vector<std::shared_ptr<std::vector<uint8_t>>> pool_;
};

UcxShardServer::UcxShardServer(std::shared_ptr<transport::FrameHandler> shard, UcxServerOptions options)
    : shard_(std::move(shard)), options_(std::move(options)) {
  if (!shard_) throw ValueError("UcxShardServer needs a shard");
  if (options_.job_token.empty() && !options_.allow_no_token &&
      !transport::IsLoopbackHost(options_.host)) {
    throw ValueError("refusing to serve on " + options_.host +
                     " without a job token: anyone who reaches this address could read and "
                     "write every table; set a job token (BAGPIPE_JOB_TOKEN / --job-token), "
                     "bind 127.0.0.1, or allow it explicitly (--allow-no-token)");
  }
  UcxAcceptorOptions ao;
  ao.host = options_.host;
  ao.port = options_.port;
  ao.config = options_.config;
  ao.handshake_timeout = options_.handshake_timeout;
  ao.admission = AdmissionLimits{options_.max_unauthenticated, options_.max_unauthenticated,
                                 options_.max_unauthenticated_per_host};
  ao.io_threads = options_.io_threads;
  if (options_.progress_threads == 0 || options_.progress_threads > 64) {
    throw ValueError("progress_threads must be in [1, 64]");
  }
  progress_ = std::make_shared<ucx::ProgressPool>(options_.progress_threads);
  ao.limits.progress = progress_;
  ao.limits.max_slot_bytes = shard_->identity().max_frame_bytes;
  ao.limits.max_ring_bytes = options_.max_ring_bytes;
  reaper_ = std::thread([this] { ReaperLoop(); });
  try {
    acceptor_ = std::make_unique<UcxAcceptor>(
        ao,
        [this](const std::string& token, std::string* why) {
          if (token != options_.job_token) return false;  // *why: "wrong job token"
          std::lock_guard<std::mutex> lock(mu_);
          if (stopped_.load()) {
            *why = "the shard is shutting down";
            return false;
          }
          if (conns_.size() >= options_.max_connections) {
            refused_full_.fetch_add(1);
            *why = "too many connections (max " + std::to_string(options_.max_connections) + ")";
            return false;
          }
          return true;
        },
        [this](const std::shared_ptr<ucx::Endpoint>& ep) { return Attach(ep); });
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      reaper_stop_ = true;
      cv_.notify_all();
    }
    reaper_.join();
    throw;
  }
}

UcxShardServer::~UcxShardServer() { Stop(0); }

ucx::EndpointHandlers UcxShardServer::Attach(const std::shared_ptr<ucx::Endpoint>& ep) {
  const std::string& p = ep->peer();  // "ucx client HOST:PORT"
  auto link = std::make_shared<Link>(this, ep, "ucx " + p.substr(p.rfind(' ') + 1));
  link->expected_token = options_.job_token;
  link->job_digest = protocol::wire::TokenDigest(options_.job_token);
  {
    std::lock_guard<std::mutex> lock(mu_);
    conns_.push_back(Conn{ep, link, false});
  }
  ucx::EndpointHandlers h;
  h.on_ring_frame = [this, link](const ucx::RingFrame& f) { OnFrame(link, f); };
  h.on_failure = [this, raw = link.get()](const ucx::Failure&) { OnDead(raw); };
  return h;
}

void UcxShardServer::CloseLink(const std::shared_ptr<Link>& link, const std::string& why) {
  closed_by_server_.fetch_add(1);
  link->MarkClosed();
  if (auto ep = link->endpoint()) ep->Fail("closed by the shard: " + why);
}

void UcxShardServer::OnFrame(const std::shared_ptr<Link>& link, const ucx::RingFrame& f) {
  if (f.len < kHeaderBytes) return CloseLink(link, "a frame shorter than its header");
  const FrameHeader h = protocol::wire::LoadHeader(f.data);
  std::string why;
  if (!protocol::wire::CheckHeader(h, f.len - kHeaderBytes, &why)) return CloseLink(link, why);
  if (h.body_len != f.len - kHeaderBytes) {
    return CloseLink(link, "frame body_len does not match its doorbell");
  }
  if (h.slot != f.slot || h.tag != f.tag) {
    return CloseLink(link, "the frame in slot " + std::to_string(f.slot) +
                               " does not match its doorbell (a write that did not land)");
  }
  frames_.fetch_add(1);
  bytes_in_.fetch_add(f.len);
  if (!shard_->HandleFrame(link, h, f.data + kHeaderBytes, h.body_len)) {
    CloseLink(link, "refused by the shard");
  }
}

void UcxShardServer::OnDead(Link* link) {
  // On the connection's progress thread: the rank leaves its session now; the reaper joins
  // and frees the connection.
  link->MarkClosed();
  if (link->Leave()) shard_->LinkClosed(link);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : conns_) {
    if (c.link.get() == link) c.dead = true;
  }
  cv_.notify_all();
}

void UcxShardServer::ReaperLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] {
      if (reaper_stop_) return true;
      for (auto& c : conns_) {
        if (c.dead) return true;
      }
      return false;
    });
    std::list<Conn> dead;
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->dead) {
        dead.splice(dead.end(), conns_, it++);
      } else {
        ++it;
      }
    }
    const bool stop = reaper_stop_;
    lock.unlock();
    for (auto& c : dead) c.endpoint->Close(/*graceful=*/false);
    dead.clear();
    lock.lock();
    cv_.notify_all();  // Stop may be waiting for conns_ to drain
    if (stop && std::none_of(conns_.begin(), conns_.end(), [](const Conn& c) { return c.dead; })) {
      return;
    }
  }
}

void UcxShardServer::Stop(double drain_timeout) {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopped_.exchange(true)) return;
  acceptor_->Stop();
  // Let connected clients finish and close their sessions.
  const auto deadline = DeadlineAfter(drain_timeout > 0 ? drain_timeout : 1e-6);
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return conns_.empty(); });
  }
  // Close the rest: each says goodbye; its rank leaves the session.
  std::list<Conn> rest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rest.swap(conns_);
  }
  for (auto& c : rest) {
    c.endpoint->Close(/*graceful=*/true);
    if (c.link->Leave()) shard_->LinkClosed(c.link.get());
  }
  rest.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    reaper_stop_ = true;
    cv_.notify_all();
  }
  if (reaper_.joinable()) reaper_.join();
}

ServerStats UcxShardServer::stats() {
  ServerStats s;
  s.accepted = acceptor_->accepted();
  s.refused = acceptor_->refused();
  s.shed = acceptor_->shed();
  s.handshake_timeouts = acceptor_->handshake_timeouts();
  s.unauthenticated = acceptor_->bootstrapping();
  s.frames = frames_.load();
  s.bytes_in = bytes_in_.load();
  s.closed_by_server = closed_by_server_.load();
  std::lock_guard<std::mutex> lock(mu_);
  s.active = conns_.size();
  // Bootstrap loop threads, the reaper, and the progress threads of every endpoint.
  s.threads = acceptor_->threads() + 1 + progress_->threads();
  s.bytes_out = bytes_out_;
  s.ucx_workers = progress_->workers();
  s.ucx_stray = progress_->stray();
  return s;
}

}  // namespace bagpipe::server
