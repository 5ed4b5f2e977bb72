// The tcp backend, client side: one TCP connection per (client, shard) carrying
// length-prefixed frames (protocol/wire.h). Connect() authenticates with a Hello carrying the
// job token before anything else; every later frame carries the token's digest. A receive
// thread reads replies through a FrameReader (small frames batched per recv); a GET reply's
// rows go straight from the socket into the request's sink (the caller's output tensor when
// it can be). A gathered post (a commit chunk's header from its slot, keys and gradients
// from the caller's tensors) is one sendmsg of all its pieces: no staging copy.
//
// Thread safety: as Channel. The socket is written only by the posting thread and read only
// by the receive thread.
// Invariants:
//   1. A reply that is malformed, carries another job's digest or answers no in-flight
//      request fails the channel (TransportError) instead of being guessed at.
//   2. When the shard goes away (EOF, reset), every request in flight fails at once with a
//      TransportError naming the shard; nothing waits for a timeout.
//   3. Connect retries (until connect_timeout) a connection closed before the Hello was
//      answered (a server shedding connections under a flood); an answer is final.
//   4. A channel that sent nothing for keepalive_interval sends a Ping with no slot (its Pong
//      comes back as a notification and is ignored), so the server's idle deadline only
//      closes connections whose client is gone. Writes are serialized by write_mu_; the
//      keep-alive never waits for it (a write in progress is traffic enough).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "transport/socket.h"
#include "transport/channel.h"

namespace bagpipe::transport {

class TcpChannel : public Channel {
 public:
  // Connects to host:port and authenticates within connect_timeout seconds. Throws
  // TimeoutError, TransportError (refused, wrong job token, not a PS shard).
  static std::unique_ptr<TcpChannel> Connect(const std::string& host, uint16_t port,
                                             const std::string& job_token,
                                             const ChannelOptions& options,
                                             double connect_timeout);
  // Close(), then the socket is closed.
  ~TcpChannel() override;

  const char* kind() const override { return "tcp"; }
  // The shard's instance id from its HelloOk (PSShard::instance_id).
  uint64_t remote_instance() const { return remote_instance_; }

 protected:
  void DoPost(uint32_t slot, const uint8_t* frame, size_t frame_len) override;
  bool CanGather() const override { return true; }
  void DoPostGather(uint32_t slot, const uint8_t* head, size_t head_len, const ConstSpan* extra,
                    size_t n_extra) override;
  void DoClose() override;

 private:
  TcpChannel(int fd, std::string peer, const ChannelOptions& options);
  void Handshake(const std::string& token, Deadline deadline);
  void ReceiveLoop();
  void ReceiveOne(FrameReader* in, std::vector<uint8_t>* scratch);

  void MaybeKeepAlive();

  int fd_;
  const double io_timeout_;
  const double keepalive_;
  std::mutex write_mu_;                  // one writer at a time (posts, keep-alives)
  std::atomic<int64_t> last_send_{0};    // Clock ticks of the last write
  uint64_t remote_instance_ = 0;
  bool handshake_answered_ = false;  // the shard answered the Hello (even with a refusal)
  std::atomic<bool> closing_{false};
  std::thread receiver_;
};

}  // namespace bagpipe::transport
