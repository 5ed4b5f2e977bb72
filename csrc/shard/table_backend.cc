#include "shard/table_backend.h"

#include <cstdio>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::shard {
namespace {

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

std::string FloatText(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

const char* InitKindName(store::InitKind k) {
  switch (k) {
    case store::InitKind::kUniform: return "uniform";
    case store::InitKind::kZeros: return "zeros";
    case store::InitKind::kConstant: return "constant";
  }
  return "unknown";
}

std::string InitDifference(const store::InitSpec& a, const store::InitSpec& b) {
  if (a.kind != b.kind) {
    return std::string("init '") + InitKindName(a.kind) + "' differs from the table's init '" +
           InitKindName(b.kind) + "'";
  }
  if (a.kind == store::InitKind::kUniform) {
    if (!SameBits(a.bound, b.bound)) {
      return "init_bound " + FloatText(a.bound) + " differs from the table's " + FloatText(b.bound);
    }
    bool same_ranges = a.bound_starts == b.bound_starts && a.bound_values.size() == b.bound_values.size();
    for (size_t i = 0; same_ranges && i < a.bound_values.size(); ++i) {
      same_ranges = SameBits(a.bound_values[i], b.bound_values[i]);
    }
    if (!same_ranges) return "init_bound ranges differ from the table's";
  }
  if (a.kind == store::InitKind::kConstant && !SameBits(a.value, b.value)) {
    return "init_value " + FloatText(a.value) + " differs from the table's " + FloatText(b.value);
  }
  if (a.kind == store::InitKind::kUniform && a.seed != b.seed) {
    return "seed " + std::to_string(a.seed) + " differs from the table's seed " + std::to_string(b.seed);
  }
  return {};
}

// The value of optimizer field `field` ("optimizer.eps", ...) of spec `o`, as text.
std::string OptimizerFieldText(const store::OptimizerSpec& o, const std::string& field) {
  if (field == "optimizer.kind") return std::string("'") + store::OptimizerKindName(o.kind) + "'";
  if (field == "optimizer.eps") return FloatText(o.eps);
  if (field == "optimizer.beta1") return FloatText(o.beta1);
  if (field == "optimizer.beta2") return FloatText(o.beta2);
  if (field == "optimizer.weight_decay") return FloatText(o.weight_decay);
  return FloatText(o.initial_accumulator_value);
}

}  // namespace

std::string SchemaDifference(const TableSchema& a, const TableSchema& b) {
  if (a.dim != b.dim) {
    return "dim " + std::to_string(a.dim) + " differs from the table's dim " + std::to_string(b.dim);
  }
  if (std::string d = InitDifference(a.init, b.init); !d.empty()) return d;
  if (a.key_bound != b.key_bound) {
    return "key_bound " + std::to_string(a.key_bound) + " differs from the table's " +
           std::to_string(b.key_bound);
  }
  if (const std::string f = store::OptimizerSpecDifference(a.optimizer, b.optimizer); !f.empty()) {
    return f + " " + OptimizerFieldText(a.optimizer, f) + " differs from the table's " +
           OptimizerFieldText(b.optimizer, f) + " (its rows hold the state of that optimizer)";
  }
  return {};
}

TableBackend::PendingWrite TableBackend::BeginCheckpointChain(
    const std::string& dir, int64_t, const std::map<std::string, std::string>& meta,
    const store::ChainPolicy&) {
  Save(dir, meta);
  return [] { return store::CheckpointResult{}; };
}

void TableBackend::ApplyGradientsSegments(const store::GradSegment* segs, size_t count, float lr,
                                          int grad_divisor) {
  const size_t dim = schema().dim;
  size_t n = 0;
  for (size_t s = 0; s < count; ++s) n += segs[s].n;
  concat_keys_.resize(n);
  concat_grads_.resize(n * dim);
  size_t at = 0;
  for (size_t s = 0; s < count; ++s) {
    if (segs[s].n == 0) continue;
    std::memcpy(concat_keys_.data() + at, segs[s].keys, segs[s].n * sizeof(int64_t));
    std::memcpy(concat_grads_.data() + at * dim, segs[s].grads, segs[s].n * dim * sizeof(float));
    at += segs[s].n;
  }
  ApplyGradients(concat_keys_.data(), n, concat_grads_.data(), lr, grad_divisor);
}

size_t TableBackend::Export(int64_t*, size_t, int64_t*, float*) {
  throw ValueError("this table backend cannot list its rows (a resharded restore needs it)");
}

void TableBackend::Erase(const int64_t*, size_t n) {
  if (n > 0) throw ValueError("this table backend cannot evict rows (virtual tables)");
}

}  // namespace bagpipe::shard
