#include "testing/frame_mutator.h"

namespace bagpipe::testing {

using namespace protocol::wire;  // the frame format this file builds

FrameMutator::Bytes FrameMutator::RandomBytes(size_t n) {
  Bytes b(n);
  for (auto& c : b) c = static_cast<uint8_t>(rng_());
  return b;
}

FrameMutator::Bytes FrameMutator::Frame(MsgType type, const Bytes& body, uint64_t job) {
  uint64_t tag = 0;
  uint32_t slot = kNoSlot;
  if (random_routing_) {
    tag = rng_();
    slot = static_cast<uint32_t>(U(16));
  }
  Bytes f(kHeaderBytes + body.size());
  StoreHeader(f.data(), MakeHeader(type, job, body.size(), Status::kOk, tag, slot));
  if (!body.empty()) std::memcpy(f.data() + kHeaderBytes, body.data(), body.size());
  return f;
}

FrameMutator::Bytes FrameMutator::Hello(const std::string& token) {
  Bytes b;
  Append(&b, HelloBody{static_cast<uint32_t>(token.size()), 0});
  AppendBytes(&b, token.data(), token.size());
  return Frame(MsgType::kHello, b, TokenDigest(token));
}

FrameMutator::Bytes FrameMutator::CommitBody() {
  protocol::wire::CommitBody c{};
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
  const Bytes rest = RandomBytes(size_t{c.nrows} * (8 + size_t{c.dim} * 4));
  AppendBytes(&b, rest.data(), rest.size());
  return b;
}

FrameMutator::Bytes FrameMutator::BitFlippedCommitBody() {
  Bytes body = CommitBody();
  for (int i = 0, n = 1 + static_cast<int>(U(8)); i < n; ++i) body[U(body.size())] ^= 1 << U(8);
  return body;
}

FrameMutator::Bytes FrameMutator::GetBody() {
  protocol::wire::GetBody g{rng_(), static_cast<int64_t>(U(10)) - 1, static_cast<uint32_t>(U(4)),
                            1 + static_cast<uint32_t>(U(8)), 0, 0};
  Bytes b;
  Append(&b, g);
  const Bytes keys = RandomBytes(size_t{g.nrows} * 8);
  AppendBytes(&b, keys.data(), keys.size());
  return b;
}

FrameMutator::Bytes FrameMutator::RandomRequest(MsgType* type) {
  const MsgType types[] = {MsgType::kCommit, MsgType::kGet, MsgType::kAssign};
  *type = types[U(3)];
  Bytes body = RandomBytes(U(300));
  if (body.size() < FixedBodyBytes(*type)) body.resize(FixedBodyBytes(*type));
  return body;
}

FrameMutator::Bytes FrameMutator::BrokenHeader(std::string* what) {
  Bytes f = Frame(MsgType::kPing, {});
  switch (U(3)) {
    case 0:
      *what = "bad magic";
      f[U(4)] ^= static_cast<uint8_t>(1 + U(255));
      break;
    case 1: {
      *what = "unsupported version";
      const uint16_t v = static_cast<uint16_t>(2 + U(60000));
      std::memcpy(f.data() + 4, &v, 2);
      break;
    }
    default: {
      *what = "unknown type";
      const uint16_t t = static_cast<uint16_t>(20 + U(60000));
      std::memcpy(f.data() + 6, &t, 2);
      break;
    }
  }
  return f;
}

}  // namespace bagpipe::testing
