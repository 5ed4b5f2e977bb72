#include "commit/store_table.h"

#include <memory>

#include "common/errors.h"
#include "store/embedding_store.h"

namespace bagpipe::commit {
namespace {

class StoreTable : public TableStore {
 public:
  explicit StoreTable(std::unique_ptr<store::EmbeddingStore> s) : store_(std::move(s)) {
    const auto& o = store_->options();
    spec_.dim = static_cast<uint32_t>(o.dim);
    spec_.init = o.init;
    spec_.key_bound = o.key_bound < 0 ? -1 : o.key_bound;
  }
  const TableSpec& spec() const override { return spec_; }
  void ApplySgd(const int64_t* keys, size_t n, const float* grads, float lr, int div) override {
    store_->ApplySgd(keys, n, grads, lr, div);
  }
  void ApplySgdSegments(const store::GradSegment* segs, size_t count, float lr, int div) override {
    store_->ApplySgdSegments(segs, count, lr, div);
  }
  void Read(const int64_t* keys, size_t n, float* out) override {
    store_->Lookup(keys, n, out, /*insert_missing=*/false);
  }
  void Assign(const int64_t* keys, size_t n, const float* rows) override {
    store_->Assign(keys, n, rows);
  }
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta) override {
    store_->Save(dir, meta, /*weights_only=*/false);
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
            {"memory_budget", s.memory_budget}};
  }

 private:
  std::unique_ptr<store::EmbeddingStore> store_;
  TableSpec spec_;
};

}  // namespace

TableFactory MakeStoreTableFactory(const StoreDefaults& d) {
  return [d](const std::string&, const TableSpec& spec) -> std::unique_ptr<TableStore> {
    store::StoreOptions o;
    o.dim = static_cast<int>(spec.dim);
    o.num_shards = d.num_shards;
    o.num_threads = d.num_threads;
    o.init = spec.init;
    o.key_bound = spec.key_bound;
    o.page_rows = d.page_rows;
    o.memory_budget = d.memory_budget;
    o.spill_dir = d.spill_dir;
    o.high_watermark = d.high_watermark;
    o.low_watermark = d.low_watermark;
    return std::make_unique<StoreTable>(std::make_unique<store::EmbeddingStore>(o));
  };
}

TableLoader MakeStoreTableLoader(const StoreDefaults& d) {
  return [d](const std::string& dir, std::map<std::string, std::string>* meta)
             -> std::unique_ptr<TableStore> {
    store::LoadOverrides o;
    o.num_threads = d.num_threads;
    o.memory_budget = d.memory_budget;
    if (!d.spill_dir.empty()) o.spill_dir = d.spill_dir;
    o.high_watermark = d.high_watermark;
    o.low_watermark = d.low_watermark;
    return std::make_unique<StoreTable>(store::EmbeddingStore::Load(dir, o, meta));
  };
}

}  // namespace bagpipe::commit
