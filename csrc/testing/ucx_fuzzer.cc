#include "testing/ucx_fuzzer.h"

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/errors.h"
#include "transport/socket.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_wire.h"

namespace bagpipe::testing {
namespace {

namespace ucx = transport::ucx;
using protocol::wire::kHeaderBytes;
using protocol::wire::MsgType;
using protocol::wire::Status;
using Bytes = FrameMutator::Bytes;

constexpr size_t kSlotBytes = 4096;
constexpr auto kAnswerWait = std::chrono::seconds(5);

class UcxFuzzer : public FrameFuzzer {
 public:
  UcxFuzzer(std::string host, uint16_t port, std::string token, uint64_t seed)
      : FrameFuzzer(std::move(token), seed, /*random_routing=*/false, /*persistent_percent=*/96,
                    /*unauthenticated_closing=*/false),
        host_(std::move(host)),
        port_(port),
        slot_(kSlotBytes) {}
  ~UcxFuzzer() override { Drop(); }

  void RunBootstraps(uint64_t bootstraps) {
    for (uint64_t i = 0; i < bootstraps; ++i) Bootstrap();
  }

 protected:
  void Connect(bool /*authenticate: always*/) override {
    answers_ = std::make_shared<Answers>();
    ucx::ConnectOptions o;
    o.host = host_;
    o.port = port_;
    o.token = mutator().token();
    o.num_slots = 1;
    o.slot_bytes = kSlotBytes;
    o.source_slots = {slot_.data()};
    ucx::EndpointHandlers h;
    auto a = answers_;
    h.on_message = [a](const uint8_t* head, size_t len, size_t) {
      ucx::Landing l;
      if (len >= kHeaderBytes) {
        const auto fh = protocol::wire::LoadHeader(head);
        l.done = [a, fh](bool) {
          if (fh.slot == protocol::wire::kNoSlot) return;  // notifications are not answers
          std::lock_guard<std::mutex> lock(a->mu);
          a->statuses.push_back(fh.status);
          a->cv.notify_all();
        };
      }
      return l;
    };
    h.on_failure = [a](const ucx::Failure&) {
      std::lock_guard<std::mutex> lock(a->mu);
      a->failed = true;
      a->cv.notify_all();
    };
    ep_ = ucx::Endpoint::Connect(o, h, DeadlineAfter(10));
    ++stats_.connections;
    // Authenticate with the server's own token: post-handshake parsing is fuzzed too.
    FuzzFrame hello;
    hello.bytes = mutator().Hello(mutator().token());
    if (Deliver(hello) != FuzzOutcome::kOk) {
      throw TransportError("the fuzzer could not authenticate with the server's own token");
    }
  }

  void Drop() override {
    if (ep_) ep_->Close(/*graceful=*/false);
    ep_.reset();
  }

  bool Usable() const override { return ep_ && !ep_->failed(); }

  // Writes the frame into the slot (header tag = doorbell tag + tag_delta, the doorbell
  // announcing its size + extra_bytes) and waits for the answer.
  FuzzOutcome Deliver(const FuzzFrame& f) override {
    Bytes bytes = f.bytes;
    const uint64_t tag = ++next_tag_;
    if (bytes.size() >= kHeaderBytes) {
      auto h = protocol::wire::LoadHeader(bytes.data());
      h.slot = 0;
      h.tag = tag + f.tag_delta;
      protocol::wire::StoreHeader(bytes.data(), h);
    }
    const size_t len = std::min(kSlotBytes, bytes.size() + f.extra_bytes);
    std::memcpy(slot_.data(), bytes.data(), std::min(bytes.size(), kSlotBytes));
    {
      std::lock_guard<std::mutex> lock(answers_->mu);
      seen_ = answers_->statuses.size();
    }
    try {
      ep_->PostPut(0, len, tag);
      ep_->FlushAndRing();
    } catch (const TransportError&) {
      return FuzzOutcome::kClosed;
    }
    return Next();
  }

  FuzzOutcome Next() override {
    std::unique_lock<std::mutex> lock(answers_->mu);
    if (!answers_->cv.wait_for(lock, kAnswerWait, [&] {
          return answers_->statuses.size() > seen_ || answers_->failed;
        })) {
      return FuzzOutcome::kTimeout;
    }
    if (answers_->statuses.size() > seen_) {
      const int32_t status = answers_->statuses[seen_++];
      return status == static_cast<int32_t>(Status::kOk) ? FuzzOutcome::kOk : FuzzOutcome::kError;
    }
    return FuzzOutcome::kClosed;
  }

