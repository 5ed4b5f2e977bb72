#include "server/admission.h"

#include <algorithm>
#include <type_traits>

#include "common/errors.h"

namespace bagpipe::server {

Admission::Admission(AdmissionLimits limits) : limits_(limits) {
  if (limits_.max_connections == 0) throw ValueError("max_connections must be >= 1");
  if (limits_.max_unauthenticated == 0) throw ValueError("max_unauthenticated must be >= 1");
  if (limits_.max_unauthenticated_per_host == 0) {
    throw ValueError("max_unauthenticated_per_host must be >= 1");
  }
}

void Admission::ForgetPending(Fifo::iterator it) {
  auto h = by_host_.find(it->host);
  if (h != by_host_.end()) {
    auto& l = h->second;
    l.erase(std::find(l.begin(), l.end(), it));
    if (l.empty()) by_host_.erase(h);
  }
  pending_.erase(it->id);
  fifo_.erase(it);
}

template <typename It>
It Admission::PickVictim(It begin, It end, const Spare& spare) {
  It it = begin;
  for (int asked = 0; spare && it != end && asked < kMaxSpared; ++asked) {
    uint64_t id;
    if constexpr (std::is_same_v<It, Fifo::iterator>) {
      id = it->id;
    } else {
      id = (*it)->id;
    }
    if (!spare(id)) return it;
    ++it;
  }
  return it == end ? begin : it;  // everyone spared: the oldest after all
}

Admission::Decision Admission::Admit(uint64_t id, const std::string& host,
                                     Clock::time_point now, const Spare& spare) {
  Decision d;
  auto shed = [&](Fifo::iterator it) {
    d.shed.push_back(it->id);
    known_.erase(it->id);
    --total_;
    ForgetPending(it);
  };
  // Room in total: authenticated connections are never shed, the oldest pending one is.
  if (total_ >= limits_.max_connections) {
    if (fifo_.empty()) return d;  // every slot holds an authenticated client: refuse
    shed(PickVictim(fifo_.begin(), fifo_.end(), spare));
  }
  auto h = by_host_.find(host);
  if (h != by_host_.end() && h->second.size() >= limits_.max_unauthenticated_per_host) {
    shed(*PickVictim(h->second.begin(), h->second.end(), spare));
  }
  if (fifo_.size() >= limits_.max_unauthenticated) {
    shed(PickVictim(fifo_.begin(), fifo_.end(), spare));
  }
  fifo_.push_back(Pending{id, host, now});
  auto it = std::prev(fifo_.end());
  pending_.emplace(id, it);
  by_host_[host].push_back(it);
  known_.emplace(id, true);
  ++total_;
  d.admit = true;
  return d;
}

void Admission::Authenticated(uint64_t id) {
  auto it = pending_.find(id);
  if (it != pending_.end()) ForgetPending(it->second);
}

void Admission::Closed(uint64_t id) {
  if (known_.erase(id) == 0) return;
  --total_;
  auto it = pending_.find(id);
  if (it != pending_.end()) ForgetPending(it->second);
}

std::optional<uint64_t> Admission::ShedOldest() {
  if (fifo_.empty()) return std::nullopt;
  const uint64_t id = fifo_.front().id;
  known_.erase(id);
  --total_;
  ForgetPending(fifo_.begin());
  return id;
}

std::vector<uint64_t> Admission::Expired(Clock::time_point cutoff) {
  std::vector<uint64_t> out;
  while (!fifo_.empty() && fifo_.front().accepted < cutoff) {
    out.push_back(fifo_.front().id);
    ForgetPending(fifo_.begin());
  }
  return out;
}

}  // namespace bagpipe::server
