#include "server/tcp_connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace bagpipe::server {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;
using protocol::wire::Status;

namespace {
constexpr size_t kFramesPerRun = 64;                  // then other connections get a turn
constexpr size_t kBytesPerRun = size_t{16} << 20;
constexpr size_t kMaxDiscard = size_t{1} << 20;       // read off at most this much when closing
constexpr auto kClosingBound = std::chrono::seconds(1);
constexpr auto kLingerBound = std::chrono::milliseconds(200);
}  // namespace

void TcpConnection::Buffer::Reserve(size_t n) {
  if (n <= cap) return;
  data.reset(new uint8_t[n]);
  cap = n;
}

TcpConnection::TcpConnection(TcpConnectionOwner* owner, uint64_t id, int fd, std::string peer)
    : owner_(owner), id_(id), peer_(std::move(peer)),
      last_rx_(Clock::now().time_since_epoch().count()), fd_(fd) {}

TcpConnection::~TcpConnection() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpConnection::Attach(EventLoop* loop, std::shared_ptr<EventLoop::Registration> reg) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return;  // already removed (its first event ended it): keep no reference
  loop_ = loop;
  reg_ = std::move(reg);
}

Clock::time_point TcpConnection::last_received() const {
  return Clock::time_point(Clock::duration(last_rx_.load(std::memory_order_relaxed)));
}

bool TcpConnection::overdue(Clock::time_point now) const {
  const int64_t d = phase_deadline_.load(std::memory_order_relaxed);
  return d != 0 && now.time_since_epoch().count() > d;
}

bool TcpConnection::HelloWaiting() const {
  if (authed()) return false;
  if (hello_read_.load(std::memory_order_acquire)) return true;  // being handled right now
  constexpr size_t kMaxHello =
      kHeaderBytes + sizeof(protocol::wire::HelloBody) + protocol::wire::kMaxTokenBytes;
  uint8_t buf[kMaxHello];
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0) return false;
  const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
  if (n < static_cast<ssize_t>(kHeaderBytes)) return false;
  const FrameHeader h = protocol::wire::LoadHeader(buf);
  return h.magic == protocol::wire::kMagic &&
         h.type == static_cast<uint16_t>(MsgType::kHello) &&
         h.body_len <= kMaxHello - kHeaderBytes &&
         static_cast<size_t>(n) >= kHeaderBytes + h.body_len;
}

void TcpConnection::Touch() {
  last_rx_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void TcpConnection::Kill() {
  kill_.store(true, std::memory_order_release);
  std::shared_ptr<EventLoop::Registration> reg;
  EventLoop* loop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ < 0) return;
    // Both directions end now: the handler sees EPOLLHUP whatever it was armed for.
    ::shutdown(fd_, SHUT_RDWR);
    reg = reg_;
    loop = loop_;
  }
  if (loop && reg) loop->AddInterest(*reg, EPOLLIN | EPOLLOUT);
}

// ---- replies ------------------------------------------------------------------------------------

bool TcpConnection::Send(MsgType type, Status status, uint64_t tag, uint32_t slot,
                         const void* fixed, size_t fixed_len, size_t payload_len,
                         const transport::PayloadFill& fill) {
  const size_t total = kHeaderBytes + fixed_len + payload_len;
  const auto header =
      protocol::wire::MakeHeader(type, job_digest, fixed_len + payload_len, status, tag, slot);
  if (payload_len == 0 && total <= kSmallFrame) {
    // ACKs, notifications, *Ok replies: built on the stack, no pooled buffer.
    uint8_t small[kSmallFrame];
    protocol::wire::StoreHeader(small, header);
    if (fixed_len) std::memcpy(small + kHeaderBytes, fixed, fixed_len);
    return SendBytes(small, total, Buffer{});
  }
  Buffer buf = TakeBuffer(total);
  buf.Reserve(total);
  buf.len = total;
  protocol::wire::StoreHeader(buf.data.get(), header);
  if (fixed_len) std::memcpy(buf.data.get() + kHeaderBytes, fixed, fixed_len);
  if (payload_len) {
    try {
      fill(buf.data.get() + kHeaderBytes + fixed_len);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      PoolLocked(std::move(buf));
      throw;
    }
  }
  const uint8_t* bytes = buf.data.get();
  return SendBytes(bytes, total, std::move(buf));
}

