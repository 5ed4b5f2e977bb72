#include "transport/ucx_fuzzer.h"

#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

#include "commit/frame_mutator.h"
#include "commit/wire.h"
#include "common/errors.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_socket.h"
#include "transport/ucx_wire.h"

namespace bagpipe::transport {
namespace {

using commit::wire::FrameMutator;
using commit::wire::kHeaderBytes;
using commit::wire::MsgType;
using commit::wire::Status;
using Bytes = FrameMutator::Bytes;

constexpr size_t kSlotBytes = 4096;

class UcxFuzzer {
 public:
  UcxFuzzer(std::string host, uint16_t port, std::string token, uint64_t seed)
      : host_(std::move(host)), port_(port), m_(std::move(token), seed, /*random_routing=*/false),
        slot_(kSlotBytes) {}
  ~UcxFuzzer() { Drop(); }

  void Run(uint64_t bootstraps, uint64_t frames) {
    for (uint64_t i = 0; i < bootstraps; ++i) Bootstrap();
    while (stats.frames < frames) {
      if (U(100) < 96) {
        PersistentFrame();
      } else {
        ClosingFrame();
      }
    }
  }

  UcxFuzzStats stats;

 private:
  uint64_t U(uint64_t n) { return m_.U(n); }
  void Accepted(const std::string& what) {
    if (stats.accepted++ == 0) stats.first_accepted = what;
  }

  // ---- control port ---------------------------------------------------------------------------

  void Bootstrap() {
    ++stats.bootstraps;
    ucx::wire::BootHello h{};
    h.magic = ucx::wire::kBootMagic;
    h.version = ucx::wire::kBootVersion;
    h.num_slots = 1 + static_cast<uint32_t>(U(8));
    h.slot_bytes = 64 + U(4096);
    std::string token = m_.token();
    Bytes address = m_.RandomBytes(16 + U(100));  // never used: every hello below is refused
    Bytes raw;
    bool truncate = false;
    std::string what;
    switch (U(10)) {
      case 0: what = "random bytes"; raw = m_.RandomBytes(1 + U(200)); break;
      case 1: what = "bad magic"; h.magic ^= 1u + static_cast<uint32_t>(U(1000)); break;
      case 2: what = "bad version"; h.version = static_cast<uint16_t>(2 + U(1000)); break;
      case 3: what = "no slots"; h.num_slots = U(2) ? 0 : ucx::wire::kMaxSlots + 1 + static_cast<uint32_t>(U(1000)); break;
      case 4: what = "bad slot size"; h.slot_bytes = U(2) ? 0 : (uint64_t{1} << 40) + U(1000); break;
      case 5: what = "oversized token"; token.assign(ucx::wire::kMaxTokenBytes + 1 + U(100), 'x'); break;
      case 6: what = "bad address length"; address.resize(U(2) ? 0 : ucx::wire::kMaxWorkerAddress + 1); break;
      case 7: what = "truncated hello"; truncate = true; break;
      case 8: what = "ring too large"; h.num_slots = ucx::wire::kMaxSlots; h.slot_bytes = size_t{256} << 20; break;
      default: what = "stranger's token"; token = m_.token() + "x" + std::to_string(U(1000)); break;
    }
    if (raw.empty()) {
      h.token_len = static_cast<uint32_t>(token.size());
      h.address_len = static_cast<uint32_t>(address.size());
      FrameMutator::Append(&raw, h);
      FrameMutator::AppendBytes(&raw, token.data(), token.size());
      FrameMutator::AppendBytes(&raw, address.data(), address.size());
      if (truncate) raw.resize(1 + U(raw.size() - 1));
    }
    ucx::Socket s = ucx::ConnectTcp(host_, port_, ucx::DeadlineIn(10));
    try {
      ucx::SendAll(s.fd(), raw.data(), raw.size(), ucx::DeadlineIn(5), "fuzz");
      if (truncate || raw.size() < sizeof(ucx::wire::BootHello)) ::shutdown(s.fd(), SHUT_WR);
      ucx::wire::BootReply r{};
      ucx::RecvAll(s.fd(), &r, sizeof(r), ucx::DeadlineIn(5), "fuzz");
      if (r.magic == ucx::wire::kBootMagic &&
          r.status == static_cast<int32_t>(ucx::wire::BootStatus::kOk)) {
        Accepted("bootstrap: " + what);
      } else {
        ++stats.bootstraps_refused;
      }
    } catch (const TimeoutError&) {
      ++stats.timeouts;
    } catch (const TransportError&) {
      ++stats.bootstraps_refused;  // closed without a reply (a truncated or garbage hello)
    }
  }

