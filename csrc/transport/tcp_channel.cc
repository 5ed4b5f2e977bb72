#include "transport/tcp_channel.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <cstring>
#include <vector>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::transport {

using protocol::wire::FrameHeader;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;
using protocol::wire::Status;

std::unique_ptr<TcpChannel> TcpChannel::Connect(const std::string& host, uint16_t port,
                                                const std::string& job_token,
                                                const ChannelOptions& options,
                                                double connect_timeout) {
  if (job_token.size() > protocol::wire::kMaxTokenBytes) {
    throw ValueError("job_token is longer than " + std::to_string(protocol::wire::kMaxTokenBytes) +
                     " bytes");
  }
  const Deadline deadline = DeadlineAfter(connect_timeout);
  const std::string peer = "tcp " + host + ":" + std::to_string(port);
  for (int attempt = 1;; ++attempt) {
    const int fd = ConnectTcp(host, port, deadline).Release();
    std::unique_ptr<TcpChannel> ch(new TcpChannel(fd, peer, options));
    try {
      ch->Handshake(job_token, deadline);  // on failure ~TcpChannel closes the socket
    } catch (const TransportError&) {
      // A server under a connection flood may shed a connection before its Hello was read
      // (server/admission.h): the connection closes without an answer. Connect again
      // while the deadline allows; an answer (a refusal) is final.
      const auto backoff = std::chrono::milliseconds(std::min(100, 5 * attempt));
      if (ch->handshake_answered_ || Clock::now() + backoff >= deadline) throw;
      std::this_thread::sleep_for(backoff);
      continue;
    }
    ch->receiver_ = std::thread([raw = ch.get()] { raw->ReceiveLoop(); });
    return ch;
  }
}

TcpChannel::TcpChannel(int fd, std::string peer, const ChannelOptions& options)
    : Channel(std::move(peer), options), fd_(fd), io_timeout_(options.io_timeout),
      keepalive_(options.keepalive_interval),
      last_send_(Clock::now().time_since_epoch().count()) {}

TcpChannel::~TcpChannel() {
  Close();
  if (fd_ >= 0) ::close(fd_);
}

void TcpChannel::Handshake(const std::string& token, Deadline deadline) {
  const uint64_t digest = protocol::wire::TokenDigest(token);
  SetJobDigest(digest);
  std::vector<uint8_t> frame(kHeaderBytes + sizeof(protocol::wire::HelloBody) + token.size());
  protocol::wire::HelloBody hello{};
  hello.token_len = static_cast<uint32_t>(token.size());
  protocol::wire::StoreHeader(frame.data(), protocol::wire::MakeHeader(MsgType::kHello, digest,
                                                                   frame.size() - kHeaderBytes));
  std::memcpy(frame.data() + kHeaderBytes, &hello, sizeof(hello));
  std::memcpy(frame.data() + kHeaderBytes + sizeof(hello), token.data(), token.size());
  WriteAll(fd_, frame.data(), frame.size(), peer());

  const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
  SetRecvTimeout(fd_, left > 0.001 ? left : 0.001);
  uint8_t hb[kHeaderBytes];
  if (!ReadFull(fd_, hb, kHeaderBytes, true, peer())) {
    throw TransportError(peer() + " closed the connection during the handshake (not a PS shard?)");
  }
  handshake_answered_ = true;
  const FrameHeader h = protocol::wire::LoadHeader(hb);
  std::string why;
  if (!protocol::wire::CheckHeader(h, 1 << 16, &why)) {
    throw TransportError(peer() + " is not a torchrec_bagpipe PS shard speaking protocol " +
                         std::to_string(protocol::wire::kProtocolVersion) + ": " + why);
  }
  std::vector<uint8_t> body(h.body_len);
  ReadFull(fd_, body.data(), body.size(), false, peer());
  if (h.type == static_cast<uint16_t>(MsgType::kError)) {
    std::string text;
    if (body.size() > sizeof(protocol::wire::MessageBody)) {
      text.assign(reinterpret_cast<const char*>(body.data()) + sizeof(protocol::wire::MessageBody),
                  body.size() - sizeof(protocol::wire::MessageBody));
    }
    throw TransportError(peer() + " refused the connection: " + text);
  }
  if (h.type != static_cast<uint16_t>(MsgType::kHelloOk) || body.size() != sizeof(protocol::wire::HelloOkBody)) {
    throw TransportError(peer() + " answered the Hello with a " + protocol::wire::MsgTypeName(h.type));
  }
  const auto ok = protocol::wire::Load<protocol::wire::HelloOkBody>(body.data());
  if (ok.max_frame_bytes < slot_bytes()) {
    throw ValueError(peer() + " accepts frames of at most " + std::to_string(ok.max_frame_bytes) +
                     " bytes, smaller than this client's packets of " + std::to_string(slot_bytes()) +
                     " bytes: lower max_packet_rows");
  }
  SetRemote(ok.shard_id, ok.num_shards, ok.max_frame_bytes);
  remote_instance_ = ok.instance_id;
  SetRecvTimeout(fd_, 0);
  SetSendTimeout(fd_, io_timeout_);  // a shard that stops reading cannot block a send forever
}

