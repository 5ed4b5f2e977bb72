// The test tools themselves (csrc/testing/): RawLink hands frames to its handler and records
// the replies exactly (raw_link.h invariants 1 and 2); FrameMutator is a pure function of its
// seed (frame_mutator.h invariants 1 and 2).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/errors.h"
#include "protocol/wire.h"
#include "testing/frame_mutator.h"
#include "testing/raw_link.h"
#include "tests/test_harness.h"

using namespace bagpipe;
namespace wire = protocol::wire;

namespace {

// Answers every frame with a Pong whose fixed body echoes the request body; counts closes.
class EchoHandler : public transport::FrameHandler {
 public:
  Identity identity() const override { return {}; }
  const LogFn& log() const override { return log_; }
  bool HandleFrame(const std::shared_ptr<transport::ServerLink>& link,
                   const wire::FrameHeader& header, const uint8_t* body, size_t body_len,
                   transport::RecvBuffer*) override {
    ++frames;
    link->Send(wire::MsgType::kPong, wire::Status::kOk, header.tag, header.slot, body, body_len,
               4, [](uint8_t* dst) { std::memcpy(dst, "tail", 4); });
    return header.tag != 99;  // tag 99: "close the connection"
  }
  void LinkClosed(transport::ServerLink*) override { ++closed; }

  int frames = 0;
  int closed = 0;

 private:
  LogFn log_;
};

std::string Frame(uint64_t tag, const std::string& body) {
  std::string f(wire::kHeaderBytes + body.size(), '\0');
  wire::StoreHeader(reinterpret_cast<uint8_t*>(f.data()),
                    wire::MakeHeader(wire::MsgType::kPing, 0, body.size(), wire::Status::kOk, tag));
  std::memcpy(f.data() + wire::kHeaderBytes, body.data(), body.size());
  return f;
}

}  // namespace

TEST_CASE(raw_link_records_replies_in_order_and_closes_once) {
  auto handler = std::make_shared<EchoHandler>();
  auto link = std::make_shared<testing::RawLink>(handler, true);
  link->job_digest = 77;
  CHECK(link->Request(Frame(1, "abc"), link));
  CHECK(!link->Request(Frame(99, "defgh"), link));  // the handler's answer is passed on
  const auto frames = link->Take();
  CHECK_EQ(frames.size(), size_t{2});
  CHECK(link->Take().empty());
  for (size_t i = 0; i < frames.size(); ++i) {
    const std::string body = i == 0 ? "abc" : "defgh";
    const auto h = wire::LoadHeader(reinterpret_cast<const uint8_t*>(frames[i].data()));
    CHECK_EQ(h.type, static_cast<uint16_t>(wire::MsgType::kPong));
    CHECK_EQ(h.job, 77u);
    CHECK_EQ(h.tag, i == 0 ? 1u : 99u);
    CHECK_EQ(h.body_len, body.size() + 4);
    CHECK_EQ(frames[i].substr(wire::kHeaderBytes), body + "tail");
  }
  link->Close();
  link->Close();
  CHECK_EQ(handler->closed, 1);
  CHECK(link->Request(Frame(2, "x"), link));  // delivered, but the reply is dropped
  CHECK(link->Take().empty());
  CHECK_EQ(handler->frames, 3);
}

TEST_CASE(raw_link_refuses_bytes_that_are_not_one_frame) {
  auto handler = std::make_shared<EchoHandler>();
  auto link = std::make_shared<testing::RawLink>(handler, true);
  CHECK_THROWS(ValueError, link->Request("short", link));
  CHECK_THROWS(ValueError, link->Request(Frame(1, "abc") + "extra", link));
  CHECK_EQ(handler->frames, 0);
  CHECK_THROWS(ValueError, testing::RawLink(nullptr, true));
}

TEST_CASE(frame_mutator_is_a_pure_function_of_its_seed) {
  testing::FrameMutator a("tok", 5, true), b("tok", 5, true), c("tok", 6, true);
  CHECK_EQ(a.digest(), wire::TokenDigest("tok"));
  bool differs = false;
  for (int i = 0; i < 20; ++i) {
    std::string what_a, what_b;
    const auto fa = a.BrokenHeader(&what_a);
    CHECK(fa == b.BrokenHeader(&what_b));
    CHECK_EQ(what_a, what_b);
    CHECK(a.CommitBody() == b.CommitBody());
    differs |= a.RandomBytes(16) != c.RandomBytes(16);
    b.RandomBytes(16);
  }
  CHECK(differs);
  const auto body = a.GetBody();
  const auto frame = a.Frame(wire::MsgType::kGet, body);
  const auto h = wire::LoadHeader(frame.data());
  CHECK_EQ(h.body_len, body.size());
  CHECK_EQ(h.job, a.digest());
  CHECK_EQ(frame.size(), wire::kHeaderBytes + body.size());
}
