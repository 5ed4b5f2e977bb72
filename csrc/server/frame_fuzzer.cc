#include "server/frame_fuzzer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "commit/frame_mutator.h"
#include "commit/wire.h"
#include "common/errors.h"
#include "transport/socket_io.h"

namespace bagpipe::server {
namespace {

using commit::wire::FrameHeader;
using commit::wire::FrameMutator;
using commit::wire::kHeaderBytes;
using commit::wire::MsgType;
using commit::wire::Status;
using Bytes = FrameMutator::Bytes;

class Fuzzer {
 public:
  Fuzzer(const std::string& host, uint16_t port, const std::string& token, uint64_t seed)
      : host_(host), port_(port), m_(token, seed, /*random_routing=*/true) {}

  ~Fuzzer() { Drop(); }

  void Run(uint64_t frames) {
    while (stats_.frames < frames) {
      const uint64_t roll = m_.Next() % 100;
      if (roll < 88) {
        PersistentFrame();
      } else {
        ClosingFrame();
      }
    }
  }

  FuzzStats stats_;

 private:
  uint64_t U(uint64_t n) { return m_.U(n); }

  // An Open body with exactly one structural defect (ParseOpen must refuse it).
  Bytes BrokenOpenBody() {
    commit::wire::OpenBody o{};
    o.session = m_.Next();
    o.world_size = 1 + static_cast<uint32_t>(U(4));
    o.rank = static_cast<uint32_t>(U(o.world_size));
    o.dim = 1 + static_cast<uint32_t>(U(64));
    o.lr = 0.5f;
    o.init_kind = static_cast<uint8_t>(U(3));
    o.key_bound = -1;
    char name_buf[24];
    std::snprintf(name_buf, sizeof(name_buf), "t%u", static_cast<unsigned>(U(1000)));
    std::string name(name_buf);
    int extra_name = 0;
    switch (U(10)) {
      case 0: extra_name = 1 + static_cast<int>(U(5)); break;  // name_len beyond the body
      case 1: o.world_size = 0; o.rank = 0; break;
      case 2: o.rank = o.world_size + static_cast<uint32_t>(U(10)); break;
      case 3: o.dim = U(2) ? 0 : commit::wire::kMaxDim + 1 + static_cast<uint32_t>(U(100)); break;
      case 4: o.grad_division = static_cast<uint8_t>(2 + U(250)); break;
      case 5: o.init_kind = static_cast<uint8_t>(3 + U(250)); break;
      case 6: name[U(name.size())] = "/ \x01*"[U(4)]; break;
      case 7: o.lr = U(2) ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity(); break;
      case 8: o.num_bound_ranges = 1 + static_cast<uint32_t>(U(4)); break;  // ranges missing
      default: o.key_bound = -2 - static_cast<int64_t>(U(1000)); break;
    }
    o.name_len = static_cast<uint16_t>(name.size() + extra_name);
    Bytes b;
    FrameMutator::Append(&b, o);
    FrameMutator::AppendBytes(&b, name.data(), name.size());
    return b;
  }

  // A frame that keeps the stream's framing intact but must be refused.
  Bytes PersistentInvalid(std::string* what) {
    switch (U(8)) {
      case 0:
        *what = "open with a structural defect";
        return m_.Frame(MsgType::kOpen, BrokenOpenBody());
      case 1:
        *what = "commit without a session";
        return m_.Frame(MsgType::kCommit, m_.CommitBody());
      case 2:
        *what = "bit-flipped commit without a session";
        return m_.Frame(MsgType::kCommit, m_.BitFlippedCommitBody());
      case 3: {
        *what = "get without a session";
        Bytes b = m_.GetBody();
        if (U(3) == 0) b.resize(sizeof(commit::wire::GetBody) + U(40));  // sometimes a wrong length too
        return m_.Frame(MsgType::kGet, b);
      }
      case 4:
        *what = "assign without a session";
        return m_.Frame(MsgType::kAssign, m_.RandomBytes(16 + U(200)));
      case 5: {
        *what = "close with a malformed body";
        const size_t n = sizeof(commit::wire::CloseBody) + 1 + U(40);  // too long
        return m_.Frame(MsgType::kClose, m_.RandomBytes(n));
      }
      case 6:
        *what = "checkpoint without a session";
        return m_.Frame(MsgType::kCheckpoint, m_.RandomBytes(U(2) ? 8 : 9 + U(30)));
      default: {
        *what = "random body of a request type";
        MsgType t;
        Bytes body = m_.RandomRequest(&t);
        return m_.Frame(t, body);
      }
    }
  }

