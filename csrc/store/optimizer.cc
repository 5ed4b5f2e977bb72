#include "store/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::store {

namespace {

constexpr OptimizerKind kKinds[] = {OptimizerKind::kSgd, OptimizerKind::kAdagrad,
                                    OptimizerKind::kRowWiseAdagrad, OptimizerKind::kAdam};

std::string Show(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

void CheckNonNegative(double v, const char* field) {
  if (!(std::isfinite(v) && v >= 0.0 && std::isfinite(static_cast<float>(v)))) {
    throw ValueError(std::string(field) + " must be finite and >= 0 (also as float32), got " +
                     Show(v));
  }
}

void CheckBeta(double v, const char* field) {
  if (!(v >= 0.0 && v < 1.0)) {
    throw ValueError(std::string(field) + " must be in [0, 1), got " + Show(v));
  }
}

// One fp32 rounding; a negative zero becomes +0 (it is >= 0 and means "none").
float F32(double v) { return static_cast<float>(v) + 0.0f; }

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

}  // namespace

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdagrad: return "adagrad";
    case OptimizerKind::kRowWiseAdagrad: return "rowwise_adagrad";
    case OptimizerKind::kAdam: return "adam";
  }
  return "unknown";
}

OptimizerKind ParseOptimizerKind(const std::string& name) {
  for (OptimizerKind k : kKinds) {
    if (name == OptimizerKindName(k)) return k;
  }
  throw ValueError("optimizer.kind must be one of 'sgd', 'adagrad', 'rowwise_adagrad', "
                   "'adam', got '" + name + "'");
}

void ValidateOptimizerSpec(const OptimizerSpec& spec) {
  if (std::find(std::begin(kKinds), std::end(kKinds), spec.kind) == std::end(kKinds)) {
    throw ValueError("optimizer.kind: unknown kind " + std::to_string(static_cast<int>(spec.kind)));
  }
  CheckNonNegative(spec.eps, "optimizer.eps");
  CheckBeta(spec.beta1, "optimizer.beta1");
  CheckBeta(spec.beta2, "optimizer.beta2");
  CheckNonNegative(spec.weight_decay, "optimizer.weight_decay");
  CheckNonNegative(spec.initial_accumulator_value, "optimizer.initial_accumulator_value");
}

int StateDim(OptimizerKind kind, int dim) {
  switch (kind) {
    case OptimizerKind::kSgd: return 0;
    case OptimizerKind::kAdagrad: return dim;
    case OptimizerKind::kRowWiseAdagrad: return 1;
    case OptimizerKind::kAdam: return 2 * dim;
  }
  return 0;
}

OptimizerConstants ConstantsOf(const OptimizerSpec& spec) {
  OptimizerConstants c;
  c.eps = F32(spec.eps);
  c.weight_decay = F32(spec.weight_decay);
  c.c1 = static_cast<float>(1.0 - spec.beta1);
  c.c2 = static_cast<float>(1.0 - spec.beta2);
  c.initial_state = spec.kind == OptimizerKind::kAdagrad || spec.kind == OptimizerKind::kRowWiseAdagrad
                        ? F32(spec.initial_accumulator_value)
                        : 0.0f;
  return c;
}

std::string OptimizerSpecDifference(const OptimizerSpec& a, const OptimizerSpec& b) {
  if (a.kind != b.kind) return "optimizer.kind";
  const OptimizerConstants ca = ConstantsOf(a), cb = ConstantsOf(b);
  const bool adagrad = a.kind == OptimizerKind::kAdagrad || a.kind == OptimizerKind::kRowWiseAdagrad;
  const bool adam = a.kind == OptimizerKind::kAdam;
  if ((adagrad || adam) && Bits(ca.eps) != Bits(cb.eps)) return "optimizer.eps";
  if (adam && Bits(ca.c1) != Bits(cb.c1)) return "optimizer.beta1";
  if (adam && Bits(ca.c2) != Bits(cb.c2)) return "optimizer.beta2";
  if (Bits(ca.weight_decay) != Bits(cb.weight_decay)) return "optimizer.weight_decay";
  if (adagrad && Bits(ca.initial_state) != Bits(cb.initial_state)) {
    return "optimizer.initial_accumulator_value";
  }
  return "";
}

void InitialState(const OptimizerSpec& spec, int dim, float* state) {
  const int n = StateDim(spec.kind, dim);
  std::fill(state, state + n, ConstantsOf(spec).initial_state);
}

}  // namespace bagpipe::store