  // ---- data path ---------------------------------------------------------------------------

  // Frames that keep the connection (the shard answers them with an error).
  Bytes PersistentInvalid(std::string* what) {
    switch (U(6)) {
      case 0:
        *what = "commit without a session";
        return m_.Frame(MsgType::kCommit, m_.CommitBody());
      case 1:
        *what = "bit-flipped commit without a session";
        return m_.Frame(MsgType::kCommit, m_.BitFlippedCommitBody());
      case 2:
        *what = "get without a session";
        return m_.Frame(MsgType::kGet, m_.GetBody());
      case 3: {
        *what = "open with a random body";
        Bytes b = m_.RandomBytes(commit::wire::FixedBodyBytes(MsgType::kOpen) + U(40));
        commit::wire::OpenBody o;
        std::memcpy(&o, b.data(), sizeof(o));
        o.world_size = 0;  // never a valid session
        std::memcpy(b.data(), &o, sizeof(o));
        return m_.Frame(MsgType::kOpen, b);
      }
      case 4:
        *what = "checkpoint without a session";
        return m_.Frame(MsgType::kCheckpoint, m_.RandomBytes(U(2) ? 8 : U(30)));
      default: {
        *what = "random body of a request type";
        MsgType t;
        Bytes body = m_.RandomRequest(&t);
        return m_.Frame(t, body);
      }
    }
  }

  // Frames after which the shard closes the connection. *tag_delta != 0 makes the doorbell
  // name another tag than the frame's header carries.
  Bytes ClosingInvalid(std::string* what, uint64_t* tag_delta, size_t* extra) {
    *tag_delta = 0;
    *extra = 0;
    switch (U(9)) {
      case 0: *what = "random bytes"; return m_.RandomBytes(1 + U(200));
      case 1:
      case 2:
      case 3:
        return m_.BrokenHeader(what);
      case 4: {
        *what = "body_len disagrees with the bytes written";
        Bytes f = m_.Frame(MsgType::kCommit, m_.CommitBody());
        *extra = 1 + U(64);
        return f;
      }
      case 5: {
        *what = "frame does not match its doorbell";
        *tag_delta = 1 + U(1000);
        return m_.Frame(MsgType::kPing, {});
      }
      case 6: *what = "reply type sent by a client"; return m_.Frame(MsgType::kAck, {});
      case 7: *what = "stranger's token"; return m_.Hello(m_.token() + "x" + std::to_string(U(100)));
      default:
        *what = "another job's digest";
        return m_.Frame(MsgType::kPing, {}, m_.digest() ^ (1 + U(1000)));
    }
  }

  struct Reply {
    std::mutex mu;
    std::condition_variable cv;
    bool got = false;
    int32_t status = 0;
    bool failed = false;
  };

  void Connect() {
    reply_ = std::make_shared<Reply>();
    ucx::ConnectOptions o;
    o.host = host_;
    o.port = port_;
    o.token = m_.token();
    o.num_slots = 1;
    o.slot_bytes = kSlotBytes;
    o.source_slots = {slot_.data()};
    ucx::EndpointHandlers h;
    auto r = reply_;
    h.on_message = [r](const uint8_t* head, size_t len, size_t) {
      ucx::Landing l;
      if (len >= kHeaderBytes) {
        const auto fh = commit::wire::LoadHeader(head);
        l.done = [r, fh](bool) {
          if (fh.slot == commit::wire::kNoSlot) return;  // notifications are not answers
          std::lock_guard<std::mutex> lock(r->mu);
          r->got = true;
          r->status = fh.status;
          r->cv.notify_all();
        };
      }
      return l;
    };
    h.on_failure = [r](const ucx::Failure&) {
      std::lock_guard<std::mutex> lock(r->mu);
      r->failed = true;
      r->cv.notify_all();
    };
    ep_ = ucx::Endpoint::Connect(o, h, ucx::DeadlineIn(10));
    ++stats.connections;
    // Authenticate with the server's own token: post-handshake parsing is fuzzed too.
    const Bytes hello = m_.Hello(m_.token());
    if (Send(hello, 0, 0) != 0) {
      throw TransportError("the fuzzer could not authenticate with the server's own token");
    }
  }
  void Drop() {
    if (ep_) ep_->Close(/*graceful=*/false);
    ep_.reset();
  }

