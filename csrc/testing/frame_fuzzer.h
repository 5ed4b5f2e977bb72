// The frame-fuzzing framework shared by the TCP and UCX shard servers: it sends frames that
// are each constructed to be invalid (a malformed header or body, a request that needs a
// session the fuzzer never opens, a stranger's token, a transport-level defect such as a
// truncated stream or a frame that does not match its doorbell) and counts how the server
// answers. Every one must be refused — an error reply, or the connection closed — none
// accepted, none left unanswered, and the server must keep serving. The catalogue of invalid
// frames lives here once; a transport (tcp_fuzzer.h, ucx_fuzzer.h) only says how a frame
// reaches the server and how its answer comes back, and adds its own transport-level defects.
//
// Thread safety: a FrameFuzzer is used by one thread; it owns its connections.
//
// Invariants:
//   1. Every frame sent is counted once in frames, and its outcome once: error_replies
//      (possibly several, for a closing violation), closed_by_server, accepted or timeouts.
//   2. A "persistent" invalid frame keeps the stream's framing intact (the connection may stay
//      open); a "closing" one must end the connection (after at most one error reply).
//   3. The sequence of frames is a pure function of (seed, transport): a failure replays.
#pragma once

#include <cstdint>
#include <string>

#include "testing/frame_mutator.h"

namespace bagpipe::testing {

struct FuzzStats {
  uint64_t bootstraps = 0;          // malformed UCX bootstraps (control port; UCX only)
  uint64_t bootstraps_refused = 0;  // answered with an error status or closed
  uint64_t frames = 0;              // invalid frames (or frame fragments) sent
  uint64_t connections = 0;         // connections opened
  uint64_t error_replies = 0;       // frames answered with an error status
  uint64_t closed_by_server = 0;    // connections the server closed after a violation
  uint64_t accepted = 0;            // inputs answered with status ok (must stay 0)
  uint64_t timeouts = 0;            // neither answered nor closed within 5 s (must stay 0)
  std::string first_accepted;       // what the first accepted input was, for the message
};

// How the server answered one frame.
enum class FuzzOutcome : uint8_t { kOk = 0, kError = 1, kClosed = 2, kTimeout = 3 };

// A frame constructed to be refused, with the transport-level defect of its delivery.
struct FuzzFrame {
  FrameMutator::Bytes bytes;
  std::string what;           // names the defect, for the first_accepted message
  bool end_stream = false;    // stream transports: stop writing after it (a truncated stream)
  uint64_t tag_delta = 0;     // ring transports: the doorbell names another tag than the header
  size_t extra_bytes = 0;     // ring transports: the doorbell announces more bytes than the frame
};

class FrameFuzzer {
 public:
  virtual ~FrameFuzzer() = default;
  FrameFuzzer(const FrameFuzzer&) = delete;
  FrameFuzzer& operator=(const FrameFuzzer&) = delete;

  // Sends `frames` invalid frames: persistent_percent of them persistent, the rest closing
  // (each on a fresh connection). Throws TransportError if the server cannot be reached or
  // refuses the fuzzer's own token.
  void Run(uint64_t frames);
  const FuzzStats& stats() const { return stats_; }

 protected:
  // `token`: the server's job token (so post-handshake parsing is fuzzed too).
  // `random_routing`: see FrameMutator. `unauthenticated_closing`: half of the closing
  // frames go to a connection that never said Hello (transports where that is possible).
  FrameFuzzer(std::string token, uint64_t seed, bool random_routing,
              unsigned persistent_percent, bool unauthenticated_closing);

  FrameMutator& mutator() { return m_; }
  uint64_t U(uint64_t n) { return m_.U(n); }
  // Counts an input answered with status ok (keeps the first one's description).
  void Accepted(const std::string& what);

  // ---- the transport -------------------------------------------------------------------
  // Opens a fresh connection (counted in stats_.connections); with `authenticate`, then says
  // Hello with the server's own token and requires HelloOk (TransportError otherwise).
  virtual void Connect(bool authenticate) = 0;
  virtual void Drop() = 0;
  // Connected, authenticated and not broken.
  virtual bool Usable() const = 0;
  // Delivers `f` (with its defect) and waits up to 5 s for the first answer.
  virtual FuzzOutcome Deliver(const FuzzFrame& f) = 0;
  // After an error reply: waits up to 5 s for the next answer (or the close).
  virtual FuzzOutcome Next() = 0;
  // One of this transport's own closing violations (chosen with U()).
  virtual FuzzFrame TransportViolation(bool authenticated) = 0;

  FuzzStats stats_;

 private:
  FuzzFrame BrokenOpen();
  FuzzFrame PersistentInvalid();
  FuzzFrame ClosingInvalid(bool authenticated);
  void PersistentFrame();
  void ClosingFrame();
  void Count(FuzzOutcome outcome, const std::string& what);

  FrameMutator m_;
  const unsigned persistent_percent_;
  const bool unauthenticated_closing_;
};

}  // namespace bagpipe::testing
