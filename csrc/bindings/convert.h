// Conversions shared by more than one binding file: enum names <-> values, a shard server's
// counters as a dict. Errors name the argument (ValueError).
//
// Thread safety: the dict builders need the GIL; the name conversions are pure functions.
// Invariants:
//   1. ParseInitKind(InitKindName(k)) == k for every InitKind.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "common/errors.h"
#include "server/server_stats.h"
#include "store/init.h"

namespace bagpipe::bindings {

// REQUIRES: kind is 'uniform', 'zeros' or 'constant' (else ValueError naming `init`).
inline store::InitKind ParseInitKind(const std::string& kind) {
  if (kind == "uniform") return store::InitKind::kUniform;
  if (kind == "zeros") return store::InitKind::kZeros;
  if (kind == "constant") return store::InitKind::kConstant;
  throw ValueError("init must be 'uniform', 'zeros' or 'constant', got '" + kind + "'");
}

// The name ParseInitKind reads ("unknown" for a value outside the enum).
inline const char* InitKindName(store::InitKind kind) {
  switch (kind) {
    case store::InitKind::kUniform: return "uniform";
    case store::InitKind::kZeros: return "zeros";
    case store::InitKind::kConstant: return "constant";
  }
  return "unknown";
}

// REQUIRES: GIL held. The dict behind ShardServerCore.stats() and UcxShardServerCore.stats().
inline pybind11::dict ServerStatsDict(const server::ServerStats& st) {
  pybind11::dict d;
  d["accepted"] = st.accepted;
  d["refused"] = st.refused;
  d["shed"] = st.shed;
  d["handshake_timeouts"] = st.handshake_timeouts;
  d["idle_timeouts"] = st.idle_timeouts;
  d["active"] = st.active;
  d["unauthenticated"] = st.unauthenticated;
  d["threads"] = st.threads;
  d["frames"] = st.frames;
  d["bytes_in"] = st.bytes_in;
  d["bytes_out"] = st.bytes_out;
  d["closed_by_server"] = st.closed_by_server;
  d["ucx_workers"] = st.ucx_workers;
  d["ucx_stray"] = st.ucx_stray;
  return d;
}

}  // namespace bagpipe::bindings
