#include "testing/frame_fuzzer.h"

#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "common/errors.h"

namespace bagpipe::testing {

namespace wire = protocol::wire;
using wire::MsgType;
using Bytes = FrameMutator::Bytes;

FrameFuzzer::FrameFuzzer(std::string token, uint64_t seed, bool random_routing,
                         unsigned persistent_percent, bool unauthenticated_closing)
    : m_(std::move(token), seed, random_routing),
      persistent_percent_(persistent_percent),
      unauthenticated_closing_(unauthenticated_closing) {}

void FrameFuzzer::Run(uint64_t frames) {
  while (stats_.frames < frames) {
    if (U(100) < persistent_percent_) {
      PersistentFrame();
    } else {
      ClosingFrame();
    }
  }
}

void FrameFuzzer::Accepted(const std::string& what) {
  if (stats_.accepted++ == 0) stats_.first_accepted = what;
}

void FrameFuzzer::Count(FuzzOutcome outcome, const std::string& what) {
  switch (outcome) {
    case FuzzOutcome::kOk: Accepted(what); break;
    case FuzzOutcome::kError: ++stats_.error_replies; break;
    case FuzzOutcome::kClosed: ++stats_.closed_by_server; break;
    case FuzzOutcome::kTimeout: ++stats_.timeouts; break;
  }
}

// An Open with exactly one structural defect (ParseOpen must refuse it).
FuzzFrame FrameFuzzer::BrokenOpen() {
  wire::OpenBody o{};
  o.session = m_.Next();
  o.world_size = 1 + static_cast<uint32_t>(U(4));
  o.rank = static_cast<uint32_t>(U(o.world_size));
  o.dim = 1 + static_cast<uint32_t>(U(64));
  o.init_kind = static_cast<uint8_t>(U(3));
  o.key_bound = -1;
  o.start_step = -1;
  char name_buf[24];
  std::snprintf(name_buf, sizeof(name_buf), "t%u", static_cast<unsigned>(U(1000)));
  std::string name(name_buf);
  int extra_name = 0;
  switch (U(11)) {
    case 0: extra_name = 1 + static_cast<int>(U(5)); break;  // name_len beyond the body
    case 1: o.world_size = 0; o.rank = 0; break;
    case 2: o.rank = o.world_size + static_cast<uint32_t>(U(10)); break;
    case 3: o.dim = U(2) ? 0 : wire::kMaxDim + 1 + static_cast<uint32_t>(U(100)); break;
    case 4: o.grad_division = static_cast<uint8_t>(2 + U(250)); break;
    case 5: o.init_kind = static_cast<uint8_t>(3 + U(250)); break;
    case 6: name[U(name.size())] = "/ \x01*"[U(4)]; break;
    case 7:
      if (U(2)) {
        o.optimizer = static_cast<uint8_t>(wire::kMaxOptimizerKind + 1 + U(250));
      } else {
        o.eps = U(2) ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
      }
      break;
    case 8: o.num_bound_ranges = 1 + static_cast<uint32_t>(U(4)); break;  // ranges missing
    case 9: o.start_step = wire::kAnyStartStep - 1 - static_cast<int64_t>(U(1000)); break;
    default: o.key_bound = -2 - static_cast<int64_t>(U(1000)); break;
  }
  o.name_len = static_cast<uint16_t>(name.size() + extra_name);
  Bytes b;
  FrameMutator::Append(&b, o);
  FrameMutator::AppendBytes(&b, name.data(), name.size());
  return {m_.Frame(MsgType::kOpen, b), "open with a structural defect"};
}

// A frame that keeps the stream's framing intact but must be refused.
FuzzFrame FrameFuzzer::PersistentInvalid() {
  switch (U(8)) {
    case 0:
      return BrokenOpen();
    case 1:
      return {m_.Frame(MsgType::kCommit, m_.CommitBody()), "commit without a session"};
    case 2:
      return {m_.Frame(MsgType::kCommit, m_.BitFlippedCommitBody()),
              "bit-flipped commit without a session"};
    case 3: {
      Bytes b = m_.GetBody();
      if (U(3) == 0) b.resize(sizeof(wire::GetBody) + U(40));  // sometimes a wrong length too
      return {m_.Frame(MsgType::kGet, b), "get without a session"};
    }
    case 4:
      return {m_.Frame(MsgType::kAssign, m_.RandomBytes(16 + U(200))), "assign without a session"};
    case 5: {
      const size_t n = sizeof(wire::CloseBody) + 1 + U(40);  // too long
      return {m_.Frame(MsgType::kClose, m_.RandomBytes(n)), "close with a malformed body"};
    }
    case 6:
      return {m_.Frame(MsgType::kCheckpoint, m_.RandomBytes(U(2) ? 8 : 9 + U(30))),
              "checkpoint without a session"};
    default: {
      MsgType t;
      Bytes body = m_.RandomRequest(&t);
      return {m_.Frame(t, body), "random body of a request type"};
    }
  }
}

// A frame after which the server must close the connection.
FuzzFrame FrameFuzzer::ClosingInvalid(bool authenticated) {
  const uint64_t digest = m_.digest();
  FuzzFrame f;
  switch (U(9)) {
    case 0:
      f.what = "random bytes";
      f.bytes = m_.RandomBytes(1 + U(200));
      f.end_stream = true;  // a short one is an incomplete header: end the stream after it
      return f;
    case 1:
    case 2:
    case 3:
      f.bytes = m_.BrokenHeader(&f.what);
      return f;
    case 4:
      if (authenticated) {
        f.what = "reply type sent by a client";
        f.bytes = m_.Frame(MsgType::kAck, m_.RandomBytes(sizeof(wire::AckBody)));
      } else {
        f.what = "request before Hello";
        f.bytes = m_.Frame(MsgType::kPing, {});
      }
      return f;
    case 5:
      f.what = "stranger's token";
      f.bytes = m_.Hello(m_.token() + "x" + std::to_string(U(100)));
      return f;
    case 6:
      if (authenticated) {
        f.what = "another job's digest";
        f.bytes = m_.Frame(MsgType::kPing, {}, digest ^ (1 + U(1000)));
      } else {
        f.what = "hello with a mismatched digest";
        f.bytes = m_.Hello(m_.token());
        const uint64_t bad = digest ^ (1 + U(1000));
        std::memcpy(f.bytes.data() + 24, &bad, 8);
      }
      return f;
    default:
      return TransportViolation(authenticated);
  }
}

void FrameFuzzer::PersistentFrame() {
  if (!Usable()) {
    Drop();
    Connect(/*authenticate=*/true);
  }
  const FuzzFrame f = PersistentInvalid();
  ++stats_.frames;
  const FuzzOutcome outcome = Deliver(f);
  Count(outcome, f.what);
  if (outcome == FuzzOutcome::kClosed || outcome == FuzzOutcome::kTimeout) Drop();
}

void FrameFuzzer::ClosingFrame() {
  Drop();
  const bool authenticate = !unauthenticated_closing_ || U(2) == 0;
  Connect(authenticate);
  const FuzzFrame f = ClosingInvalid(authenticate);
  ++stats_.frames;
  // An error reply may come first; the connection must then close (invariant 2).
  FuzzOutcome outcome = Deliver(f);
  for (int i = 0; outcome == FuzzOutcome::kError && i < 4; ++i) {
    ++stats_.error_replies;
    outcome = Next();
  }
  if (outcome == FuzzOutcome::kError) outcome = FuzzOutcome::kTimeout;  // never closed
  Count(outcome, f.what);
  Drop();
}

}  // namespace bagpipe::testing
