#include "transport/ucx_endpoint.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "common/errors.h"
#include "transport/ucx_endpoint_internal.h"

namespace bagpipe::transport::ucx {

// ---- construction --------------------------------------------------------------------------

Endpoint::Endpoint(Role role, std::shared_ptr<Context> context, std::string peer)
    : role_(role), context_(std::move(context)), peer_(std::move(peer)) {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw TransportError(std::string("eventfd: ") + std::strerror(errno));
}

Endpoint::~Endpoint() {
  Close(/*graceful=*/!failed());
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Endpoint::Start(Deadline deadline) {
  if (group_) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      attached_ = true;
    }
    group_->Attach(this);
  } else {
    thread_ = std::thread([this] { Loop(); });
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (!started_ && setup_error_.empty()) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && !started_ &&
        setup_error_.empty()) {
      lock.unlock();
      // A group may still set it up: Close waits until the group set it up and tore it
      // down, or dropped it.
      if (group_) Close(/*graceful=*/false);
      throw TimeoutError("creating a UCX worker for " + peer_ + " timed out");
    }
  }
  if (!setup_error_.empty()) {
    const std::string err = setup_error_;
    lock.unlock();
    if (thread_.joinable()) thread_.join();
    closed_ = true;
    throw TransportError(err);
  }
}

void Endpoint::SetHandlers(EndpointHandlers handlers) {
  std::lock_guard<std::mutex> lock(mu_);
  handlers_ = std::move(handlers);
  handlers_dirty_.store(true, std::memory_order_release);
}

const EndpointHandlers& Endpoint::Handlers() {
  if (handlers_dirty_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    handlers_copy_ = handlers_;
    handlers_dirty_.store(false, std::memory_order_relaxed);
  }
  return handlers_copy_;
}

void Endpoint::Enqueue(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw TransportError("UCX connection to " + peer_ + " is closed");
    commands_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::RunOnThread(const std::function<void()>& fn, Deadline deadline) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  auto state = std::make_shared<State>();
  // The command owns its copy of fn: after a timeout it may still run, after `fn` is gone.
  Enqueue([state, fn] {
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->error = err;
    state->done = true;
    state->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(state->mu);
  if (!state->cv.wait_until(lock, deadline, [&] { return state->done; })) {
    // The command may still run fn: the caller's endpoint must be closed (joined) before
    // fn's captures go away, which Connect/Accept guarantee by declaration order.
    throw TimeoutError("UCX set-up step for " + peer_ + " timed out");
  }
  if (state->error) std::rethrow_exception(state->error);
}

void Endpoint::AdoptControl(Socket control) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    control_ = std::move(control);
    if (failed_ || closed_) {
      // The endpoint failed or was closed before it owned its control connection (the
      // client may already be using the connection): the peer learns of it now.
      ::shutdown(control_.fd(), SHUT_RDWR);
      return;
    }
    // Published with the control connection: the progress thread touches control_ only
    // once it sees monitoring_ (acquire), or under mu_.
    monitoring_.store(true, std::memory_order_release);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::ShutdownControl() {
  std::lock_guard<std::mutex> lock(mu_);
  if (control_.valid()) ::shutdown(control_.fd(), SHUT_RDWR);
}

// ---- public operations ---------------------------------------------------------------------------

bool Endpoint::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

Failure Endpoint::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void Endpoint::WaitFailureHandled(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return !failed_ || failure_done_; });
}

EndpointStats Endpoint::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Endpoint::Fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return;
    failed_ = true;
    failure_.message = message;
    monitoring_.store(false, std::memory_order_release);  // under mu_: see AdoptControl
  }
  failed_flag_.store(true, std::memory_order_release);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
}

void Endpoint::PostPut(uint32_t slot, size_t len, uint64_t tag) {
  if (role_ != Role::kClient) throw std::logic_error("PostPut on a shard endpoint");
  if (slot >= num_slots_ || len == 0 || len > slot_bytes_) {
    throw ValueError("UCX put of " + std::to_string(len) + " bytes into slot " +
                     std::to_string(slot) + " does not fit the ring (" + std::to_string(num_slots_) +
                     " slots of " + std::to_string(slot_bytes_) + " bytes)");
  }
  if (failed_flag_.load(std::memory_order_acquire)) throw TransportError(failure().message);
  Enqueue([this, slot, len, tag] { DoPut(slot, len, tag); });
}

void Endpoint::FlushAndRing() {
  if (role_ != Role::kClient) throw std::logic_error("FlushAndRing on a shard endpoint");
  if (failed_flag_.load(std::memory_order_acquire)) throw TransportError(failure().message);
  if (frame_mode_ == FrameMode::kMessage) return;
  Enqueue([this] { DoFlush(); });
}

void Endpoint::SendMessage(const void* head, size_t head_len, const void* payload,
                           size_t payload_len, std::function<void(bool)> on_sent) {
  if (head_len > kMaxHeadBytes) throw ValueError("UCX message head larger than 4 KiB");
  const bool on_thread = OnProgressThread();
  if (on_thread && !CommandsPending()) {
    DoSend(wire::kAmFrame, head, head_len, payload, payload_len, nullptr, std::move(on_sent));
    return;
  }
  // Another thread, or the progress thread with commands queued before this call (a send
  // from another thread not yet made): the message goes behind them, so messages leave in
  // the order SendMessage was called, whichever threads called it.
  std::vector<uint8_t> head_copy(static_cast<const uint8_t*>(head),
                                 static_cast<const uint8_t*>(head) + head_len);
  auto cb = std::make_shared<std::function<void(bool)>>(std::move(on_sent));
  auto send = [this, head_copy = std::move(head_copy), payload, payload_len, cb]() mutable {
    DoSend(wire::kAmFrame, head_copy.data(), head_copy.size(), payload, payload_len, nullptr,
           std::move(*cb));
  };
  if (on_thread) {
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!closed_) {  // the thread runs every queued command before it stops (Step)
        commands_.push_back(std::move(send));
        queued = true;
      }
    }
    if (!queued) {
      send();  // closing: no later command will run, so send (or drop) it now
      return;
    }
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    return;
  }
  try {
    Enqueue(std::move(send));
  } catch (const TransportError&) {
    if (*cb) (*cb)(false);
  }
}

bool Endpoint::CommandsPending() {
  if (batch_left_ > 0) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return !commands_.empty();
}

void Endpoint::Close(bool graceful) {
  if ((thread_.joinable() || group_) && OnProgressThread()) {
    throw std::logic_error("Endpoint::Close called from its own progress thread");
  }
  bool in_group;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_group = attached_ && !torn_down_ && !dropped_ && setup_error_.empty();
    if (closed_ && !thread_.joinable() && !in_group) {
      control_.Close();
      return;
    }
    closed_ = true;
    stop_requested_ = true;
    graceful_stop_ = graceful && !failed_;
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  if (in_group) {
    // The group tears it down on its thread (invariant 5); unbounded like a join.
    cv_.wait(lock, [&] { return torn_down_ || dropped_ || !setup_error_.empty(); });
  }
  control_.Close();
}

}  // namespace bagpipe::transport::ucx
