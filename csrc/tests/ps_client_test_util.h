// Helpers shared by the PSClient end-to-end tests (test_ps_client.cc over the local and tcp
// transports, ucx_ps_client_test.cc over UCX): map-table shards, client options,
// deterministic gradient batches and the reference SGD those batches must reproduce.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "client/ps_client.h"
#include "shard/ps_shard.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"
#include "transport/channel.h"

namespace bagpipe::testing {

inline constexpr uint32_t kClientDim = 4;
inline constexpr float kClientLr = 0.125f;

// A shard `id` of `n` whose tables are MapTables.
inline std::shared_ptr<shard::PSShard> MakeShard(uint32_t id, uint32_t n) {
  shard::ShardOptions o;
  o.shard_id = id;
  o.num_shards = n;
  return std::make_shared<shard::PSShard>(o, MapTableFactory(), NoLoader());
}

// Table "emb" of width kClientDim, constant init 0.5, hash partitioning, a 20 s timeout.
inline client::ClientOptions ClientOpts(uint64_t session, uint32_t rank, uint32_t world,
                                        uint32_t max_rows, uint32_t inflight) {
  client::ClientOptions o;
  o.table = "emb";
  o.session = session;
  o.rank = rank;
  o.world_size = world;
  o.dim = kClientDim;
  o.lr = kClientLr;
  o.init.kind = store::InitKind::kConstant;
  o.init.value = 0.5f;
  o.max_packet_rows = max_rows;
  o.inflight_packets = inflight;
  o.partition = protocol::PartitionKind::kHash;
  o.timeout = 20.0;
  return o;
}

// A channel with one slot per in-flight packet, each large enough for the client's packets.
inline transport::ChannelOptions ChannelOpts(const client::ClientOptions& o) {
  transport::ChannelOptions c;
  c.num_slots = o.inflight_packets;
  c.slot_bytes = client::SlotBytesFor(o);
  return c;
}

struct Batch {
  std::vector<int64_t> keys;
  std::vector<float> grads;
};

// 0..max_rows-1 rows (sometimes none) of keys in [0, num_keys), duplicates likely, with
// gradients determined by `seed`.
inline Batch SeededBatch(uint64_t seed, int max_rows, int64_t num_keys) {
  std::mt19937_64 rng(seed);
  Batch b;
  const int n = static_cast<int>(rng() % max_rows);
  for (int i = 0; i < n; ++i) {
    b.keys.push_back(static_cast<int64_t>(rng() % num_keys));
    for (uint32_t c = 0; c < kClientDim; ++c) {
      b.grads.push_back(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 97.0f);
    }
  }
  return b;
}

// The reference: one SGD update per step over rank 0's rows, then rank 1's, ..., divided by
// the world size.
inline std::unique_ptr<MapTable> ReferenceModel(
    int steps, uint32_t world, const std::function<Batch(int step, uint32_t rank)>& batch) {
  shard::TableSchema spec;
  spec.dim = kClientDim;
  spec.init.kind = store::InitKind::kConstant;
  spec.init.value = 0.5f;
  auto ref = std::make_unique<MapTable>(spec);
  for (int t = 0; t < steps; ++t) {
    std::vector<int64_t> keys;
    std::vector<float> grads;
    for (uint32_t r = 0; r < world; ++r) {
      auto b = batch(t, r);
      keys.insert(keys.end(), b.keys.begin(), b.keys.end());
      grads.insert(grads.end(), b.grads.begin(), b.grads.end());
    }
    ref->ApplyGradients(keys.data(), keys.size(), grads.data(), kClientLr, static_cast<int>(world));
  }
  return ref;
}

// CHECKs that `got` holds exactly `ref`'s rows of `keys` (bitwise).
inline void CheckRows(const std::vector<int64_t>& keys, const std::vector<float>& got,
                      MapTable& ref) {
  for (size_t i = 0; i < keys.size(); ++i) {
    auto want = ref.Row(keys[i]);
    CHECK(std::memcmp(got.data() + i * kClientDim, want.data(), kClientDim * 4) == 0);
  }
}

}  // namespace bagpipe::testing
