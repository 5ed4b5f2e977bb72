#include <cstring>
#include <vector>

#include "protocol/partitioner.h"
#include "protocol/wire.h"
#include "common/errors.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"

using namespace bagpipe;
using namespace bagpipe::protocol;

TEST_CASE(wire_header_roundtrip_and_checks) {
  auto h = wire::MakeHeader(wire::MsgType::kCommit, 42, 100, wire::Status::kOk, 7, 3);
  uint8_t buf[wire::kHeaderBytes];
  wire::StoreHeader(buf, h);
  auto g = wire::LoadHeader(buf);
  CHECK_EQ(g.magic, wire::kMagic);
  CHECK_EQ(g.tag, 7u);
  CHECK_EQ(g.slot, 3u);
  CHECK_EQ(g.job, 42u);
  std::string why;
  CHECK(!wire::CheckHeader(g, 99, &why));  // body too long for the limit
  CHECK(why.find("exceeds") != std::string::npos);
  g.body_len = 10;  // shorter than CommitBody
  CHECK(!wire::CheckHeader(g, 1000, &why));
  g.body_len = 100;
  g.magic = 0;
  CHECK(!wire::CheckHeader(g, 1000, &why));
  g.magic = wire::kMagic;
  g.version = 9;
  CHECK(!wire::CheckHeader(g, 1000, &why));
  CHECK(why.find("version") != std::string::npos);
  g.version = wire::kProtocolVersion;
  g.type = 999;
  CHECK(!wire::CheckHeader(g, 1000, &why));
  g.type = static_cast<uint16_t>(wire::MsgType::kCommit);
  CHECK(wire::CheckHeader(g, 1000, &why));
}

TEST_CASE(wire_commit_parse_validates_every_field) {
  wire::CommitBody b{};
  b.session = 1;
  b.step = 5;
  b.rank = 1;
  b.world_size = 2;
  b.chunk_index = 0;
  b.chunk_count = 2;
  b.dim = 3;
  b.lr = 0.5f;
  b.nrows = 2;
  std::vector<int64_t> keys{4, 9};
  std::vector<float> grads(6, 1.0f);
  auto body = testing::CommitBodyBytes(b, keys, grads);
  wire::CommitView v;
  std::string why;
  CHECK(wire::ParseCommit(body.data(), body.size(), &v, &why));
  CHECK_EQ(v.body.nrows, 2u);
  CHECK_EQ(v.keys[1], 9);
  CHECK_EQ(v.payload_len, size_t{2 * 8 + 6 * 4});
  // Truncated and padded bodies.
  CHECK(!wire::ParseCommit(body.data(), body.size() - 1, &v, &why));
  CHECK(why.find("body_len") != std::string::npos);
  body.push_back(0);
  CHECK(!wire::ParseCommit(body.data(), body.size(), &v, &why));
  auto bad = [&](auto mutate, const char* field) {
    wire::CommitBody c = b;
    mutate(c);
    auto bytes = testing::CommitBodyBytes(c, keys, grads);
    std::string w;
    wire::CommitView cv;
    CHECK(!wire::ParseCommit(bytes.data(), bytes.size(), &cv, &w));
    if (w.find(field) == std::string::npos) throw testing::CheckFailure("reason '" + w + "' lacks " + field);
  };
  bad([](wire::CommitBody& c) { c.chunk_index = 2; }, "chunk_index");
  bad([](wire::CommitBody& c) { c.chunk_count = 0; }, "chunk_count");
  bad([](wire::CommitBody& c) { c.rank = 2; }, "rank");
  bad([](wire::CommitBody& c) { c.world_size = 0; }, "world_size");
  bad([](wire::CommitBody& c) { c.step = -3; }, "step");
  bad([](wire::CommitBody& c) { c.dim = 0; }, "dim");
  bad([](wire::CommitBody& c) { c.nrows = 0xFFFFFFFFu; }, "nrows");
  bad([](wire::CommitBody& c) { c.lr = std::numeric_limits<float>::quiet_NaN(); }, "lr");
  bad([](wire::CommitBody& c) { c.lr = -0.5f; }, "lr");
  bad([](wire::CommitBody& c) { c.lr = std::numeric_limits<float>::infinity(); }, "lr");
}

