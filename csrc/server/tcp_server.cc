#include "server/tcp_server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <errno.h>

#include <condition_variable>
#include <cstring>
#include <deque>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::server {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;
using protocol::wire::Status;

namespace {

// A growable byte buffer that does not zero-fill on growth (replies of many MB).
struct Buffer {
  std::unique_ptr<uint8_t[]> data;
  size_t cap = 0;
  size_t len = 0;
  size_t sent = 0;  // bytes already written by Send's fast path
  void Reserve(size_t n) {
    if (n <= cap) return;
    data.reset(new uint8_t[n]);
    cap = n;
  }
};

}  // namespace

class TcpShardServer::Connection : public transport::ServerLink,
                                public std::enable_shared_from_this<Connection> {
 public:
  Connection(int fd, TcpShardServer* server)
      : fd_(fd), peer_(transport::PeerName(fd)), server_(server) {
    expected_token = server->options_.job_token;
  }

  void Start() {
    auto self = shared_from_this();
    writer_ = std::thread([self] { self->WriteLoop(); });
    reader_ = std::thread([self] { self->ReadLoop(); });
  }

  bool Send(MsgType type, Status status, uint64_t tag, uint32_t slot, const void* fixed,
            size_t fixed_len, size_t payload_len, const transport::PayloadFill& fill) override {
    const size_t total = kHeaderBytes + fixed_len + payload_len;
    const auto header = protocol::wire::MakeHeader(type, job_digest, fixed_len + payload_len,
                                                 status, tag, slot);
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
        Recycle(std::move(buf));
        throw;
      }
    }
    const uint8_t* bytes = buf.data.get();
    return SendBytes(bytes, total, std::move(buf));
  }

  // Sends `total` bytes at `bytes`: `buf` is empty (the bytes live on the caller's stack and
  // are copied into a buffer only if they must be queued) or owns them.
  bool SendBytes(const uint8_t* bytes, size_t total, Buffer buf) {
    size_t sent = 0;
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return false;
    if (queue_.empty() && !writing_) {
      // Fast path: write what the socket takes right now, without blocking and without
      // waking the writer; only a remainder is queued. (Ordering holds: nothing is queued
      // or being written.)
      const ssize_t n = ::send(fd_, bytes, total, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n == static_cast<ssize_t>(total)) {
        server_->bytes_out_.fetch_add(total);
        if (buf.data) PoolLocked(std::move(buf));
        return true;
      }
      if (n > 0) {
        sent = static_cast<size_t>(n);
        server_->bytes_out_.fetch_add(sent);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        closed_ = true;
        ::shutdown(fd_, SHUT_RDWR);
        return false;
      }
    }
    if (!buf.data) {
      // A stack frame that must wait for the writer: copy it (it is small). Ordering still
      // holds: the lock is held from the send attempt to the enqueue below.
      buf.Reserve(total);
      buf.len = total;
      std::memcpy(buf.data.get(), bytes, total);
    }
    buf.sent = sent;
    if (queued_bytes_ + total > server_->options_.max_queued_reply_bytes) {
      // The client does not read its replies: give up on it rather than buffer forever.
      closed_ = true;
      ::shutdown(fd_, SHUT_RDWR);
      return false;
    }
    queued_bytes_ += total;
    queue_.push_back(std::move(buf));
    cv_.notify_all();
    return true;
  }

  std::string Describe() const override { return "tcp " + peer_; }

  bool finished() const { return reader_done_.load() && writer_done_.load(); }

  void ShutdownSocket() { ::shutdown(fd_, SHUT_RDWR); }

  // REQUIRES: called once, by the server, after ShutdownSocket() or finished().
  void Join() {
    if (reader_.joinable()) reader_.join();
    if (writer_.joinable()) writer_.join();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  // A pooled buffer of at least `need` bytes if there is one, else the largest (grown by
  // the caller), else an empty one.
  Buffer TakeBuffer(size_t need) {
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
    return b;
  }

  void Recycle(Buffer b) {
    std::lock_guard<std::mutex> lock(mu_);
    PoolLocked(std::move(b));
  }

  // Keeps a sent reply buffer for the next reply, so a window of large replies reuses warm
  // memory instead of faulting in fresh pages each time (bounded in count and bytes).
  void PoolLocked(Buffer b) {
    if (pool_.size() >= kPoolBuffers || pool_bytes_ + b.cap > kPoolBytes) return;
    pool_bytes_ += b.cap;
    pool_.push_back(std::move(b));
  }

  void WriteLoop() {
    for (;;) {
      Buffer b;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty() || writer_stop_; });
        if (queue_.empty()) break;
        b = std::move(queue_.front());
        queue_.pop_front();
        writing_ = true;
      }
      try {
        transport::WriteAll(fd_, b.data.get() + b.sent, b.len - b.sent, peer_);
      } catch (const std::exception&) {
        std::lock_guard<std::mutex> lock(mu_);
        closed_ = true;
        writing_ = false;
        queue_.clear();
        ::shutdown(fd_, SHUT_RDWR);
        break;
      }
      server_->bytes_out_.fetch_add(b.len - b.sent);
      {
        std::lock_guard<std::mutex> lock(mu_);
        writing_ = false;
        queued_bytes_ -= b.len;
        PoolLocked(std::move(b));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    writer_done_.store(true);
    cv_.notify_all();
  }

  void ReadLoop() {
    auto self = shared_from_this();
    auto& shard = *server_->shard_;
    const size_t max_frame = shard.identity().max_frame_bytes;
    transport::RecvBuffer body;  // a commit chunk may take it (and give another back)
    transport::FrameReader in(fd_, peer_);
    bool violation = false;
    try {
      transport::SetRecvTimeout(fd_, server_->options_.handshake_timeout);
      for (;;) {
        uint8_t hb[kHeaderBytes];
        if (!in.Read(hb, kHeaderBytes, true)) break;
        const FrameHeader h = protocol::wire::LoadHeader(hb);
        const size_t limit = authenticated ? max_frame - kHeaderBytes
                                           : sizeof(protocol::wire::HelloBody) +
                                                 protocol::wire::kMaxTokenBytes;
        std::string why;
        if (!protocol::wire::CheckHeader(h, limit, &why)) {
          SendError(h.tag, h.slot, Status::kProtocolError, 0, "malformed frame header: " + why);
          violation = true;
          break;
        }
        body.Reserve(h.body_len);
        in.Read(body.data.get(), h.body_len, false);
        server_->frames_.fetch_add(1);
        server_->bytes_in_.fetch_add(kHeaderBytes + h.body_len);
        const bool was_authenticated = authenticated;
        if (!shard.HandleFrame(self, h, body.data.get(), h.body_len, &body)) {
          violation = true;
          break;
        }
        if (!was_authenticated && authenticated) transport::SetRecvTimeout(fd_, 0);
      }
    } catch (const std::exception&) {
      // EOF inside a frame, a reset, or a handshake that timed out: the connection ends.
    }
    shard.LinkClosed(this);
    if (violation) server_->NoteViolation(peer_);
    {
      std::unique_lock<std::mutex> lock(mu_);
      closed_ = true;  // replies queued so far still go out (e.g. the error explaining a refusal)
      writer_stop_ = true;
      cv_.notify_all();
      // Give the writer a moment to flush, then make sure the peer sees the end.
      cv_.wait_for(lock, std::chrono::seconds(1), [&] { return writer_done_.load(); });
    }
    // Send FIN after the last reply, and read off what the peer still sends for a moment:
    // closing a socket with unread input would reset it and could destroy that reply.
    ::shutdown(fd_, SHUT_WR);
    transport::SetRecvTimeout(fd_, 0.2);
    char sink[4096];
    for (size_t drained = 0; drained < (size_t{1} << 20);) {
      const ssize_t n = ::recv(fd_, sink, sizeof(sink), 0);
      if (n <= 0) break;
      drained += static_cast<size_t>(n);
    }
    ::shutdown(fd_, SHUT_RDWR);
    reader_done_.store(true);
  }

  int fd_;
  const std::string peer_;
  TcpShardServer* const server_;
  std::thread reader_;
  std::thread writer_;
  std::atomic<bool> reader_done_{false};
  std::atomic<bool> writer_done_{false};

  std::mutex mu_;  // guards the queue, the pool and the flags below
  std::condition_variable cv_;
  std::deque<Buffer> queue_;
  std::vector<Buffer> pool_;
  size_t pool_bytes_ = 0;  // capacity held by pool_
  static constexpr size_t kPoolBuffers = 16;
  static constexpr size_t kSmallFrame = 256;
  static constexpr size_t kPoolBytes = size_t{64} << 20;
  size_t queued_bytes_ = 0;
  bool closed_ = false;       // no more replies accepted
  bool writer_stop_ = false;  // the writer exits once the queue is empty
  bool writing_ = false;      // the writer is writing a buffer outside the lock
};

