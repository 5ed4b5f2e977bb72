// Admission: which connections a shard server keeps while they have not authenticated yet.
// Hostile clients (a connection flood, slowloris connections that send a byte a second)
// cost the server nothing it cannot bound: at most max_unauthenticated such connections in
// total and max_unauthenticated_per_host from one address, each at most handshake_timeout
// old. A new connection is always admitted by shedding the OLDEST unauthenticated one
// (from its own address first), so a legitimate client, which authenticates within one
// round trip of connecting, gets in while the flood is being shed. Authenticated
// connections (they hold the job token, so they are trusted) are bounded by
// max_connections; past it new connections are refused. A candidate for shedding that is
// about to authenticate (`Spare`: its complete Hello already arrived, unread) is passed over
// for the next oldest, so even a client sharing its address with a flood gets in.
//
// Thread safety: none; the server guards it with its own mutex. Pure bookkeeping: it
// never touches a socket (the server closes what it is told to shed).
//
// Invariants:
//   1. unauthenticated() <= max_unauthenticated and, per host, <= max_unauthenticated_per_host
//      after every Admit (the shed ids are already forgotten).
//   2. total() <= max_connections after every Admit that admits.
//   3. Expired() returns unauthenticated connections in accept order (the oldest first), each
//      exactly once, and forgets them.
//   4. An id is counted at most once: Authenticated / Closed of an unknown or shed id is a no-op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/deadline.h"

namespace bagpipe::server {

struct AdmissionLimits {
  size_t max_connections = 1024;              // every connection, authenticated or not
  size_t max_unauthenticated = 256;           // connections that have not said Hello yet
  size_t max_unauthenticated_per_host = 32;   // of those, from one peer address
};

class Admission {
 public:
  // REQUIRES: every limit >= 1 (ValueError naming it).
  explicit Admission(AdmissionLimits limits);

  struct Decision {
    bool admit = false;          // false: refuse the new connection (max_connections)
    std::vector<uint64_t> shed;  // unauthenticated connections to close to make room
  };
  // Whether a pending connection is about to authenticate and should not be shed (e.g. its
  // whole Hello already waits in its socket). Asked for at most kMaxSpared candidates.
  using Spare = std::function<bool(uint64_t id)>;
  static constexpr int kMaxSpared = 4;
  // A new connection `id` from `host` accepted at `now` (invariants 1, 2).
  Decision Admit(uint64_t id, const std::string& host, Clock::time_point now,
                 const Spare& spare = nullptr);
  // `id` authenticated: it no longer counts against the unauthenticated bounds.
  void Authenticated(uint64_t id);
  // `id` is gone (any state).
  void Closed(uint64_t id);
  // Sheds the oldest unauthenticated connection (as Admit would), if there is one.
  std::optional<uint64_t> ShedOldest();
  // Unauthenticated connections accepted before `cutoff` (invariant 3).
  std::vector<uint64_t> Expired(Clock::time_point cutoff);

  // Connections admitted and not closed, of them not yet authenticated, and the bounds.
  size_t total() const { return total_; }
  size_t unauthenticated() const { return fifo_.size(); }
  const AdmissionLimits& limits() const { return limits_; }

 private:
  struct Pending {
    uint64_t id;
    std::string host;
    Clock::time_point accepted;
  };
  using Fifo = std::list<Pending>;
  void ForgetPending(Fifo::iterator it);
  // The oldest entry of `order` (fifo_ or one host's list) that `spare` does not keep.
  template <typename It>
  static It PickVictim(It begin, It end, const Spare& spare);

  const AdmissionLimits limits_;
  size_t total_ = 0;
  Fifo fifo_;                                               // unauthenticated, accept order
  std::unordered_map<uint64_t, Fifo::iterator> pending_;    // id -> its fifo entry
  std::unordered_map<std::string, std::list<Fifo::iterator>> by_host_;  // accept order
  std::unordered_map<uint64_t, bool> known_;                // every counted id
};

}  // namespace bagpipe::server
