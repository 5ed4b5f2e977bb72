// ProgressGroup / ProgressPool: a few threads driving the progress of many UCX endpoints (a
// shard's), instead of a progress thread per endpoint. The endpoints attached to a group share
// ONE UCP worker, the group's (created on its thread when the first endpoint is set up), and
// keep their own UCP endpoint, slot ring and command queue (ucx_endpoint.h). The group's
// thread runs an endpoint's loop iterations (Endpoint::Step) when one of its descriptors is
// ready (its command eventfd, its control connection), when a UCX callback of the shared
// worker named it (an active message for its ring, a completion of its request) or while it
// is busy, and sleeps in one epoll_wait over all of them and the shared worker's event fd
// otherwise. A thousand idle connections then cost a few workers, not a thousand workers and
// a thousand threads.
//
// Demultiplexing: every active message on a shared worker carries its connection's ring id
// (wire::MessagePrefix); the group maps ring ids to endpoints (Register). A message naming no
// registered ring is dropped and counted (stray()): it cannot belong to a live connection.
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
//      destroyed, after destroying the shared worker.
//   4. The shared worker outlives every request made on it: a request of a torn-down endpoint
//      that UCX never completed is handed to the group (orphans_) and freed by its callback
//      or after the worker is destroyed, never touching the endpoint again.
//   5. An endpoint is registered under its ring id from before the client can send (the
//      BootReply) until its teardown; messages reach only the endpoint they name.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace bagpipe::transport::ucx {

class Endpoint;
class Context;

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
  // UCP workers this group created (0 or 1) and that are alive; active messages dropped
  // because they named no registered ring.
  size_t workers() const { return workers_.load(); }
  uint64_t stray() const { return stray_.load(); }

 private:
  friend class Endpoint;
  // The group's thread: the shared worker for `context`, created on first use (*efd: its
  // event fd, -1 if none). nullptr if the group shares a worker of another context (the
  // endpoint then makes its own). Throws TransportError if UCX cannot create it.
  ucp_worker_h SharedWorker(const std::shared_ptr<Context>& context, int* efd);
  void Register(uint64_t ring_id, Endpoint* ep);  // any thread
  void Unregister(uint64_t ring_id);              // any thread
  // The group's thread, from UCX callbacks: step `ep` soon (its event was consumed by
  // another endpoint's progress of the shared worker).
  void Woke(Endpoint* ep);
  void Orphan(void* op);    // the group's thread
  void Unorphan(void* op);  // the group's thread: the orphan's callback ran
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_len, void* data,
                           size_t length, const ucp_am_recv_param_t* param, unsigned am_id);
  static ucs_status_t OnDoorbellAm(void* arg, const void* header, size_t header_len, void* data,
                                   size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnFrameAm(void* arg, const void* header, size_t header_len, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  void DestroyWorker();

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
  std::shared_ptr<Context> context_;             // of the shared worker
  ucp_worker_h worker_ = nullptr;                // the shared worker
  int worker_efd_ = -1;                          // its event fd (in the epoll set), or -1
  std::unordered_set<Endpoint*> woken_;          // named by a callback: step next round
  std::unordered_set<void*> orphans_;            // Endpoint::Op of torn-down endpoints
  std::atomic<size_t> workers_{0};
  std::atomic<uint64_t> stray_{0};
  // ---- any thread ----
  std::mutex ring_mu_;                                 // guards rings_
  std::unordered_map<uint64_t, Endpoint*> rings_;      // ring id -> registered endpoint
};

// A fixed set of groups; new endpoints go to the least loaded one.
class ProgressPool {
 public:
  // REQUIRES: threads >= 1.
  explicit ProgressPool(size_t threads);
  std::shared_ptr<ProgressGroup> Pick();
  size_t threads() const { return groups_.size(); }
  size_t workers() const;  // UCP workers alive in the pool's groups
  uint64_t stray() const;

 private:
  std::vector<std::shared_ptr<ProgressGroup>> groups_;
};

}  // namespace bagpipe::transport::ucx
