#include "transport/ucx_progress.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "transport/ucx_endpoint.h"

namespace bagpipe::transport::ucx {

namespace {
constexpr int kIdleWaitMillis = 100;  // as Endpoint's own loop
constexpr int kMaxEvents = 64;
}  // namespace

ProgressGroup::ProgressGroup() {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw TransportError(std::string("epoll_create1: ") + std::strerror(errno));
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(epfd_);
    throw TransportError(std::string("eventfd: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  thread_ = std::thread([this] { Run(); });
}

ProgressGroup::~ProgressGroup() {
  stop_.store(true);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the last reference died on the group's own thread
    } else {
      thread_.join();
    }
  }
  ::close(wake_fd_);
  ::close(epfd_);
}

void ProgressGroup::Attach(Endpoint* ep) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(ep);
  }
  count_.fetch_add(1);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void ProgressGroup::Add(int fd, Endpoint* ep, Kind kind) {
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: a ready descriptor is stepped until drained
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) == 0) watches_[fd] = Watch{ep, kind};
}

void ProgressGroup::Del(int fd) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  watches_.erase(fd);
}

void ProgressGroup::SyncControl(Endpoint* ep) {
  const int want = ep->WatchedControlFd();
  auto it = control_.find(ep);
  const int have = it == control_.end() ? -1 : it->second;
  if (want == have) return;
  if (have >= 0) Del(have);
  if (want >= 0) {
    Add(want, ep, kControl);
    control_[ep] = want;
  } else {
    control_.erase(ep);
  }
}

void ProgressGroup::Release(Endpoint* ep) {
  auto it = control_.find(ep);
  if (it != control_.end()) {
    Del(it->second);
    control_.erase(it);
  }
  Del(ep->wake_fd_);
  if (ep->efd_ >= 0) Del(ep->efd_);
  eps_.erase(ep);
  count_.fetch_sub(1);
}

void ProgressGroup::Run() {
  std::vector<Endpoint*> hot;  // stepped again without waiting
  epoll_event events[kMaxEvents];
  std::unordered_map<Endpoint*, bool> ready;  // endpoint -> its control connection is ready
  for (;;) {
    std::vector<Endpoint*> adds;
    {
      std::lock_guard<std::mutex> lock(mu_);
      adds.swap(pending_);
    }
    for (Endpoint* ep : adds) {
      if (!ep->SetUpOnGroup()) {  // closed before it was set up, or the set-up failed
        count_.fetch_sub(1);
        continue;
      }
      eps_.insert(ep);
      Add(ep->wake_fd_, ep, kWake);
      if (ep->efd_ >= 0) {
        Add(ep->efd_, ep, kEvents);
      } else {
        any_without_events_ = true;
      }
      hot.push_back(ep);
    }
    if (stop_.load() && eps_.empty() && hot.empty()) break;
    const int wait = !hot.empty() ? 0 : any_without_events_ ? 1 : kIdleWaitMillis;
    const int n = ::epoll_wait(epfd_, events, kMaxEvents, wait);
    ready.clear();
    for (Endpoint* ep : hot) ready.emplace(ep, false);
    hot.clear();
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof(v));
        continue;
      }
      auto w = watches_.find(fd);
      if (w == watches_.end()) continue;
      if (w->second.kind == kWake) w->second.ep->DrainWake();
      bool& control_ready = ready[w->second.ep];
      control_ready = control_ready || w->second.kind == kControl;
    }
    if (any_without_events_) {
      for (Endpoint* ep : eps_) {
        if (ep->efd_ < 0) ready.emplace(ep, false);
      }
    }
    for (auto [ep, control_ready] : ready) {
      const Endpoint::StepResult r = ep->Step(control_ready);
      if (r == Endpoint::StepResult::kStop) {
        Release(ep);          // invariant 2: out of the epoll set before the teardown
        ep->FinishOnGroup();  // the endpoint's Close may return (and free it) from here on
        continue;
      }
      SyncControl(ep);
      if (r == Endpoint::StepResult::kBusy || !ep->ArmForWait()) hot.push_back(ep);
    }
    if (any_without_events_) {
      any_without_events_ = false;
      for (Endpoint* ep : eps_) any_without_events_ = any_without_events_ || ep->efd_ < 0;
    }
  }
}

ProgressPool::ProgressPool(size_t threads) {
  if (threads == 0) throw ValueError("a UCX progress pool needs at least one thread");
  for (size_t i = 0; i < threads; ++i) groups_.push_back(std::make_shared<ProgressGroup>());
}

std::shared_ptr<ProgressGroup> ProgressPool::Pick() {
  auto best = groups_.front();
  for (const auto& g : groups_) {
    if (g->endpoints() < best->endpoints()) best = g;
  }
  return best;
}

}  // namespace bagpipe::transport::ucx
