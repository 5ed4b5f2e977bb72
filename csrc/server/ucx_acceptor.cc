#include "server/ucx_acceptor.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::server {

using transport::Socket;
using transport::ucx::Context;
using transport::ucx::Endpoint;
namespace uwire = transport::ucx::wire;

namespace {
constexpr int kBacklog = 4096;
constexpr size_t kAcceptBatch = 64;
constexpr double kTickSeconds = 0.1;
constexpr auto kAcceptBackoff = std::chrono::milliseconds(50);
constexpr double kRefuseSeconds = 0.5;  // a refusal is sent best effort, briefly

std::string HostOf(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}
}  // namespace

class UcxAcceptor::Listener final : public EventLoop::Handler {
 public:
  explicit Listener(UcxAcceptor* a) : a_(a) {}
  uint32_t OnEvents(uint32_t) override { return a_->AcceptBatch(); }
  void OnRemoved() override {}

 private:
  UcxAcceptor* const a_;
};

// One control connection reading its bootstrap request (BootHello, token, worker address).
class UcxAcceptor::Bootstrap final : public EventLoop::Handler {
 public:
  Bootstrap(UcxAcceptor* a, uint64_t id, int fd, std::string peer, Deadline deadline)
      : a_(a), id_(id), peer_(std::move(peer)), deadline_(deadline), fd_(fd) {}
  ~Bootstrap() override {
    if (fd_ >= 0) ::close(fd_);
  }

  void Attach(std::shared_ptr<EventLoop::Registration> reg) {
    std::lock_guard<std::mutex> lock(mu_);
    if (removed_) return;  // its first event already ended it: keep no reference
    reg_ = std::move(reg);
  }

  // From any thread: ends the handshake now (shed, timed out, stopping).
  void Kill() {
    kill_.store(true);
    std::shared_ptr<EventLoop::Registration> reg;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
      reg = reg_;
    }
    if (reg) a_->loop_->AddInterest(*reg, EPOLLIN | EPOLLOUT);
  }

  uint32_t OnEvents(uint32_t) override {
    if (kill_.load()) return Fail("handshake ended by the shard (timed out, shed or stopping)");
    for (;;) {
      uint8_t* dst;
      size_t want;
      if (got_ < sizeof(uwire::BootHello)) {
        dst = reinterpret_cast<uint8_t*>(&req_.hello) + got_;
        want = sizeof(uwire::BootHello) - got_;
      } else {
        const size_t rest = got_ - sizeof(uwire::BootHello);
        if (rest < req_.token.size()) {
          dst = reinterpret_cast<uint8_t*>(req_.token.data()) + rest;
          want = req_.token.size() - rest;
        } else {
          const size_t a = rest - req_.token.size();
          dst = req_.address.data() + a;
          want = req_.address.size() - a;
        }
      }
      if (want == 0) return Complete();
      const ssize_t n = ::recv(fd_, dst, want, 0);
      if (n == 0) return Fail(peer_ + " closed the control connection during the bootstrap");
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return EPOLLIN;
        return Fail(peer_ + ": " + std::strerror(errno));
      }
      const bool had_hello = got_ >= sizeof(uwire::BootHello);
      got_ += static_cast<size_t>(n);
      if (!had_hello && got_ >= sizeof(uwire::BootHello)) {
        // Bound everything before allocating for it (ucx_wire.h invariant 2).
        uwire::BootStatus status;
        const std::string why = Endpoint::CheckBootHello(req_.hello, a_->options_.limits, &status);
        if (!why.empty()) {
          Endpoint::Refuse(fd_, status, why, peer_, DeadlineAfter(kRefuseSeconds));
          return Fail("refused " + peer_ + ": " + why);
        }
        req_.token.resize(req_.hello.token_len);
        req_.address.resize(req_.hello.address_len);
      }
    }
  }

  void OnRemoved() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fd_ >= 0) ::close(fd_);
      fd_ = -1;
      removed_ = true;
      reg_.reset();
    }
    a_->Finished(id_, accepted_, error_);
  }

 private:
  uint32_t Fail(const std::string& why) {
    error_ = why;
    return 0;
  }

  uint32_t Complete() {
    int fd;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fd = fd_;
      fd_ = -1;  // the endpoint owns the control connection from here on
    }
    try {
      auto ep = Endpoint::Accept(a_->context_, Socket(fd), peer_, a_->options_.limits, req_,
                                 a_->authorize_, a_->on_connection_, deadline_);
      accepted_ = ep != nullptr;
      if (!ep) error_ = "refused " + peer_;
    } catch (const std::exception& e) {
      error_ = peer_ + ": " + e.what();
    }
    return 0;
  }

  UcxAcceptor* const a_;
  const uint64_t id_;
  const std::string peer_;
  const Deadline deadline_;
  std::atomic<bool> kill_{false};
  // ---- the handler thread ----
  Endpoint::BootRequest req_;
  size_t got_ = 0;
  bool accepted_ = false;
  std::string error_;
  // ---- shared ----
  std::mutex mu_;  // guards fd_, removed_ and reg_
  int fd_;
  bool removed_ = false;
  std::shared_ptr<EventLoop::Registration> reg_;
};

