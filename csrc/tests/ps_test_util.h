// Helpers for the commit protocol tests (shard and transport): a map-based reference TableBackend with the
// store's SGD arithmetic (an SGD table: no optimizer state), a ServerLink that records
// frames, and a reference SGD model.
#pragma once

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "protocol/wire.h"
#include "shard/table_backend.h"
#include "transport/frame_handler.h"

namespace bagpipe::testing {

// Reference table: rows never written read as init.value + key * 1e-3 (a cheap
// deterministic initialiser that still differs per key).
class MapTable : public shard::TableBackend {
 public:
  explicit MapTable(const shard::TableSchema& spec) : schema_(spec) {
    if (spec.optimizer.kind != store::OptimizerKind::kSgd) {
      throw std::invalid_argument("MapTable models SGD tables only");
    }
  }
  const shard::TableSchema& schema() const override { return schema_; }

  std::vector<float> Row(int64_t key) const {
    auto it = rows_.find(key);
    if (it != rows_.end()) return it->second;
    std::vector<float> r(schema_.dim);
    for (uint32_t c = 0; c < schema_.dim; ++c) {
      r[c] = schema_.init.value + static_cast<float>(key % 1000) * 1e-3f + static_cast<float>(c) * 1e-4f;
    }
    return r;
  }

  void ApplyGradients(const int64_t* keys, size_t n, const float* grads, float lr,
                      int div) override {
    ++apply_calls;
    const size_t d = schema_.dim;
    std::map<int64_t, std::vector<float>> sum;
    std::vector<int64_t> order;
    for (size_t i = 0; i < n; ++i) {
      auto it = sum.find(keys[i]);
      if (it == sum.end()) {
        sum.emplace(keys[i], std::vector<float>(grads + i * d, grads + (i + 1) * d));
        order.push_back(keys[i]);
      } else {
        for (size_t c = 0; c < d; ++c) it->second[c] += grads[i * d + c];
      }
    }
    for (int64_t k : order) {
      auto g = sum[k];
      auto w = Row(k);
      for (size_t c = 0; c < d; ++c) {
        float u = g[c];
        if (div != 1) u = u / static_cast<float>(div);
        u = u * lr;
        w[c] = w[c] - u;
      }
      rows_[k] = w;
    }
  }
  // SGD rows carry no state: with or without it, a row is dim floats.
  void Read(const int64_t* keys, size_t n, float* out, bool /*with_state*/) override {
    for (size_t i = 0; i < n; ++i) {
      auto r = Row(keys[i]);
      std::memcpy(out + i * schema_.dim, r.data(), schema_.dim * 4);
    }
  }
  void Assign(const int64_t* keys, size_t n, const float* rows, bool /*with_state*/) override {
    for (size_t i = 0; i < n; ++i) {
      rows_[keys[i]] = std::vector<float>(rows + i * schema_.dim, rows + (i + 1) * schema_.dim);
    }
  }
  void Save(const std::string& dir, const std::map<std::string, std::string>& meta) override {
    saved_dir = dir;
    saved_meta = meta;
    saved_rows = rows_;
  }
  std::map<std::string, int64_t> Stats() override {
    return {{"rows", static_cast<int64_t>(rows_.size())}};
  }

  int apply_calls = 0;
  std::string saved_dir;
  std::map<std::string, std::string> saved_meta;
  std::map<int64_t, std::vector<float>> saved_rows;

 private:
  shard::TableSchema schema_;
  std::map<int64_t, std::vector<float>> rows_;
};

inline shard::TableBackendFactory MapTableFactory(std::vector<MapTable*>* created = nullptr) {
  return [created](const std::string&, const shard::TableSchema& spec) {
    auto t = std::make_unique<MapTable>(spec);
    if (created) created->push_back(t.get());
    return std::unique_ptr<shard::TableBackend>(std::move(t));
  };
}

inline shard::TableBackendLoader NoLoader() {
  return [](const std::string& dir, std::map<std::string, std::string>*) -> std::unique_ptr<shard::TableBackend> {
    throw std::runtime_error("no loader in this test: " + dir);
  };
}

// A ServerLink that records every frame it is asked to send.
class RecordingLink : public transport::ServerLink {
 public:
  struct Frame {
    protocol::wire::MsgType type;
    protocol::wire::Status status;
    uint64_t tag;
    uint32_t slot;
    std::vector<uint8_t> fixed;
    std::vector<uint8_t> payload;
    std::string Text() const { return std::string(payload.begin(), payload.end()); }
  };

  RecordingLink() { authenticated = true; }

  bool Send(protocol::wire::MsgType type, protocol::wire::Status status, uint64_t tag, uint32_t slot,
            const void* fixed, size_t fixed_len, size_t payload_len,
            const transport::PayloadFill& fill) override {
    Frame f{type, status, tag, slot,
            std::vector<uint8_t>(static_cast<const uint8_t*>(fixed),
                                 static_cast<const uint8_t*>(fixed) + fixed_len),
            std::vector<uint8_t>(payload_len)};
    if (payload_len) fill(f.payload.data());
    std::lock_guard<std::mutex> lock(mu_);
    frames_.push_back(std::move(f));
    return true;
  }
  std::string Describe() const override { return "recording"; }

  std::vector<Frame> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    auto out = std::move(frames_);
    frames_.clear();
    return out;
  }

 private:
  std::mutex mu_;
  std::vector<Frame> frames_;
};

// Builds a Commit frame body (CommitBody + keys + grads).
inline std::vector<uint8_t> CommitBodyBytes(const protocol::wire::CommitBody& b,
                                            const std::vector<int64_t>& keys,
                                            const std::vector<float>& grads) {
  std::vector<uint8_t> out(sizeof(b) + keys.size() * 8 + grads.size() * 4);
  std::memcpy(out.data(), &b, sizeof(b));
  if (!keys.empty()) std::memcpy(out.data() + sizeof(b), keys.data(), keys.size() * 8);
  if (!grads.empty()) {
    std::memcpy(out.data() + sizeof(b) + keys.size() * 8, grads.data(), grads.size() * 4);
  }
  return out;
}

}  // namespace bagpipe::testing
