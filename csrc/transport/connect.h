// The endpoint -> channel choice: how a client reaches each shard. A ShardEndpoint names a
// shard the way a caller knows it (a handler in this process, a TCP address, a UCX
// address); ConnectChannel picks the backend and connects it.
//
// Thread safety: free functions; each call owns the channel it builds until it returns it.
//
// Invariants:
//   1. kLocal reaches the handler by direct calls (local_channel.h), kTcp over a TCP
//      connection (tcp_channel.h), kRdma through UCX (rdma.h; a build without UCX throws
//      std::runtime_error naming the missing library). No other backend is chosen.
//   2. A channel is returned only connected and authenticated; on any failure nothing is
//      left open.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/channel.h"
#include "transport/frame_handler.h"

namespace bagpipe::transport {

struct ShardEndpoint {
  enum class Kind : uint8_t { kLocal = 0, kTcp = 1, kRdma = 2 };

  Kind kind = Kind::kTcp;
  std::shared_ptr<FrameHandler> local;  // kLocal
  std::string host;                     // kTcp, kRdma
  uint16_t port = 0;                    // kTcp, kRdma

  // An endpoint of that kind (checked only by ConnectChannel).
  static ShardEndpoint Local(std::shared_ptr<FrameHandler> handler);
  static ShardEndpoint Tcp(std::string host, uint16_t port);
  static ShardEndpoint Rdma(std::string host, uint16_t port);
};

// Connects to `endpoint` (invariant 1) within connect.connect_timeout seconds. Throws
// ValueError (no handler for kLocal, a token too long), TimeoutError, TransportError, and
// std::runtime_error for kRdma in a build without UCX.
std::unique_ptr<Channel> ConnectChannel(const ShardEndpoint& endpoint,
                                        const ChannelOptions& options,
                                        const ConnectOptions& connect);

}  // namespace bagpipe::transport
