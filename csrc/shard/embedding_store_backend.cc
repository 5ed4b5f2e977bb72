#include "shard/embedding_store_backend.h"

#include <cstring>
#include <memory>
#include <vector>

#include "common/errors.h"
#include "store/embedding_store.h"

namespace bagpipe::shard {
namespace {

class EmbeddingStoreBackend : public TableBackend {
 public:
  explicit EmbeddingStoreBackend(std::unique_ptr<store::EmbeddingStore> s) : store_(std::move(s)) {
    const auto& o = store_->options();
    schema_.dim = static_cast<uint32_t>(o.dim);
    schema_.init = o.init;
    schema_.key_bound = o.key_bound < 0 ? -1 : o.key_bound;
    schema_.optimizer = o.optimizer;
  }
  const TableSchema& schema() const override { return schema_; }
  void ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr,
                      int div) override {
    store_->ApplyGradients(keys, n, grads, lr, div);
  }
  void ApplyGradientsSegments(const store::GradSegment* segs, size_t count, float lr,
                              int div) override {
    store_->ApplyGradientsSegments(segs, count, lr, div);
  }
  void Read(const int64_t* keys, size_t n, float* out, bool with_state) override {
    const size_t sd = schema_.state_dim();
    if (!with_state || sd == 0) {
      store_->Lookup(keys, n, out, /*insert_missing=*/false);
      return;
    }
    // The store keeps weights and state apart: read both, then lay them out row by row.
    const size_t d = schema_.dim;
    weights_.resize(n * d);
    state_.resize(n * sd);
    store_->Lookup(keys, n, weights_.data(), state_.data(), /*insert_missing=*/false);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(out + i * (d + sd), weights_.data() + i * d, d * sizeof(float));
      std::memcpy(out + i * (d + sd) + d, state_.data() + i * sd, sd * sizeof(float));
    }
  }
  void Assign(const int64_t* keys, size_t n, const float* rows, bool with_state) override {
    const size_t sd = schema_.state_dim();
    if (!with_state || sd == 0) {
      store_->Assign(keys, n, rows);
      return;
    }
    const size_t d = schema_.dim;
    weights_.resize(n * d);
    state_.resize(n * sd);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(weights_.data() + i * d, rows + i * (d + sd), d * sizeof(float));
      std::memcpy(state_.data() + i * sd, rows + i * (d + sd) + d, sd * sizeof(float));
    }
    store_->Assign(keys, n, weights_.data(), state_.data());
  }
  size_t Export(int64_t* cursor, size_t max_rows, int64_t* keys, float* rows) override {
    const size_t sd = schema_.state_dim();
    if (sd == 0) return store_->Export(cursor, max_rows, keys, rows);
    const size_t d = schema_.dim;
    weights_.resize(max_rows * d);
    state_.resize(max_rows * sd);
    const size_t n = store_->Export(cursor, max_rows, keys, weights_.data(), state_.data());
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(rows + i * (d + sd), weights_.data() + i * d, d * sizeof(float));
      std::memcpy(rows + i * (d + sd) + d, state_.data() + i * sd, sd * sizeof(float));
    }
    return n;
  }
  void Erase(const int64_t* keys, size_t n) override { store_->Erase(keys, n); }
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta) override {
    store_->Save(dir, meta, /*weights_only=*/false);
  }
  PendingWrite BeginCheckpointChain(const std::string& dir, int64_t step,
                                    const std::map<std::string, std::string>& meta,
                                    const store::ChainPolicy& policy) override {
    std::shared_ptr<store::EmbeddingStore::PendingCheckpoint> pending =
        store_->BeginCheckpoint(dir, step, meta, policy);
    return [pending] { return pending->Write(); };
  }
  std::map<std::string, int64_t> Stats() override {
    const auto s = store_->Stats();
    return {{"rows", s.rows},
            {"bytes_resident", s.bytes_resident},
            {"bytes_spilled", s.bytes_spilled},
            {"pages", s.pages},
            {"pages_spilled", s.pages_spilled},
            {"spill_count", s.spill_count},
            {"swap_outs", s.swap_outs},
            {"swap_ins", s.swap_ins},
            {"lookups", s.lookups},
            {"updates", s.updates},
            {"memory_budget", s.memory_budget},
            {"state_dim", s.state_dim},
            {"slot_bytes", s.slot_bytes},
            {"dirty_rows", s.dirty_rows}};
  }

 private:
  std::unique_ptr<store::EmbeddingStore> store_;
  TableSchema schema_;
  std::vector<float> weights_;  // Read / Assign with state: the store's separate halves
  std::vector<float> state_;
};

}  // namespace

TableBackendFactory MakeEmbeddingStoreBackendFactory(const store::StoreOptions& store) {
  return [store](const std::string&, const TableSchema& schema) -> std::unique_ptr<TableBackend> {
    store::StoreOptions o = store;
    o.dim = static_cast<int>(schema.dim);
    o.init = schema.init;
    o.key_bound = schema.key_bound;
    o.optimizer = schema.optimizer;
    return std::make_unique<EmbeddingStoreBackend>(std::make_unique<store::EmbeddingStore>(o));
  };
}

TableBackendLoader MakeEmbeddingStoreBackendLoader(const store::StoreOptions& store) {
  return [store](const std::string& dir, std::map<std::string, std::string>* meta)
             -> std::unique_ptr<TableBackend> {
    store::LoadOverrides o;
    o.num_threads = store.num_threads;
    o.memory_budget = store.memory_budget;
    if (!store.spill_dir.empty()) o.spill_dir = store.spill_dir;
    o.high_watermark = store.high_watermark;
    o.low_watermark = store.low_watermark;
    return std::make_unique<EmbeddingStoreBackend>(store::EmbeddingStore::Load(dir, o, meta));
  };
}

}  // namespace bagpipe::shard
