#include "transport/ucx_progress.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/errors.h"
#include "transport/ucx_endpoint.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {

namespace {
constexpr int kIdleWaitMillis = 100;  // as Endpoint's own loop
constexpr int kMaxEvents = 64;
constexpr unsigned kProgressBurst = 64;
}  // namespace

ucp_worker_h ProgressGroup::SharedWorker(const std::shared_ptr<Context>& context, int* efd) {
  if (worker_ != nullptr) {
    if (context_ != context) return nullptr;
    *efd = worker_efd_;
    return worker_;
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h w = nullptr;
  ucs_status_t st = ucp_worker_create(context->handle(), &wp, &w);
  if (st != UCS_OK) ThrowStatus("ucp_worker_create (" + context->config().Describe() + ")", st);
  for (unsigned id : {wire::kAmDoorbell, wire::kAmFrame}) {
    ucp_am_handler_param_t ap{};
    ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    ap.id = id;
    ap.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    ap.cb = id == wire::kAmDoorbell ? &ProgressGroup::OnDoorbellAm : &ProgressGroup::OnFrameAm;
    ap.arg = this;
    st = ucp_worker_set_am_recv_handler(w, &ap);
    if (st != UCS_OK) {
      ucp_worker_destroy(w);
      ThrowStatus("ucp_worker_set_am_recv_handler", st);
    }
  }
  int fd = -1;
  if (ucp_worker_get_efd(w, &fd) != UCS_OK) fd = -1;
  worker_ = w;
  worker_efd_ = fd;
  context_ = context;
  workers_.fetch_add(1);
  if (fd >= 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev);
  }
  *efd = fd;
  return w;
}

void ProgressGroup::DestroyWorker() {
  if (worker_ == nullptr) return;
  if (worker_efd_ >= 0) ::epoll_ctl(epfd_, EPOLL_CTL_DEL, worker_efd_, nullptr);
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  worker_efd_ = -1;
  // No callback can run any more: free the requests UCX never completed (invariant 4).
  for (void* op : orphans_) delete static_cast<Endpoint::Op*>(op);
  orphans_.clear();
  context_.reset();
  workers_.fetch_sub(1);
}

void ProgressGroup::Register(uint64_t ring_id, Endpoint* ep) {
  std::lock_guard<std::mutex> lock(ring_mu_);
  rings_[ring_id] = ep;
}

void ProgressGroup::Unregister(uint64_t ring_id) {
  std::lock_guard<std::mutex> lock(ring_mu_);
  rings_.erase(ring_id);
}

void ProgressGroup::Woke(Endpoint* ep) { woken_.insert(ep); }

void ProgressGroup::Orphan(void* op) { orphans_.insert(op); }

void ProgressGroup::Unorphan(void* op) {
  orphans_.erase(op);
  delete static_cast<Endpoint::Op*>(op);
}

ucs_status_t ProgressGroup::OnAm(void* arg, const void* header, size_t header_len, void* data,
                                 size_t length, const ucp_am_recv_param_t* param,
                                 unsigned am_id) {
  auto* self = static_cast<ProgressGroup*>(arg);
  Endpoint* ep = nullptr;
  if (header_len >= sizeof(wire::MessagePrefix)) {
    wire::MessagePrefix prefix;
    std::memcpy(&prefix, header, sizeof(prefix));
    std::lock_guard<std::mutex> lock(self->ring_mu_);
    auto it = self->rings_.find(prefix.ring_id);
    if (it != self->rings_.end()) ep = it->second;
  }
  if (ep == nullptr) {
    // Names no live connection (too short to name one, or its connection is gone): there is
    // nobody to fail; UCX frees the data (UCS_OK).
    self->stray_.fetch_add(1);
    return UCS_OK;
  }
  self->Woke(ep);
  return ep->ReceiveAm(am_id, header, header_len, data, length, param);
}

ucs_status_t ProgressGroup::OnDoorbellAm(void* arg, const void* header, size_t header_len,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  return OnAm(arg, header, header_len, data, length, param, wire::kAmDoorbell);
}

ucs_status_t ProgressGroup::OnFrameAm(void* arg, const void* header, size_t header_len,
                                      void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  return OnAm(arg, header, header_len, data, length, param, wire::kAmFrame);
}

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
  if (ep->efd_ >= 0 && !ep->shared_worker_) Del(ep->efd_);
  eps_.erase(ep);
  woken_.erase(ep);
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
      if (ep->shared_worker_ && ep->efd_ >= 0) {
        // the shared worker's event fd is in the epoll set already
      } else if (ep->efd_ >= 0) {
        Add(ep->efd_, ep, kEvents);
      } else {
        any_without_events_ = true;
      }
      hot.push_back(ep);
    }
    if (stop_.load() && eps_.empty() && hot.empty()) break;
    if (!woken_.empty()) {
      for (Endpoint* ep : woken_) hot.push_back(ep);
      woken_.clear();
    }
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
      if (fd == worker_efd_ && worker_ != nullptr) {
        // The shared worker has events: its callbacks name the endpoints they are for.
        for (unsigned k = 0; k < kProgressBurst && ucp_worker_progress(worker_) != 0; ++k) {
        }
        for (Endpoint* ep : woken_) ready.emplace(ep, false);
        woken_.clear();
        if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
          for (Endpoint* ep : eps_) {
            if (ep->shared_worker_) ready.emplace(ep, false);
          }
        }
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
        if (ep->efd_ < 0) ready.emplace(ep, false);  // incl. a shared worker without an fd
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
    // Events another endpoint's progress consumed are picked up next round (without waiting).
    if (any_without_events_) {
      any_without_events_ = false;
      for (Endpoint* ep : eps_) {
        any_without_events_ = any_without_events_ || ep->efd_ < 0;
      }
    }
  }
  DestroyWorker();  // invariant 3: every endpoint is torn down
}

size_t ProgressPool::workers() const {
  size_t n = 0;
  for (const auto& g : groups_) n += g->workers();
  return n;
}

uint64_t ProgressPool::stray() const {
  uint64_t n = 0;
  for (const auto& g : groups_) n += g->stray();
  return n;
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