TcpShardServer::TcpShardServer(std::shared_ptr<transport::FrameHandler> shard,
                               TcpServerOptions options)
    : shard_(std::move(shard)),
      options_(std::move(options)),
      listener_(options_.host, options_.port) {
  if (!shard_) throw ValueError("TcpShardServer needs a shard");
  if (options_.job_token.size() > protocol::wire::kMaxTokenBytes) {
    throw ValueError("job_token is longer than " + std::to_string(protocol::wire::kMaxTokenBytes) +
                     " bytes");
  }
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

TcpShardServer::~TcpShardServer() { Stop(0); }

void TcpShardServer::NoteViolation(const std::string& peer) {
  const uint64_t n = closed_by_server_.fetch_add(1) + 1;
  const auto& log = shard_->log();
  if (log && (n <= 10 || n % 10000 == 0)) {
    log("closed connection from " + peer + ": protocol or authentication violation (" +
        std::to_string(n) + " so far)");
  }
}

void TcpShardServer::AcceptLoop() {
  while (!stop_accepting_.load()) {
    transport::Socket s = listener_.Accept(100, nullptr, /*nonblocking=*/false);
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked(false);
    if (!s.valid() || stop_accepting_.load()) continue;
    if (conns_.size() >= options_.max_connections) {
      refused_.fetch_add(1);
      continue;  // s closes the connection
    }
    auto conn = std::make_shared<Connection>(s.Release(), this);
    conns_.push_back(conn);
    accepted_.fetch_add(1);
    conn->Start();
  }
}

void TcpShardServer::ReapLocked(bool all) {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (all || (*it)->finished()) {
      if (all) (*it)->ShutdownSocket();
      (*it)->Join();
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpShardServer::Stop(double drain_timeout) {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (stopped_.load()) return;
  stop_accepting_.store(true);
  listener_.Close();
  if (acceptor_.joinable()) acceptor_.join();
  const auto deadline = DeadlineAfter(drain_timeout > 0 ? drain_timeout : 1e-6);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ReapLocked(false);
      if (conns_.empty()) break;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ReapLocked(true);
  }
  stopped_.store(true);
}

ServerStats TcpShardServer::stats() {
  ServerStats s;
  s.accepted = accepted_.load();
  s.refused = refused_.load();
  s.frames = frames_.load();
  s.bytes_in = bytes_in_.load();
  s.bytes_out = bytes_out_.load();
  s.closed_by_server = closed_by_server_.load();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& c : conns_) s.active += !c->finished();
  return s;
}

}  // namespace bagpipe::server