  // Writes `f` into the slot (header tag = doorbell tag + tag_delta, the doorbell announcing
  // f.size() + extra bytes) and waits. Returns 0 for an ok reply, 1 for an error reply,
  // 2 when the connection closed, 3 on timeout.
  int Send(Bytes f, uint64_t tag_delta, size_t extra) {
    const uint64_t tag = ++next_tag_;
    if (f.size() >= kHeaderBytes) {
      auto h = commit::wire::LoadHeader(f.data());
      h.slot = 0;
      h.tag = tag + tag_delta;
      commit::wire::StoreHeader(f.data(), h);
    }
    const size_t len = std::min(kSlotBytes, f.size() + extra);
    std::memcpy(slot_.data(), f.data(), std::min(f.size(), kSlotBytes));
    {
      std::lock_guard<std::mutex> lock(reply_->mu);
      reply_->got = false;
    }
    try {
      ep_->PostPut(0, len, tag);
      ep_->FlushAndRing();
    } catch (const TransportError&) {
      return 2;
    }
    std::unique_lock<std::mutex> lock(reply_->mu);
    if (!reply_->cv.wait_for(lock, std::chrono::seconds(5),
                             [&] { return reply_->got || reply_->failed; })) {
      return 3;
    }
    if (reply_->got) return reply_->status == static_cast<int32_t>(Status::kOk) ? 0 : 1;
    return 2;
  }

  void Count(int outcome, const std::string& what) {
    switch (outcome) {
      case 0: Accepted(what); break;
      case 1: ++stats.error_replies; break;
      case 2: ++stats.closed_by_server; break;
      default: ++stats.timeouts; break;
    }
  }

  void PersistentFrame() {
    if (!ep_ || ep_->failed()) {
      Drop();
      Connect();
    }
    std::string what;
    Bytes f = PersistentInvalid(&what);
    ++stats.frames;
    const int outcome = Send(std::move(f), 0, 0);
    Count(outcome, what);
    if (outcome >= 2) Drop();
  }

  void ClosingFrame() {
    Drop();
    Connect();
    std::string what;
    uint64_t tag_delta;
    size_t extra;
    Bytes f = ClosingInvalid(&what, &tag_delta, &extra);
    ++stats.frames;
    // An error reply may come first; the connection must then close.
    int outcome = Send(std::move(f), tag_delta, extra);
    if (outcome == 1) {
      ++stats.error_replies;
      std::unique_lock<std::mutex> lock(reply_->mu);
      outcome = reply_->cv.wait_for(lock, std::chrono::seconds(5), [&] { return reply_->failed; })
                    ? 2
                    : 3;
    }
    Count(outcome, what);
    Drop();
  }

  const std::string host_;
  const uint16_t port_;
  FrameMutator m_;
  std::vector<uint8_t> slot_;
  std::shared_ptr<ucx::Endpoint> ep_;
  std::shared_ptr<Reply> reply_;
  uint64_t next_tag_ = 0;
};

}  // namespace

UcxFuzzStats FuzzUcxServer(const std::string& host, uint16_t port, const std::string& job_token,
                           uint64_t bootstraps, uint64_t frames, uint64_t seed) {
  UcxFuzzer f(host, port, job_token, seed);
  f.Run(bootstraps, frames);
  return f.stats;
}

}  // namespace bagpipe::transport