  FuzzFrame TransportViolation(bool) override {
    FuzzFrame f;
    if (U(2) == 0) {
      f.what = "body_len disagrees with the bytes written";
      f.bytes = mutator().Frame(MsgType::kCommit, mutator().CommitBody());
      f.extra_bytes = 1 + U(64);
    } else {
      f.what = "frame does not match its doorbell";
      f.bytes = mutator().Frame(MsgType::kPing, {});
      f.tag_delta = 1 + U(1000);
    }
    return f;
  }

 private:
  // ---- control port ---------------------------------------------------------------------------

  void Bootstrap() {
    ++stats_.bootstraps;
    ucx::wire::BootHello h{};
    h.magic = ucx::wire::kBootMagic;
    h.version = ucx::wire::kBootVersion;
    h.num_slots = 1 + static_cast<uint32_t>(U(8));
    h.slot_bytes = 64 + U(4096);
    std::string token = mutator().token();
    Bytes address = mutator().RandomBytes(16 + U(100));  // never used: every hello below is refused
    Bytes raw;
    bool truncate = false;
    std::string what;
    switch (U(10)) {
      case 0: what = "random bytes"; raw = mutator().RandomBytes(1 + U(200)); break;
      case 1: what = "bad magic"; h.magic ^= 1u + static_cast<uint32_t>(U(1000)); break;
      case 2: what = "bad version"; h.version = static_cast<uint16_t>(2 + U(1000)); break;
      case 3: what = "no slots"; h.num_slots = U(2) ? 0 : ucx::wire::kMaxSlots + 1 + static_cast<uint32_t>(U(1000)); break;
      case 4: what = "bad slot size"; h.slot_bytes = U(2) ? 0 : (uint64_t{1} << 40) + U(1000); break;
      case 5: what = "oversized token"; token.assign(ucx::wire::kMaxTokenBytes + 1 + U(100), 'x'); break;
      case 6: what = "bad address length"; address.resize(U(2) ? 0 : ucx::wire::kMaxWorkerAddress + 1); break;
      case 7: what = "truncated hello"; truncate = true; break;
      case 8: what = "ring too large"; h.num_slots = ucx::wire::kMaxSlots; h.slot_bytes = size_t{256} << 20; break;
      default: what = "stranger's token"; token = mutator().token() + "x" + std::to_string(U(1000)); break;
    }
    if (raw.empty()) {
      h.token_len = static_cast<uint32_t>(token.size());
      h.address_len = static_cast<uint32_t>(address.size());
      FrameMutator::Append(&raw, h);
      FrameMutator::AppendBytes(&raw, token.data(), token.size());
      FrameMutator::AppendBytes(&raw, address.data(), address.size());
      if (truncate) raw.resize(1 + U(raw.size() - 1));
    }
    transport::Socket s = transport::ConnectTcp(host_, port_, DeadlineAfter(10));
    transport::SetNonBlocking(s.fd(), true);
    try {
      transport::SendAll(s.fd(), raw.data(), raw.size(), DeadlineAfter(5), "fuzz");
      if (truncate || raw.size() < sizeof(ucx::wire::BootHello)) ::shutdown(s.fd(), SHUT_WR);
      ucx::wire::BootReply r{};
      transport::RecvAll(s.fd(), &r, sizeof(r), DeadlineAfter(5), "fuzz");
      if (r.magic == ucx::wire::kBootMagic &&
          r.status == static_cast<int32_t>(ucx::wire::BootStatus::kOk)) {
        Accepted("bootstrap: " + what);
      } else {
        ++stats_.bootstraps_refused;
      }
    } catch (const TimeoutError&) {
      ++stats_.timeouts;
    } catch (const TransportError&) {
      ++stats_.bootstraps_refused;  // closed without a reply (a truncated or garbage hello)
    }
  }

  // The answers of the current connection, in arrival order (written by its progress thread).
  struct Answers {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int32_t> statuses;
    bool failed = false;
  };

  const std::string host_;
  const uint16_t port_;
  std::vector<uint8_t> slot_;
  std::shared_ptr<ucx::Endpoint> ep_;
  std::shared_ptr<Answers> answers_;
  size_t seen_ = 0;  // answers consumed by Deliver / Next
  uint64_t next_tag_ = 0;
};

}  // namespace

FuzzStats FuzzUcxServer(const std::string& host, uint16_t port, const std::string& job_token,
                        uint64_t bootstraps, uint64_t frames, uint64_t seed) {
  UcxFuzzer f(host, port, job_token, seed);
  f.RunBootstraps(bootstraps);
  f.Run(frames);
  return f.stats();
}

}  // namespace bagpipe::testing
