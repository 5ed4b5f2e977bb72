// EventLoop: the I/O engine of the shard servers. A fixed pool of threads shares one epoll
// set; every registered descriptor (a listener, a client connection, a UCX bootstrap) is
// armed one-shot, so a thousand idle connections cost a registration each, not a thread.
// A periodic tick (on whichever loop thread notices it is due) enforces deadlines.
//
//   loop.Add(fd, handler, EPOLLIN)   -> Registration (the handler keeps it to ask for more)
//   handler->OnEvents(events)        -> the interest to re-arm with, kKeepDisarmed, or 0
//   loop.AddInterest(reg, EPOLLOUT)  -> from any thread (e.g. a reply queued by another link)
//   0 returned                       -> deregistered, then handler->OnRemoved() (close the fd)
//
// Thread safety: every public method is thread-safe. Handlers of different registrations run
// concurrently; one registration's OnEvents calls never overlap (invariant 1).
//
// Invariants:
//   1. Per registration at most one thread runs OnEvents at a time; events that arrive for a
//      running registration are merged into the events of its next OnEvents call (never
//      lost), and AddInterest during a run is applied when the run re-arms.
//   2. OnRemoved runs exactly once, after the last OnEvents returned and after the descriptor
//      left the epoll set, so the handler may close it without a thread still polling it;
//      the registration then drops its reference to the handler.
//   3. After Stop() returns no loop thread runs; registrations left are removed (OnRemoved)
//      by Stop itself.
//   4. The tick runs at most once per period and never concurrently with itself.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/deadline.h"

namespace bagpipe::server {

class EventLoop {
 public:
  // What OnEvents returns to stay registered without being re-armed (e.g. a listener that
  // backs off when the process runs out of descriptors; Rearm() arms it again later).
  static constexpr uint32_t kKeepDisarmed = 1u << 31;

  class Handler {
   public:
    virtual ~Handler() = default;
    // `events`: EPOLLIN / EPOLLOUT / EPOLLHUP / EPOLLERR bits. Returns the interest to re-arm
    // with (EPOLLIN and/or EPOLLOUT; never 0 to stay), kKeepDisarmed, or 0 to deregister.
    virtual uint32_t OnEvents(uint32_t events) = 0;
    // After deregistration (invariant 2); closes the descriptor.
    virtual void OnRemoved() = 0;
  };

  struct Registration {
    const uint64_t id;
    const int fd;
    std::shared_ptr<Handler> handler;
    std::mutex mu;           // guards the fields below
    std::condition_variable cv;  // `removed` became true
    bool running = false;    // a loop thread is in OnEvents
    bool removed = false;
    bool remove_requested = false;  // Remove() called while a handler ran
    uint32_t pending = 0;    // events that arrived during a run
    uint32_t extra = 0;      // interest asked for during a run
    uint32_t interest = 0;   // armed with (when not running)
    Registration(uint64_t i, int f, std::shared_ptr<Handler> h)
        : id(i), fd(f), handler(std::move(h)) {}
  };

  // Starts `threads` loop threads. `tick` (may be empty) runs every `tick_seconds`.
  // REQUIRES: threads >= 1, tick_seconds > 0. Throws IOError if epoll cannot be created.
  EventLoop(size_t threads, std::function<void()> tick, double tick_seconds);
  ~EventLoop();  // Stop()
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  // Registers fd (non-blocking) armed with `interest`. Throws IOError.
  std::shared_ptr<Registration> Add(int fd, std::shared_ptr<Handler> handler, uint32_t interest);
  // Adds `extra` to the interest of reg (arms it now if no thread runs its handler).
  void AddInterest(Registration& reg, uint32_t extra);
  // Arms a registration its handler left disarmed (kKeepDisarmed).
  void Rearm(Registration& reg, uint32_t interest);
  // Deregisters reg from outside its handler and returns once it is out of the epoll set
  // and no handler of it runs (a running one finishes first). REQUIRES: not called from a
  // loop thread.
  void Remove(const std::shared_ptr<Registration>& reg);

  // Registrations in the loop now (thread-safe), and the loop threads started.
  size_t registrations() const;
  size_t threads() const { return threads_.size(); }
  // Stops every loop thread and removes what is still registered. Idempotent.
  void Stop();

 private:
  void Run();
  void Dispatch(uint64_t id, uint32_t events);
  void Arm(Registration& reg, uint32_t interest);  // REQUIRES: reg.mu held
  void Finish(const std::shared_ptr<Registration>& reg);
  void MaybeTick();

  int epfd_ = -1;
  int wake_fd_ = -1;  // eventfd, level-triggered: wakes every thread on Stop
  const std::function<void()> tick_;
  const Clock::duration period_;
  std::atomic<int64_t> next_tick_;  // Clock ticks since epoch
  std::mutex tick_mu_;
  std::atomic<bool> stopping_{false};
  std::mutex stop_mu_;
  std::vector<std::thread> threads_;

  mutable std::mutex mu_;  // guards regs_ and next_id_
  std::unordered_map<uint64_t, std::shared_ptr<Registration>> regs_;
  uint64_t next_id_ = 1;
};

}  // namespace bagpipe::server