  // A frame after which the server must close the connection.
  Bytes ClosingInvalid(bool authenticated, std::string* what, bool* truncate) {
    *truncate = false;
    const uint64_t digest = m_.digest();
    switch (U(9)) {
      case 0:
        *what = "random bytes";
        *truncate = true;  // a short one is an incomplete header: end the stream after it
        return m_.RandomBytes(1 + U(200));
      case 1:
      case 2:
      case 3:
        return m_.BrokenHeader(what);
      case 4: {
        *what = "oversized body_len";
        Bytes f = m_.Frame(MsgType::kCommit, {});
        const uint64_t len = (uint64_t{1} << 40) + U(1000);
        std::memcpy(f.data() + 32, &len, 8);
        return f;
      }
      case 5:
        *what = authenticated ? "reply type sent by a client" : "request before Hello";
        if (authenticated) return m_.Frame(MsgType::kAck, m_.RandomBytes(sizeof(commit::wire::AckBody)));
        return m_.Frame(MsgType::kPing, {});
      case 6:
        *what = "stranger's token";
        return m_.Hello(m_.token() + "x" + std::to_string(U(100)));
      case 7: {
        *what = "truncated frame";
        *truncate = true;
        Bytes f = m_.Frame(MsgType::kCommit, m_.CommitBody());
        f.resize(1 + U(f.size() - 1));
        return f;
      }
      default: {
        *what = authenticated ? "another job's digest" : "hello with a mismatched digest";
        if (authenticated) return m_.Frame(MsgType::kPing, {}, digest ^ (1 + U(1000)));
        Bytes f = m_.Hello(m_.token());
        const uint64_t bad = digest ^ (1 + U(1000));
        std::memcpy(f.data() + 24, &bad, 8);
        return f;
      }
    }
  }

  void Connect() {
    fd_ = transport::ConnectTcp(host_, port_, transport::DeadlineAfter(10));
    transport::SetRecvTimeout(fd_, 5.0);
    ++stats_.connections;
    authenticated_ = false;
  }

  void Drop() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    authenticated_ = false;
  }

  // Reads one reply; false on EOF / reset. Sets *status.
  bool ReadReply(Status* status, MsgType* type) {
    uint8_t hb[kHeaderBytes];
    try {
      if (!transport::ReadFull(fd_, hb, kHeaderBytes, true, "fuzz")) return false;
      const FrameHeader h = commit::wire::LoadHeader(hb);
      if (h.body_len > (1u << 20)) return false;
      Bytes body(h.body_len);
      transport::ReadFull(fd_, body.data(), body.size(), false, "fuzz");
      *status = static_cast<Status>(h.status);
      *type = static_cast<MsgType>(h.type);
      return true;
    } catch (const TimeoutError&) {
      ++stats_.timeouts;
      return false;
    } catch (const std::exception& e) {
      return false;
    }
  }

  void Authenticate() {
    if (fd_ < 0) Connect();
    const Bytes f = m_.Hello(m_.token());
    transport::WriteAll(fd_, f.data(), f.size(), "fuzz");
    Status st;
    MsgType t;
    if (!ReadReply(&st, &t) || st != Status::kOk || t != MsgType::kHelloOk) {
      throw TransportError("the fuzzer could not authenticate with the server's own token");
    }
    authenticated_ = true;
  }

  void PersistentFrame() {
    if (fd_ < 0 || !authenticated_) {
      Drop();
      Authenticate();
    }
    std::string what;
    const Bytes f = PersistentInvalid(&what);
    ++stats_.frames;
    try {
      transport::WriteAll(fd_, f.data(), f.size(), "fuzz");
    } catch (const std::exception&) {
      Drop();
      return;
    }
    Status st;
    MsgType t;
    if (!ReadReply(&st, &t)) {
      ++stats_.closed_by_server;
      Drop();
      return;
    }
    if (st == Status::kOk) {
      if (stats_.accepted_replies++ == 0) stats_.first_accepted = what;
    } else {
      ++stats_.error_replies;
    }
  }

  void ClosingFrame() {
    Drop();
    Connect();
    const bool auth = U(2) == 0;
    if (auth) Authenticate();
    std::string what;
    bool truncate;
    const Bytes f = ClosingInvalid(auth, &what, &truncate);
    ++stats_.frames;
    try {
      transport::WriteAll(fd_, f.data(), f.size(), "fuzz");
      if (truncate) ::shutdown(fd_, SHUT_WR);
    } catch (const std::exception&) {
      Drop();
      ++stats_.closed_by_server;
      return;
    }
    // Drain replies until the server closes; none may be a success.
    Status st;
    MsgType t;
    for (int i = 0; i < 4; ++i) {
      if (!ReadReply(&st, &t)) break;
      if (st == Status::kOk) {
        if (stats_.accepted_replies++ == 0) stats_.first_accepted = what;
      } else {
        ++stats_.error_replies;
      }
    }
    ++stats_.closed_by_server;
    Drop();
  }

  const std::string host_;
  const uint16_t port_;
  FrameMutator m_;
  int fd_ = -1;
  bool authenticated_ = false;
};

}  // namespace

FuzzStats FuzzServer(const std::string& host, uint16_t port, const std::string& job_token,
                     uint64_t frames, uint64_t seed) {
  Fuzzer f(host, port, job_token, seed);
  f.Run(frames);
  return f.stats_;
}

}  // namespace bagpipe::server
