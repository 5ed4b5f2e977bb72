#include "protocol/partitioner.h"

#include "common/errors.h"

namespace bagpipe::protocol {

Partitioner::Partitioner(PartitionKind kind, uint32_t num_shards)
    : kind_(kind), num_shards_(num_shards) {
  if (num_shards == 0) throw ValueError("num_shards must be >= 1");
  if (static_cast<uint8_t>(kind) > 2) throw ValueError("unknown partitioner kind");
}

PartitionKind Partitioner::ParseKind(std::string_view name) {
  if (name == "modulo") return PartitionKind::kModulo;
  if (name == "hash") return PartitionKind::kHash;
  if (name == "fast_range") return PartitionKind::kFastRange;
  throw ValueError("partitioner must be one of 'modulo', 'hash', 'fast_range', got '" +
                   std::string(name) + "'");
}

const char* Partitioner::KindName(PartitionKind kind) {
  switch (kind) {
    case PartitionKind::kModulo: return "modulo";
    case PartitionKind::kHash: return "hash";
    case PartitionKind::kFastRange: return "fast_range";
  }
  return "unknown";
}

void Partitioner::Assign(const int64_t* keys, size_t n, uint32_t* shard_out) const {
  if (num_shards_ == 1) {
    for (size_t i = 0; i < n; ++i) shard_out[i] = 0;
    return;
  }
  for (size_t i = 0; i < n; ++i) shard_out[i] = ShardOf(keys[i]);
}

void Partitioner::Split(const int64_t* keys, size_t n, std::vector<uint32_t>* shards,
                        std::vector<int64_t>* order, std::vector<size_t>* offsets) const {
  offsets->assign(size_t{num_shards_} + 1, 0);
  order->resize(n);
  if (num_shards_ == 1) {
    for (size_t i = 0; i < n; ++i) (*order)[i] = static_cast<int64_t>(i);
    (*offsets)[1] = n;
    return;
  }
  shards->resize(n);
  Assign(keys, n, shards->data());
  auto& off = *offsets;
  for (size_t i = 0; i < n; ++i) ++off[(*shards)[i] + 1];
  for (size_t s = 0; s < num_shards_; ++s) off[s + 1] += off[s];
  // Fill with a moving cursor per shard (stable); restore offsets afterwards.
  std::vector<size_t> cursor(off.begin(), off.end() - 1);
  for (size_t i = 0; i < n; ++i) (*order)[cursor[(*shards)[i]]++] = static_cast<int64_t>(i);
}

}  // namespace bagpipe::protocol
