// ProgressGroup / ProgressPool: a few threads driving the progress of many UCX endpoints (a
// shard's), instead of a progress thread per endpoint. An endpoint attached to a group keeps
// its own UCP worker, endpoint, slot ring and command queue (ucx_endpoint.h); the group's
// thread runs its loop iterations (Endpoint::Step) when one of its descriptors is ready (its
// command eventfd, its worker's event fd, its control connection) or while it is busy, and
// sleeps in one epoll_wait over all of them otherwise. A thousand idle connections then cost
// their workers' memory and a few registrations, not a thousand threads.
//
// Thread safety: Attach / Wake / endpoints() from any thread. Everything else runs on the
// group's thread, which is every attached endpoint's progress thread
// (Endpoint::OnProgressThread is true there for all of them).
//
// Invariants:
//   1. An attached endpoint is set up, stepped and torn down on the group's thread only; it
//      is stepped whenever one of its descriptors is ready and again without waiting while it
//      reports work (busy, a worker that cannot be armed), so no event waits for another
//      endpoint's idle period.
//   2. A descriptor leaves the epoll set before it can be closed: the worker's event fd
//      before the worker is destroyed (teardown), the control connection when the endpoint
//      stops watching it; the endpoint's Close returns only after the group let go of it.
//   3. A group outlives its endpoints (each holds a reference); its thread exits when it is
//      destroyed.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace bagpipe::transport::ucx {

class Endpoint;

class ProgressGroup {
 public:
  // Starts the group's thread. Throws TransportError if epoll / eventfd cannot be created.
  ProgressGroup();
  ~ProgressGroup();
  ProgressGroup(const ProgressGroup&) = delete;
  ProgressGroup& operator=(const ProgressGroup&) = delete;

  // The group's thread sets `ep` up (Endpoint::Start waits for it) and drives it from then
  // on. REQUIRES: called once per endpoint, by Endpoint::Start.
  void Attach(Endpoint* ep);
  size_t endpoints() const { return count_.load(); }

 private:
  enum Kind : int { kWake = 0, kEvents = 1, kControl = 2 };
  struct Watch {
    Endpoint* ep;
    Kind kind;
  };
  void Run();
  void Add(int fd, Endpoint* ep, Kind kind);
  void Del(int fd);
  void SyncControl(Endpoint* ep);
  void Release(Endpoint* ep);

  int epfd_ = -1;
  int wake_fd_ = -1;  // new attachments, stop
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> count_{0};
  std::mutex mu_;                   // guards pending_
  std::vector<Endpoint*> pending_;  // attached, not yet set up
  // ---- the group's thread ----
  std::unordered_set<Endpoint*> eps_;
  std::unordered_map<int, Watch> watches_;       // fd -> what it is
  std::unordered_map<Endpoint*, int> control_;   // the control fd each endpoint has watched
  bool any_without_events_ = false;              // an endpoint without a worker event fd
};

// A fixed set of groups; new endpoints go to the least loaded one.
class ProgressPool {
 public:
  // REQUIRES: threads >= 1.
  explicit ProgressPool(size_t threads);
  std::shared_ptr<ProgressGroup> Pick();
  size_t threads() const { return groups_.size(); }

 private:
  std::vector<std::shared_ptr<ProgressGroup>> groups_;
};

}  // namespace bagpipe::transport::ucx