UcxAcceptor::UcxAcceptor(UcxAcceptorOptions options, Authorize authorize,
                         OnConnection on_connection)
    : options_(std::move(options)),
      authorize_(std::move(authorize)),
      on_connection_(std::move(on_connection)),
      context_(Context::Get(options_.config)),
      admission_(options_.admission) {
  if (!(options_.handshake_timeout > 0)) throw ValueError("handshake_timeout must be > 0");
  listen_fd_ = transport::ListenTcp(options_.host, options_.port, kBacklog, &port_);
  transport::SetNonBlocking(listen_fd_, true);
  try {
    loop_ = std::make_unique<EventLoop>(std::max<size_t>(1, options_.io_threads),
                                        [this] { Tick(); }, kTickSeconds);
    listener_ = loop_->Add(listen_fd_, std::make_shared<Listener>(this), EPOLLIN);
  } catch (...) {
    if (loop_) loop_->Stop();
    ::close(listen_fd_);
    throw;
  }
}

UcxAcceptor::~UcxAcceptor() {
  Stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

std::string UcxAcceptor::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

size_t UcxAcceptor::bootstrapping() const {
  std::lock_guard<std::mutex> lock(mu_);
  return boots_.size();
}

uint32_t UcxAcceptor::AcceptBatch() {
  for (size_t i = 0; i < kAcceptBatch; ++i) {
    if (stopping_.load()) return EventLoop::kKeepDisarmed;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      Admit(fd);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return EPOLLIN;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      std::shared_ptr<Bootstrap> victim;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (const auto id = admission_.ShedOldest()) {
          auto it = boots_.find(*id);
          if (it != boots_.end()) victim = it->second;
        }
        if (!victim) accept_paused_until_ = Clock::now() + kAcceptBackoff;
      }
      if (!victim) return EventLoop::kKeepDisarmed;
      shed_.fetch_add(1);
      victim->Kill();
      continue;
    }
    return EPOLLIN;
  }
  return EPOLLIN;
}

void UcxAcceptor::Admit(int fd) {
  transport::SetNoDelay(fd);
  const std::string peer = transport::PeerName(fd);
  std::shared_ptr<Bootstrap> boot;
  std::vector<std::shared_ptr<Bootstrap>> shed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    const auto d = admission_.Admit(id, HostOf(peer), Clock::now());
    for (uint64_t victim : d.shed) {
      auto it = boots_.find(victim);
      if (it != boots_.end()) shed.push_back(it->second);
    }
    if (d.admit) {
      boot = std::make_shared<Bootstrap>(this, id, fd, peer,
                                         DeadlineAfter(options_.handshake_timeout));
      boots_.emplace(id, boot);
    }
  }
  for (auto& v : shed) {
    shed_.fetch_add(1);
    v->Kill();
  }
  if (!boot) {
    refused_.fetch_add(1);
    ::close(fd);
    return;
  }
  try {
    boot->Attach(loop_->Add(fd, boot, EPOLLIN));
  } catch (const std::exception&) {
    boot->OnRemoved();
    return;
  }
  if (stopping_.load()) boot->Kill();  // admitted while Stop collected the handshakes
}

void UcxAcceptor::Finished(uint64_t id, bool accepted, const std::string& error) {
  (accepted ? accepted_ : refused_).fetch_add(1);
  std::lock_guard<std::mutex> lock(mu_);
  admission_.Closed(id);
  boots_.erase(id);
  if (!accepted && !error.empty()) last_error_ = error;
}

void UcxAcceptor::Tick() {
  std::vector<std::shared_ptr<Bootstrap>> expired;
  bool rearm = false;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto cutoff = now - std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(options_.handshake_timeout));
    for (uint64_t id : admission_.Expired(cutoff)) {
      auto it = boots_.find(id);
      if (it != boots_.end()) expired.push_back(it->second);
    }
    if (accept_paused_until_ != Clock::time_point{} && now >= accept_paused_until_) {
      accept_paused_until_ = Clock::time_point{};
      rearm = true;
    }
  }
  for (auto& b : expired) {
    handshake_timeouts_.fetch_add(1);
    b->Kill();
  }
  if (rearm && !stopping_.load()) loop_->Rearm(*listener_, EPOLLIN);
}

void UcxAcceptor::Stop() {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopping_.exchange(true)) return;
  if (listener_) loop_->Remove(listener_);  // returns once no thread accepts
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  std::vector<std::shared_ptr<Bootstrap>> rest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, b] : boots_) rest.push_back(b);
  }
  for (auto& b : rest) b->Kill();
  loop_->Stop();  // joins the loop threads; removes (closes) whatever is left
}

}  // namespace bagpipe::server