void TcpChannel::DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) {
  (void)slot;
  std::lock_guard<std::mutex> lock(write_mu_);
  WriteAll(fd_, frame, frame_len, peer());
  last_send_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void TcpChannel::MaybeKeepAlive() {
  const auto now = Clock::now();
  const auto idle = now - Clock::time_point(Clock::duration(last_send_.load()));
  if (std::chrono::duration<double>(idle).count() < keepalive_) return;
  std::unique_lock<std::mutex> lock(write_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // a post is being written: that is traffic
  uint8_t frame[kHeaderBytes];
  protocol::wire::StoreHeader(frame, protocol::wire::MakeHeader(MsgType::kPing, job_digest(), 0,
                                                                Status::kOk, 0,
                                                                protocol::wire::kNoSlot));
  // A full socket buffer means the shard has traffic to read already: never block here.
  const ssize_t n = ::send(fd_, frame, sizeof(frame), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n <= 0) return;  // no room (or an error the read side reports): try again later
  // A partial write must be completed, or the stream would lose its framing (bounded by the
  // socket's send timeout, io_timeout).
  if (static_cast<size_t>(n) < sizeof(frame)) {
    WriteAll(fd_, frame + n, sizeof(frame) - static_cast<size_t>(n), peer());
  }
  last_send_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
}

void TcpChannel::DoPostGather(uint32_t slot, const uint8_t* head, size_t head_len,
                              const ConstSpan* extra, size_t n_extra) {
  (void)slot;
  constexpr size_t kMaxPieces = 16;
  if (n_extra + 1 > kMaxPieces) throw ValueError("a gathered frame has too many pieces");
  struct iovec iov[kMaxPieces];
  int n = 0;
  iov[n++] = {const_cast<uint8_t*>(head), head_len};
  for (size_t i = 0; i < n_extra; ++i) {
    if (extra[i].len) iov[n++] = {const_cast<uint8_t*>(extra[i].data), extra[i].len};
  }
  std::lock_guard<std::mutex> lock(write_mu_);
  WriteAllV(fd_, iov, n, peer());
  last_send_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

void TcpChannel::DoClose() {
  closing_.store(true);
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  if (receiver_.joinable()) receiver_.join();
}

void TcpChannel::ReceiveLoop() {
  std::vector<uint8_t> scratch;
  FrameReader in(fd_, peer());
  const int wake_ms = keepalive_ > 0 ? static_cast<int>(std::max(100.0, keepalive_ * 250.0)) : -1;
  try {
    for (;;) {
      if (wake_ms > 0 && in.buffered() == 0) {
        // Between frames: wait for the next one, waking now and then to keep the
        // connection alive (invariant 3).
        pollfd p{fd_, POLLIN, 0};
        const int rc = ::poll(&p, 1, wake_ms);
        if (rc == 0) {
          if (closing_.load()) return;
          MaybeKeepAlive();
          continue;
        }
        if (rc < 0 && errno == EINTR) continue;
      }
      ReceiveOne(&in, &scratch);
    }
  } catch (const std::exception& e) {
    if (closing_.load()) return;
    FailChannel({ErrorKind::kTransport, std::string("connection lost: ") + e.what()});
  }
}

void TcpChannel::ReceiveOne(FrameReader* in, std::vector<uint8_t>* scratch) {
  uint8_t hb[kHeaderBytes];
  if (!in->Read(hb, kHeaderBytes, true)) {
    throw TransportError("the shard closed the connection");
  }
  const FrameHeader h = protocol::wire::LoadHeader(hb);
  std::string why;
  const uint64_t max_body = std::max<uint64_t>(remote_max_frame(), 1 << 16);
  if (!protocol::wire::CheckHeader(h, max_body, &why)) throw TransportError("malformed reply: " + why);
  if (h.job != job_digest()) throw TransportError("a reply carries another job's token digest");
  const auto type = static_cast<MsgType>(h.type);
  if (protocol::wire::IsRequestType(type)) {
    throw TransportError(std::string("the shard sent a request frame (") +
                         protocol::wire::MsgTypeName(h.type) + ")");
  }
  uint8_t fixed[64];
  const size_t fixed_len = protocol::wire::FixedBodyBytes(type);
  in->Read(fixed, fixed_len, false);
  const size_t payload_len = h.body_len - fixed_len;
  Reply r;
  r.header = h;
  r.fixed = fixed;
  r.fixed_len = fixed_len;
  r.payload_len = payload_len;
  if (h.slot == protocol::wire::kNoSlot) {
    if (payload_len > protocol::wire::kMaxMessageBytes) throw TransportError("oversized notification");
    scratch->resize(payload_len);
    in->Read(scratch->data(), payload_len, false);
    r.payload = scratch->data();
    CountReceived(kHeaderBytes + h.body_len);
    DeliverNotification(r);
    return;
  }
  auto request = Expect(h);
  if (!request) throw TransportError("stray reply");  // the channel has already failed
  uint8_t* sink = payload_len ? request->ReplySink(r, payload_len) : nullptr;
  if (sink == nullptr && payload_len) sink = ReplyBuffer(h.slot, payload_len);
  in->Read(sink, payload_len, false);
  r.payload = sink;
  CountReceived(kHeaderBytes + h.body_len);
  Complete(request, r);
}

}  // namespace bagpipe::transport
