// RawLink: a ServerLink driven by hand, for protocol tests (tests/test_ps_protocol.py drives
// one from Python through torchrec_bagpipe.testing._C_testing.RawLink): request frames go to
// a FrameHandler as bytes, and every frame the handler sends back is recorded as bytes
// (header + body) until taken. No backend is involved, so a test sees exactly what the
// handler answers.
//
// Thread safety: every method is thread-safe. Request delivers one frame at a time per link
// (callers must not call it concurrently on one link, like any backend).
//
// Invariants:
//   1. Recorded frames are in send order, each exactly the bytes a backend would carry
//      (header with job digest and body_len filled in, then fixed body and payload).
//   2. After Close, nothing more is recorded (Send returns false) and the handler saw
//      LinkClosed exactly once.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/frame_handler.h"

namespace bagpipe::testing {

class RawLink : public transport::ServerLink {
 public:
  // REQUIRES: handler != nullptr. `authenticated`: start as if a Hello had succeeded.
  RawLink(std::shared_ptr<transport::FrameHandler> handler, bool authenticated);

  // Records the frame (invariant 1); false once closed (invariant 2).
  bool Send(protocol::wire::MsgType type, protocol::wire::Status status, uint64_t tag,
            uint32_t slot, const void* fixed, size_t fixed_len, size_t payload_len,
            const transport::PayloadFill& fill) override;
  // "raw", for log lines.
  std::string Describe() const override { return "raw"; }

  // Hands one frame (header + body bytes) to the handler; returns whether the link stays
  // open. Throws ValueError for bytes that are not one whole frame. `self` is this link.
  bool Request(const std::string& frame, const std::shared_ptr<RawLink>& self);
  // The frames recorded since the last Take, oldest first.
  std::vector<std::string> Take();
  // The connection ends: the handler's LinkClosed runs (once).
  void Close();

 private:
  const std::shared_ptr<transport::FrameHandler> handler_;
  std::mutex mu_;  // guards frames_ and closed_
  std::deque<std::string> frames_;
  bool closed_ = false;
};

}  // namespace bagpipe::testing