TEST_CASE(wire_open_parse_validates_the_optimizer) {
  wire::OpenBody b{};
  b.session = 3;
  b.rank = 0;
  b.world_size = 1;
  b.dim = 4;
  b.optimizer = 2;  // row-wise Adagrad
  b.eps = 1e-8;
  b.beta1 = 0.9;
  b.beta2 = 0.999;
  b.key_bound = -1;
  const std::string name = "emb";
  b.name_len = static_cast<uint16_t>(name.size());
  auto bytes = [&](const wire::OpenBody& body) {
    std::vector<uint8_t> out(sizeof(body) + name.size());
    std::memcpy(out.data(), &body, sizeof(body));
    std::memcpy(out.data() + sizeof(body), name.data(), name.size());
    return out;
  };
  wire::OpenView v;
  std::string why;
  auto ok = bytes(b);
  CHECK(wire::ParseOpen(ok.data(), ok.size(), &v, &why));
  CHECK_EQ(v.body.optimizer, uint8_t{2});
  CHECK(v.table == "emb");
  wire::OpenBody bad = b;
  bad.optimizer = wire::kMaxOptimizerKind + 1;
  auto bad_kind = bytes(bad);
  CHECK(!wire::ParseOpen(bad_kind.data(), bad_kind.size(), &v, &why));
  CHECK(why.find("optimizer") != std::string::npos);
  bad = b;
  bad.beta2 = std::numeric_limits<double>::quiet_NaN();
  auto bad_beta = bytes(bad);
  CHECK(!wire::ParseOpen(bad_beta.data(), bad_beta.size(), &v, &why));
  CHECK(why.find("optimizer") != std::string::npos);
}

TEST_CASE(wire_table_names_and_digest) {
  CHECK(wire::ValidTableName("emb_0.t:a-b"));
  CHECK(!wire::ValidTableName(""));
  CHECK(!wire::ValidTableName(".."));
  CHECK(!wire::ValidTableName("a/b"));
  CHECK(!wire::ValidTableName(std::string(129, 'a')));
  CHECK(wire::TokenDigest("a") != wire::TokenDigest("b"));
  CHECK_EQ(wire::TokenDigest("job"), wire::TokenDigest("job"));
}

// Reference vectors, also pinned in tests/test_ps_partitioner.py (every runtime must agree).
TEST_CASE(partitioner_reference_vectors) {
  const std::vector<int64_t> keys{0, 1, 2, 3, 7, 63, 64, 1000, 123456789, 2147483647,
                                  (int64_t{1} << 40) + 5, (int64_t{1} << 62) + 12345, -1,
                                  std::numeric_limits<int64_t>::min()};
  struct Ref {
    PartitionKind kind;
    uint32_t shards;
    std::vector<uint32_t> want;
  };
  const std::vector<Ref> refs{
      {PartitionKind::kModulo, 2, {0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0}},
      {PartitionKind::kHash, 2, {0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1}},
      {PartitionKind::kFastRange, 2, {0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1}},
      {PartitionKind::kModulo, 3, {0, 1, 2, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0, 2}},
      {PartitionKind::kHash, 3, {0, 2, 0, 2, 1, 1, 2, 0, 2, 1, 2, 0, 1, 0}},
      {PartitionKind::kFastRange, 3, {0, 2, 0, 0, 1, 0, 0, 2, 1, 1, 2, 2, 1, 1}},
      {PartitionKind::kModulo, 8, {0, 1, 2, 3, 7, 7, 0, 0, 5, 7, 5, 1, 7, 0}},
      {PartitionKind::kHash, 8, {0, 4, 7, 6, 5, 4, 6, 1, 6, 1, 0, 0, 1, 3}},
      {PartitionKind::kFastRange, 8, {0, 5, 1, 0, 3, 0, 2, 5, 4, 4, 5, 6, 3, 4}},
  };
  for (const auto& r : refs) {
    Partitioner p(r.kind, r.shards);
    std::vector<uint32_t> got(keys.size());
    p.Assign(keys.data(), keys.size(), got.data());
    for (size_t i = 0; i < keys.size(); ++i) CHECK_EQ(got[i], r.want[i]);
  }
  CHECK_THROWS(ValueError, Partitioner::ParseKind("range"));
  CHECK_THROWS(ValueError, Partitioner(PartitionKind::kHash, 0));
}

TEST_CASE(partitioner_split_is_stable) {
  Partitioner p(PartitionKind::kHash, 3);
  std::vector<int64_t> keys;
  for (int i = 0; i < 200; ++i) keys.push_back((i * 7919) % 113);
  std::vector<uint32_t> shards;
  std::vector<int64_t> order;
  std::vector<size_t> off;
  p.Split(keys.data(), keys.size(), &shards, &order, &off);
  CHECK_EQ(off.size(), size_t{4});
  CHECK_EQ(off[3], keys.size());
  std::vector<int> seen(keys.size(), 0);
  for (uint32_t s = 0; s < 3; ++s) {
    for (size_t i = off[s]; i < off[s + 1]; ++i) {
      CHECK_EQ(p.ShardOf(keys[order[i]]), s);
      if (i > off[s]) CHECK(order[i] > order[i - 1]);  // input order within a shard
      ++seen[order[i]];
    }
  }
  for (int c : seen) CHECK_EQ(c, 1);
}
