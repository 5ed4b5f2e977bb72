#include "server/event_loop.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"

namespace bagpipe::server {

namespace {
constexpr int kMaxEvents = 8;  // per epoll_wait: a busy thread leaves the rest to the others
constexpr uint64_t kWakeId = 0;
}  // namespace

EventLoop::EventLoop(size_t threads, std::function<void()> tick, double tick_seconds)
    : tick_(std::move(tick)),
      period_(std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(tick_seconds > 0 ? tick_seconds : 0.1))),
      next_tick_((Clock::now() + period_).time_since_epoch().count()) {
  if (threads == 0) throw ValueError("an event loop needs at least one thread");
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw IOError(std::string("epoll_create1: ") + std::strerror(errno));
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(epfd_);
    throw IOError(std::string("eventfd: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: once written, every thread sees it
  ev.data.u64 = kWakeId;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

EventLoop::~EventLoop() {
  Stop();
  ::close(wake_fd_);
  ::close(epfd_);
}

std::shared_ptr<EventLoop::Registration> EventLoop::Add(int fd, std::shared_ptr<Handler> handler,
                                                        uint32_t interest) {
  std::shared_ptr<Registration> reg;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reg = std::make_shared<Registration>(next_id_++, fd, std::move(handler));
    regs_.emplace(reg->id, reg);
  }
  std::lock_guard<std::mutex> lock(reg->mu);
  reg->interest = interest;
  epoll_event ev{};
  ev.events = interest | EPOLLONESHOT;
  ev.data.u64 = reg->id;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    const int err = errno;
    reg->removed = true;
    std::lock_guard<std::mutex> l2(mu_);
    regs_.erase(reg->id);
    throw IOError(std::string("epoll_ctl(ADD): ") + std::strerror(err));
  }
  return reg;
}

void EventLoop::Arm(Registration& reg, uint32_t interest) {
  reg.interest = interest;
  epoll_event ev{};
  ev.events = interest | EPOLLONESHOT;
  ev.data.u64 = reg.id;
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, reg.fd, &ev);
}

void EventLoop::AddInterest(Registration& reg, uint32_t extra) {
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.removed || reg.remove_requested) return;
  if (reg.running) {
    reg.extra |= extra;
    return;
  }
  Arm(reg, reg.interest | extra);
}

void EventLoop::Rearm(Registration& reg, uint32_t interest) {
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.removed || reg.remove_requested || reg.running) return;
  Arm(reg, interest);
}

void EventLoop::Remove(const std::shared_ptr<Registration>& reg) {
  {
    std::unique_lock<std::mutex> lock(reg->mu);
    if (reg->removed) return;
    if (reg->running) {
      reg->remove_requested = true;  // the running handler's Dispatch finishes it
      reg->cv.wait(lock, [&] { return reg->removed; });
      return;
    }
    reg->removed = true;
    reg->cv.notify_all();
    ::epoll_ctl(epfd_, EPOLL_CTL_DEL, reg->fd, nullptr);
  }
  Finish(reg);
}

void EventLoop::Finish(const std::shared_ptr<Registration>& reg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    regs_.erase(reg->id);
  }
  // The registration lets go of its handler (removed: nothing calls it any more), so a
  // handler that keeps its registration forms no reference cycle.
  std::shared_ptr<Handler> handler;
  {
    std::lock_guard<std::mutex> lock(reg->mu);
    handler = std::move(reg->handler);
  }
  if (handler) handler->OnRemoved();
}

size_t EventLoop::registrations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regs_.size();
}

void EventLoop::Dispatch(uint64_t id, uint32_t events) {
  std::shared_ptr<Registration> reg;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regs_.find(id);
    if (it == regs_.end()) return;
    reg = it->second;
  }
  {
    std::lock_guard<std::mutex> lock(reg->mu);
    if (reg->removed) return;
    if (reg->running) {
      reg->pending |= events;  // invariant 1: the running thread takes them
      return;
    }
    reg->running = true;
  }
  for (;;) {
    uint32_t interest = 0;
    bool remove = false;
    {
      std::lock_guard<std::mutex> lock(reg->mu);
      remove = reg->remove_requested;
    }
    if (!remove) interest = reg->handler->OnEvents(events);
    std::unique_lock<std::mutex> lock(reg->mu);
    if (remove || interest == 0 || reg->remove_requested) {
      reg->removed = true;
      reg->running = false;
      reg->cv.notify_all();
      ::epoll_ctl(epfd_, EPOLL_CTL_DEL, reg->fd, nullptr);
      lock.unlock();
      Finish(reg);
      return;
    }
    if (reg->pending != 0) {
      events = reg->pending;
      reg->pending = 0;
      reg->extra = 0;  // the next run computes its own interest
      continue;
    }
    reg->running = false;
    if (interest == kKeepDisarmed) {
      if (reg->extra != 0) Arm(*reg, reg->extra);
      reg->extra = 0;
      return;
    }
    Arm(*reg, interest | reg->extra);
    reg->extra = 0;
    return;
  }
}

void EventLoop::MaybeTick() {
  if (!tick_) return;
  const int64_t now = Clock::now().time_since_epoch().count();
  int64_t due = next_tick_.load();
  if (now < due) return;
  if (!next_tick_.compare_exchange_strong(due, now + period_.count())) return;
  std::unique_lock<std::mutex> lock(tick_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // invariant 4
  tick_();
}

void EventLoop::Run() {
  epoll_event events[kMaxEvents];
  const int wait_ms = static_cast<int>(
      std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::milliseconds>(period_).count()));
  while (!stopping_.load()) {
    const int n = ::epoll_wait(epfd_, events, kMaxEvents, wait_ms);
    if (stopping_.load()) break;
    for (int i = 0; i < n; ++i) {
      if (events[i].data.u64 == kWakeId) continue;
      Dispatch(events[i].data.u64, events[i].events);
      if (stopping_.load()) break;
    }
    MaybeTick();
  }
}

void EventLoop::Stop() {
  std::lock_guard<std::mutex> stop_lock(stop_mu_);
  if (!stopping_.exchange(true)) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::vector<std::shared_ptr<Registration>> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, reg] : regs_) left.push_back(reg);
  }
  for (auto& reg : left) {
    {
      std::lock_guard<std::mutex> lock(reg->mu);
      if (reg->removed) continue;
      reg->removed = true;
      reg->running = false;
      reg->cv.notify_all();
      ::epoll_ctl(epfd_, EPOLL_CTL_DEL, reg->fd, nullptr);
    }
    Finish(reg);
  }
}

}  // namespace bagpipe::server