bool TcpConnection::SendBytes(const uint8_t* bytes, size_t total, Buffer buf) {
  std::shared_ptr<EventLoop::Registration> reg;
  EventLoop* loop = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || fd_ < 0) return false;
    size_t sent = 0;
    if (queue_.empty()) {
      // Write what the socket takes right now; only a remainder is queued (invariant 1).
      const ssize_t n = ::send(fd_, bytes, total, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n == static_cast<ssize_t>(total)) {
        owner_->CountOut(total);
        if (buf.data) PoolLocked(std::move(buf));
        return true;
      }
      if (n > 0) {
        sent = static_cast<size_t>(n);
        owner_->CountOut(sent);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        closed_ = true;
        ::shutdown(fd_, SHUT_RDWR);
        return false;
      }
    }
    if (queued_bytes_ + total > owner_->max_queued_reply_bytes()) {
      // The client does not read its replies: give up on it rather than buffer forever.
      closed_ = true;
      kill_.store(true, std::memory_order_release);
      ::shutdown(fd_, SHUT_RDWR);
      return false;
    }
    if (!buf.data) {
      // A stack frame that must wait: copy it (it is small).
      buf.Reserve(total);
      std::memcpy(buf.data.get(), bytes, total);
    }
    buf.len = total;
    buf.sent = sent;
    queued_bytes_ += total;
    const bool was_empty = queue_.empty();
    queue_.push_back(std::move(buf));
    if (was_empty) {
      reg = reg_;
      loop = loop_;
    }
  }
  // Ask for EPOLLOUT (applied when the handler re-arms if one is running).
  if (loop && reg) loop->AddInterest(*reg, EPOLLOUT);
  return true;
}

TcpConnection::Buffer TcpConnection::TakeBuffer(size_t need) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pool_.empty()) return Buffer{};
  size_t pick = 0;
  for (size_t i = 0; i < pool_.size(); ++i) {
    const size_t cap = pool_[i].cap;
    const size_t best = pool_[pick].cap;
    if ((cap >= need && (best < need || cap < best)) || (best < need && cap > best)) pick = i;
  }
  if (pick + 1 != pool_.size()) std::swap(pool_[pick], pool_.back());
  Buffer b = std::move(pool_.back());
  pool_.pop_back();
  pool_bytes_ -= b.cap;
  b.len = b.sent = 0;
  return b;
}

// Keeps a sent reply buffer for the next reply, so a window of large replies reuses warm
// memory instead of faulting in fresh pages each time (bounded in count and bytes).
void TcpConnection::PoolLocked(Buffer b) {
  if (!b.data || pool_.size() >= kPoolBuffers || pool_bytes_ + b.cap > kPoolBytes) return;
  pool_bytes_ += b.cap;
  pool_.push_back(std::move(b));
}

bool TcpConnection::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!queue_.empty() && fd_ >= 0) {
    Buffer& b = queue_.front();
    const ssize_t n =
        ::send(fd_, b.data.get() + b.sent, b.len - b.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      b.sent += static_cast<size_t>(n);
      owner_->CountOut(static_cast<size_t>(n));
      if (b.sent < b.len) continue;
      queued_bytes_ -= b.len;
      Buffer done = std::move(b);
      queue_.pop_front();
      PoolLocked(std::move(done));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    closed_ = true;
    queue_.clear();
    queued_bytes_ = 0;
    return false;
  }
  return true;
}

// ---- reading ------------------------------------------------------------------------------------

TcpConnection::ReadEnd TcpConnection::Dispatch() {
  auto& shard = owner_->shard();
  owner_->CountIn(1, kHeaderBytes + header_.body_len);
  const bool was_authenticated = authenticated;
  auto self = shared_from_this();
  const bool keep = shard.HandleFrame(self, header_, body_.data.get(), header_.body_len, &body_);
  in_body_ = false;
  head_got_ = 0;
  if (!keep) return ReadEnd::kViolation;
  if (!was_authenticated && authenticated) {
    authed_.store(true, std::memory_order_release);
    owner_->ConnectionAuthenticated(id_);
  }
  return ReadEnd::kMore;
}

