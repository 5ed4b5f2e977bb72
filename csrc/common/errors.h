// Error types shared by the native core. The bindings translate each to one Python
// exception class, so callers see TypeError / ValueError / TimeoutError / SessionError.
//
// Thread safety: plain value types.
// Invariants:
//   1. Each type maps to exactly one Python class (bindings/errors.h), in every extension
//      module; ShuttingDownError is a TransportError, so a caller catching TransportError
//      sees a draining shard too; StartStepError is a ValueError.
#pragma once

#include <stdexcept>
#include <string>

namespace bagpipe {

// Wrong dtype, layout or kind of an argument (Python TypeError).
class TypeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Wrong shape, size, range or configuration value (Python ValueError).
class ValueError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bounded wait expired (Python TimeoutError).
class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The commit session is failed or closed; every later call on it raises this
// (Python torchrec_bagpipe.SessionError, a RuntimeError).
class SessionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A transport-level failure: connection refused, torn or malformed stream
// (Python torchrec_bagpipe.TransportError, a ConnectionError).
class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A PS shard is draining (SIGTERM, or stopped by its owner): it refuses new work and told its
// clients so (Python torchrec_bagpipe.ShuttingDownError, a TransportError).
class ShuttingDownError : public TransportError {
 public:
  using TransportError::TransportError;
};

// A session's declared start step is not its table's committed step on a shard: a new job
// meeting a table that already committed steps (they would be acknowledged, not applied),
// or a resume from another step (Python torchrec_bagpipe.ps.StartStepError, a ValueError).
class StartStepError : public ValueError {
 public:
  using ValueError::ValueError;
};

// The disk tier or a checkpoint could not be read or written (Python OSError).
class IOError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A memory-only store ran out of its DRAM budget (Python MemoryError). Raised before any
// row of the failing call is written.
class MemoryBudgetError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace bagpipe
