// Private declarations shared by the files of the UCX endpoint (ucx_endpoint.h): the UCX
// requests an endpoint owns and the messages it has received but not yet acted on. The
// endpoint is one idea in five files, one per phase: ucx_endpoint.cc (construction, the
// command queue and the public operations), ucx_endpoint_bootstrap.cc (the control-port
// handshake of both sides), ucx_endpoint_progress.cc (the progress loop: commands, worker
// progress, completions, incoming messages in sequence order), ucx_endpoint_ring.cc (the
// frame path: one-sided writes, flushes and doorbells, messages and their landings) and
// ucx_endpoint_teardown.cc (failure handling and teardown).
//
// Thread safety: every object here is touched only on the endpoint's progress thread (UCX
// completion callbacks run there too, inside ucp_worker_progress).
// Invariants:
//   1. An Op is in Endpoint::live_ops_ from NewOp until DeleteOp; the teardown frees the Ops
//      UCX never completed, after the worker is destroyed (ucx_endpoint.h invariant 4).
//   2. An Incoming with held == true still owns UCX data (released exactly once, or received
//      into its landing for a rendezvous).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "transport/ucx_endpoint.h"

namespace bagpipe::transport::ucx {

// A UCX request we own (flush, send, receive, get). Deleted on the progress thread once its
// completion was processed.
struct Endpoint::Op {
  enum class Kind : uint8_t { kFlush, kSend, kRecv, kGet } kind;
  explicit Op(Kind k) : kind(k) {}
  Endpoint* ep = nullptr;             // nullptr once orphaned (its endpoint is torn down)
  ProgressGroup* orphan_of = nullptr;  // the group holding it once orphaned
  ucs_status_t status = UCS_INPROGRESS;
  bool in_flight = false;  // a UCX request whose callback has not run
  bool done = false;
  std::vector<wire::DoorbellEntry> entries;     // kFlush: frames the flush covers
  std::vector<uint8_t> header;                  // kSend: prefix + head
  std::function<void(bool)> on_sent;            // kSend
  uint64_t delivery = 0;                        // kRecv
  std::shared_ptr<void> keepalive;              // kRecv: keeps the landing buffer alive
  std::vector<uint8_t> buffer;                  // kGet
  std::function<void(Op*)> finish;              // kGet
};

struct Endpoint::Incoming {
  unsigned am_id = 0;
  std::vector<uint8_t> head;
  void* data = nullptr;   // UCX-held data or rendezvous descriptor (held == true)
  size_t length = 0;
  bool rndv = false;
  bool held = false;
  std::vector<uint8_t> copy;  // data UCX did not let us keep
};

struct Endpoint::Delivery {
  uint64_t id = 0;
  bool landed = false;
  bool ok = false;
  std::function<void(bool)> done;
};

}  // namespace bagpipe::transport::ucx