TcpConnection::ReadEnd TcpConnection::ReadFrames() {
  size_t frames = 0, bytes = 0;
  while (frames < kFramesPerRun && bytes < kBytesPerRun) {
    if (kill_.load(std::memory_order_acquire)) return ReadEnd::kError;
    uint8_t* dst;
    size_t want;
    if (!in_body_) {
      dst = head_ + head_got_;
      want = kHeaderBytes - head_got_;
    } else {
      dst = body_.data.get() + body_got_;
      want = header_.body_len - body_got_;
    }
    const ssize_t n = ::recv(fd_, dst, want, 0);
    if (n == 0) {
      // A clean EOF between frames is a goodbye; inside a frame the peer gave up mid-way.
      return ReadEnd::kEof;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadEnd::kAgain;
      return ReadEnd::kError;
    }
    Touch();
    bytes += static_cast<size_t>(n);
    if (!in_body_) {
      head_got_ += static_cast<size_t>(n);
      if (head_got_ < kHeaderBytes) continue;
      header_ = protocol::wire::LoadHeader(head_);
      const size_t max_frame = owner_->shard().identity().max_frame_bytes;
      const size_t limit = authenticated ? max_frame - kHeaderBytes
                                         : sizeof(protocol::wire::HelloBody) +
                                               protocol::wire::kMaxTokenBytes;
      std::string why;
      if (!protocol::wire::CheckHeader(header_, limit, &why)) {
        SendError(header_.tag, header_.slot, Status::kProtocolError, 0,
                  "malformed frame header: " + why);
        return ReadEnd::kViolation;
      }
      body_.Reserve(header_.body_len);
      body_got_ = 0;
      in_body_ = true;
    } else {
      body_got_ += static_cast<size_t>(n);
    }
    if (in_body_ && body_got_ == header_.body_len) {
      ++frames;
      if (!authenticated) hello_read_.store(true, std::memory_order_release);
      if (Dispatch() == ReadEnd::kViolation) return ReadEnd::kViolation;
    }
  }
  return ReadEnd::kMore;
}

bool TcpConnection::Discard() {
  uint8_t sink[4096];
  while (discarded_ < kMaxDiscard) {
    const ssize_t n = ::recv(fd_, sink, sizeof(sink), 0);
    if (n == 0) return true;
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno != EAGAIN && errno != EWOULDBLOCK;
    }
    discarded_ += static_cast<size_t>(n);
  }
  return true;
}

void TcpConnection::EndReading() {
  if (!left_) {
    left_ = true;
    owner_->shard().LinkClosed(this);
  }
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;  // replies queued so far still go out (e.g. the error explaining a refusal)
}

// ---- the handler ----------------------------------------------------------------------------------

uint32_t TcpConnection::OnEvents(uint32_t events) {
  if (kill_.load(std::memory_order_acquire)) {
    EndReading();
    return 0;
  }
  if (phase_ == Phase::kReading) {
    ReadEnd end = ReadEnd::kAgain;
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) end = ReadFrames();
    if (end == ReadEnd::kViolation) owner_->ConnectionViolated(peer_);
    if (end == ReadEnd::kError) {
      EndReading();
      return 0;
    }
    if (end == ReadEnd::kEof || end == ReadEnd::kViolation) {
      EndReading();
      phase_ = Phase::kClosing;
      phase_deadline_.store((Clock::now() + kClosingBound).time_since_epoch().count());
    }
  }
  if (!Flush()) {
    EndReading();
    return 0;
  }
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued = !queue_.empty();
  }
  if (phase_ == Phase::kClosing) {
    if (Discard()) discarded_ = kMaxDiscard;  // the peer is gone or sent enough: stop reading
    if (!queued) {
      // Send FIN after the last reply, then read off what the peer still sends for a moment:
      // closing a socket with unread input would reset it and could destroy that reply.
      ::shutdown(fd_, SHUT_WR);
      phase_ = Phase::kLinger;
      phase_deadline_.store((Clock::now() + kLingerBound).time_since_epoch().count());
    }
  }
  if (phase_ == Phase::kLinger) {
    if (Discard()) return 0;
    return EPOLLIN;
  }
  if (phase_ == Phase::kClosing && discarded_ >= kMaxDiscard) return queued ? EPOLLOUT : EPOLLIN;
  return EPOLLIN | (queued ? EPOLLOUT : 0u);
}

void TcpConnection::OnRemoved() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    queue_.clear();
    queued_bytes_ = 0;
    pool_.clear();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    reg_.reset();
  }
  owner_->ConnectionRemoved(id_);
}

}  // namespace bagpipe::server
