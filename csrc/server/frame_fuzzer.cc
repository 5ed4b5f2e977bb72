#include "server/frame_fuzzer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "commit/wire.h"
#include "common/errors.h"
#include "transport/socket_io.h"

namespace bagpipe::server {
namespace {

using commit::wire::FrameHeader;
using commit::wire::kHeaderBytes;
using commit::wire::MsgType;
using commit::wire::Status;
using Bytes = std::vector<uint8_t>;

class Fuzzer {
 public:
  Fuzzer(const std::string& host, uint16_t port, const std::string& token, uint64_t seed)
      : host_(host), port_(port), token_(token), digest_(commit::wire::TokenDigest(token)), rng_(seed) {}

  ~Fuzzer() { Drop(); }

  void Run(uint64_t frames) {
    while (stats_.frames < frames) {
      const uint64_t roll = rng_() % 100;
      if (roll < 88) {
        PersistentFrame();
      } else {
        ClosingFrame();
      }
    }
  }

  FuzzStats stats_;

 private:
  uint64_t U(uint64_t n) { return n ? rng_() % n : 0; }

  Bytes Frame(MsgType type, const Bytes& body, uint64_t job) {
    Bytes f(kHeaderBytes + body.size());
    commit::wire::StoreHeader(f.data(), commit::wire::MakeHeader(type, job, body.size(), Status::kOk,
                                                                 rng_(), static_cast<uint32_t>(U(16))));
    if (!body.empty()) std::memcpy(f.data() + kHeaderBytes, body.data(), body.size());
    return f;
  }

  template <typename T>
  static void Append(Bytes* b, const T& v) {
    const size_t at = b->size();
    b->resize(at + sizeof(T));
    std::memcpy(b->data() + at, &v, sizeof(T));
  }
  static void AppendBytes(Bytes* b, const void* p, size_t n) {
    const size_t at = b->size();
    b->resize(at + n);
    if (n) std::memcpy(b->data() + at, p, n);
  }

  Bytes Hello(const std::string& token) {
    Bytes b;
    commit::wire::HelloBody h{static_cast<uint32_t>(token.size()), 0};
    Append(&b, h);
    AppendBytes(&b, token.data(), token.size());
    return Frame(MsgType::kHello, b, commit::wire::TokenDigest(token));
  }

  Bytes RandomBytes(size_t n) {
    Bytes b(n);
    for (auto& c : b) c = static_cast<uint8_t>(rng_());
    return b;
  }

  // A structurally valid Commit body with random content (rejected: no session is open).
  Bytes CommitBody() {
    commit::wire::CommitBody c{};
    c.session = rng_();
    c.world_size = 1 + static_cast<uint32_t>(U(4));
    c.rank = static_cast<uint32_t>(U(c.world_size));
    c.chunk_count = 1 + static_cast<uint32_t>(U(3));
    c.chunk_index = static_cast<uint32_t>(U(c.chunk_count));
    c.dim = 1 + static_cast<uint32_t>(U(8));
    c.lr = 0.1f;
    c.step = static_cast<int64_t>(U(5));
    c.nrows = static_cast<uint32_t>(U(4));
    Bytes b;
    Append(&b, c);
    Bytes rest = RandomBytes(size_t{c.nrows} * (8 + size_t{c.dim} * 4));
    AppendBytes(&b, rest.data(), rest.size());
    return b;
  }

  // An Open body with exactly one structural defect (ParseOpen must refuse it).
  Bytes BrokenOpenBody() {
    commit::wire::OpenBody o{};
    o.session = rng_();
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
    Append(&b, o);
    AppendBytes(&b, name.data(), name.size());
    return b;
  }

