// The rdma backend's entry points that exist in every build. With UCX (BAGPIPE_HAVE_UCX)
// they reach ucx_channel.h; without it they explain which library is missing.
//
// Thread safety: free functions, thread-safe.
// Invariants:
//   1. RdmaAvailable() == RdmaUnavailableReason().empty(), fixed for the build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/channel.h"

namespace bagpipe::transport {

// Whether this build has the rdma (UCX) transport.
bool RdmaAvailable();
// The UCX library version in use ("1.13.1"), or "" without UCX.
std::string RdmaLibraryVersion();
// Why ps_type="rdma" cannot be used in this build ("" when it can).
std::string RdmaUnavailableReason();

// Connects a channel of the rdma backend to the shard's UCX listener at host:port.
// Transports and devices come from UCX_TLS / UCX_NET_DEVICES (UCX defaults when unset).
// Throws std::runtime_error (RdmaUnavailableReason) in a build without UCX; otherwise as
// UcxChannel::Connect.
std::unique_ptr<Channel> ConnectRdmaChannel(const std::string& host, uint16_t port,
                                            const std::string& job_token,
                                            const ChannelOptions& options,
                                            double connect_timeout);

}  // namespace bagpipe::transport
