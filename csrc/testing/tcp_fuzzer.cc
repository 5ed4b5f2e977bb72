#include "testing/tcp_fuzzer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "common/errors.h"
#include "transport/socket.h"

namespace bagpipe::testing {
namespace {

namespace wire = protocol::wire;
using wire::MsgType;
using wire::Status;
using Bytes = FrameMutator::Bytes;

class TcpFuzzer : public FrameFuzzer {
 public:
  TcpFuzzer(std::string host, uint16_t port, std::string token, uint64_t seed)
      : FrameFuzzer(std::move(token), seed, /*random_routing=*/true, /*persistent_percent=*/88,
                    /*unauthenticated_closing=*/true),
        host_(std::move(host)),
        port_(port) {}
  ~TcpFuzzer() override { Drop(); }

 protected:
  void Connect(bool authenticate) override {
    fd_ = transport::ConnectTcp(host_, port_, DeadlineAfter(10)).Release();
    transport::SetRecvTimeout(fd_, 5.0);
    ++stats_.connections;
    authenticated_ = false;
    if (!authenticate) return;
    const Bytes f = mutator().Hello(mutator().token());
    transport::WriteAll(fd_, f.data(), f.size(), "fuzz");
    MsgType type;
    if (ReadReply(&type) != FuzzOutcome::kOk || type != MsgType::kHelloOk) {
      throw TransportError("the fuzzer could not authenticate with the server's own token");
    }
    authenticated_ = true;
  }

  void Drop() override {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    authenticated_ = false;
  }

  bool Usable() const override { return fd_ >= 0 && authenticated_; }

  FuzzOutcome Deliver(const FuzzFrame& f) override {
    try {
      transport::WriteAll(fd_, f.bytes.data(), f.bytes.size(), "fuzz");
      if (f.end_stream) ::shutdown(fd_, SHUT_WR);
    } catch (const std::exception&) {
      return FuzzOutcome::kClosed;  // the server closed before taking it all
    }
    MsgType type;
    return ReadReply(&type);
  }

  FuzzOutcome Next() override {
    MsgType type;
    return ReadReply(&type);
  }

  FuzzFrame TransportViolation(bool) override {
    FuzzFrame f;
    if (U(2) == 0) {
      f.what = "oversized body_len";
      f.bytes = mutator().Frame(MsgType::kCommit, {});
      const uint64_t len = (uint64_t{1} << 40) + U(1000);
      std::memcpy(f.bytes.data() + 32, &len, 8);
    } else {
      f.what = "truncated frame";
      f.end_stream = true;
      f.bytes = mutator().Frame(MsgType::kCommit, mutator().CommitBody());
      f.bytes.resize(1 + U(f.bytes.size() - 1));
    }
    return f;
  }

 private:
  // Reads one reply: kOk / kError by its status; kClosed on EOF, a reset or an absurd
  // length; kTimeout when nothing came within the receive timeout.
  FuzzOutcome ReadReply(MsgType* type) {
    uint8_t hb[wire::kHeaderBytes];
    try {
      if (!transport::ReadFull(fd_, hb, wire::kHeaderBytes, true, "fuzz")) {
        return FuzzOutcome::kClosed;
      }
      const wire::FrameHeader h = wire::LoadHeader(hb);
      if (h.body_len > (1u << 20)) return FuzzOutcome::kClosed;
      Bytes body(h.body_len);
      transport::ReadFull(fd_, body.data(), body.size(), false, "fuzz");
      *type = static_cast<MsgType>(h.type);
      return static_cast<Status>(h.status) == Status::kOk ? FuzzOutcome::kOk : FuzzOutcome::kError;
    } catch (const TimeoutError&) {
      return FuzzOutcome::kTimeout;
    } catch (const std::exception&) {
      return FuzzOutcome::kClosed;
    }
  }

  const std::string host_;
  const uint16_t port_;
  int fd_ = -1;
  bool authenticated_ = false;
};

}  // namespace

FuzzStats FuzzTcpServer(const std::string& host, uint16_t port, const std::string& job_token,
                        uint64_t frames, uint64_t seed) {
  TcpFuzzer f(host, port, job_token, seed);
  f.Run(frames);
  return f.stats();
}

}  // namespace bagpipe::testing