  // A frame that keeps the stream's framing intact but must be refused.
  Bytes PersistentInvalid(std::string* what) {
    switch (U(8)) {
      case 0: {
        *what = "open with a structural defect";
        return Frame(MsgType::kOpen, BrokenOpenBody(), digest_);
      }
      case 1: {
        *what = "commit without a session";
        return Frame(MsgType::kCommit, CommitBody(), digest_);
      }
      case 2: {
        *what = "bit-flipped commit without a session";
        Bytes body = CommitBody();
        for (int i = 0, n = 1 + static_cast<int>(U(8)); i < n; ++i) body[U(body.size())] ^= 1 << U(8);
        return Frame(MsgType::kCommit, body, digest_);
      }
      case 3: {
        *what = "get without a session";
        commit::wire::GetBody g{rng_(), static_cast<int64_t>(U(10)) - 1,
                                static_cast<uint32_t>(U(4)), 1 + static_cast<uint32_t>(U(8))};
        Bytes b;
        Append(&b, g);
        Bytes keys = RandomBytes(size_t{g.nrows} * 8);
        AppendBytes(&b, keys.data(), keys.size());
        if (U(3) == 0) b.resize(sizeof(g) + U(40));  // sometimes a wrong length too
        return Frame(MsgType::kGet, b, digest_);
      }
      case 4: {
        *what = "assign without a session";
        return Frame(MsgType::kAssign, RandomBytes(16 + U(200)), digest_);
      }
      case 5: {
        *what = "close with a malformed body";
        const size_t n = sizeof(commit::wire::CloseBody) + 1 + U(40);  // too long
        return Frame(MsgType::kClose, RandomBytes(n), digest_);
      }
      case 6: {
        *what = "checkpoint without a session";
        return Frame(MsgType::kCheckpoint, RandomBytes(U(2) ? 8 : 9 + U(30)), digest_);
      }
      default: {
        *what = "random body of a request type";
        const MsgType types[] = {MsgType::kCommit, MsgType::kGet, MsgType::kAssign};
        Bytes body = RandomBytes(U(300));
        const MsgType t = types[U(3)];
        if (body.size() < commit::wire::FixedBodyBytes(t)) body.resize(commit::wire::FixedBodyBytes(t));
        return Frame(t, body, digest_);
      }
    }
  }

  // A frame after which the server must close the connection.
  Bytes ClosingInvalid(bool authenticated, std::string* what, bool* truncate) {
    *truncate = false;
    switch (U(9)) {
      case 0:
        *what = "random bytes";
        *truncate = true;  // a short one is an incomplete header: end the stream after it
        return RandomBytes(1 + U(200));
      case 1: {
        *what = "bad magic";
        Bytes f = Frame(MsgType::kPing, {}, digest_);
        f[U(4)] ^= static_cast<uint8_t>(1 + U(255));
        return f;
      }
      case 2: {
        *what = "unsupported version";
        Bytes f = Frame(MsgType::kPing, {}, digest_);
        const uint16_t v = static_cast<uint16_t>(2 + U(60000));
        std::memcpy(f.data() + 4, &v, 2);
        return f;
      }
      case 3: {
        *what = "unknown type";
        Bytes f = Frame(MsgType::kPing, {}, digest_);
        const uint16_t t = static_cast<uint16_t>(20 + U(60000));
        std::memcpy(f.data() + 6, &t, 2);
        return f;
      }
      case 4: {
        *what = "oversized body_len";
        Bytes f = Frame(MsgType::kCommit, {}, digest_);
        const uint64_t len = (uint64_t{1} << 40) + U(1000);
        std::memcpy(f.data() + 32, &len, 8);
        return f;
      }
      case 5:
        *what = authenticated ? "reply type sent by a client" : "request before Hello";
        if (authenticated) return Frame(MsgType::kAck, RandomBytes(sizeof(commit::wire::AckBody)), digest_);
        return Frame(MsgType::kPing, {}, digest_);
      case 6:
        *what = "stranger's token";
        return Hello(token_ + "x" + std::to_string(U(100)));
      case 7: {
        *what = "truncated frame";
        *truncate = true;
        Bytes f = Frame(MsgType::kCommit, CommitBody(), digest_);
        f.resize(1 + U(f.size() - 1));
        return f;
      }
      default: {
        *what = authenticated ? "another job's digest" : "hello with a mismatched digest";
        if (authenticated) return Frame(MsgType::kPing, {}, digest_ ^ (1 + U(1000)));
        Bytes f = Hello(token_);
        const uint64_t bad = digest_ ^ (1 + U(1000));
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
    const Bytes f = Hello(token_);
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
  const std::string token_;
  const uint64_t digest_;
  std::mt19937_64 rng_;
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
