// The optimizer of an EmbeddingStore: which update rule runs on its rows (OptimizerSpec),
// how much state it keeps per row, and the fp32 constants the row kernels use. The update
// arithmetic itself is the numbered contract in embedding_store.h; the kernels that
// implement it are in optimizer_kernels.h.
//
// Thread safety: plain values and pure functions.
//
// Invariants:
//   1. StateDim(kind, dim) floats of state per row: SGD 0, Adagrad dim, row-wise Adagrad 1,
//      Adam 2*dim (first moments, then second moments).
//   2. Every constant the arithmetic uses is one fp32 rounding of a spec field (eps,
//      weight_decay, initial_accumulator_value) or of a double expression (1 - beta1,
//      1 - beta2), so a caller that rounds the same way reproduces it bit for bit.
//   3. A spec that passes ValidateOptimizerSpec has finite fp32 constants.
#pragma once

#include <cstdint>
#include <string>

namespace bagpipe::store {

enum class OptimizerKind : uint8_t { kSgd = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kSgd;
  double eps = 1e-8;                       // Adagrad, row-wise Adagrad, Adam
  double beta1 = 0.9;                      // Adam
  double beta2 = 0.999;                    // Adam
  double weight_decay = 0.0;               // all kinds (L2: added to the scaled gradient)
  double initial_accumulator_value = 0.0;  // Adagrad, row-wise Adagrad

  bool operator==(const OptimizerSpec&) const = default;
};

// "sgd", "adagrad", "rowwise_adagrad", "adam".
const char* OptimizerKindName(OptimizerKind kind);

// The kind named `name`. REQUIRES: one of the names above (ValueError naming
// `optimizer.kind` otherwise, listing the supported ones).
OptimizerKind ParseOptimizerKind(const std::string& name);

// Throws ValueError naming the field (optimizer.eps, optimizer.beta1, ...) when a field is
// out of range: eps, weight_decay, initial_accumulator_value finite and >= 0 (also after
// rounding to fp32); beta1, beta2 in [0, 1). Every field is checked, whatever the kind.
void ValidateOptimizerSpec(const OptimizerSpec& spec);

// Floats of optimizer state per row (invariant 1).
int StateDim(OptimizerKind kind, int dim);

// The first field in which `a` and `b` differ in a way the arithmetic of a's kind can see
// (the kind itself, then only the fields the kind uses, compared after the rounding of
// invariant 2), as "optimizer.<field>"; empty when they run the same update.
std::string OptimizerSpecDifference(const OptimizerSpec& a, const OptimizerSpec& b);

// The fp32 constants of a spec (invariant 2).
struct OptimizerConstants {
  float eps = 0.0f;            // float(eps)
  float weight_decay = 0.0f;   // float(weight_decay)
  float c1 = 0.0f;             // float(1.0 - beta1), the subtraction in double
  float c2 = 0.0f;             // float(1.0 - beta2)
  float initial_state = 0.0f;  // Adagrad kinds: float(initial_accumulator_value); Adam: 0
};
// REQUIRES: ValidateOptimizerSpec(spec) passes.
OptimizerConstants ConstantsOf(const OptimizerSpec& spec);

// Writes the initial state of one row (StateDim(spec.kind, dim) floats).
void InitialState(const OptimizerSpec& spec, int dim, float* state);

}  // namespace bagpipe::store
