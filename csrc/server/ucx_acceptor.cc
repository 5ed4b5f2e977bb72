#include "server/ucx_acceptor.h"

#include <utility>

namespace bagpipe::server {

using transport::Socket;
using transport::ucx::Context;
using transport::ucx::Endpoint;

UcxAcceptor::UcxAcceptor(UcxAcceptorOptions options, Authorize authorize, OnConnection on_connection)
    : options_(std::move(options)),
      authorize_(std::move(authorize)),
      on_connection_(std::move(on_connection)),
      context_(Context::Get(options_.config)),
      listener_(options_.host, options_.port) {
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

UcxAcceptor::~UcxAcceptor() { Stop(); }

std::string UcxAcceptor::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

void UcxAcceptor::Stop() {
  if (stopping_.exchange(true)) {
    if (accept_thread_.joinable() && accept_thread_.get_id() != std::this_thread::get_id()) {
      accept_thread_.join();
    }
    return;
  }
  listener_.Close();
  if (accept_thread_.joinable()) accept_thread_.join();
  Reap(/*all=*/true);
}

void UcxAcceptor::Reap(bool all) {
  std::list<std::unique_ptr<Handshake>> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = handshakes_.begin(); it != handshakes_.end();) {
      if (all || (*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = handshakes_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& h : finished) {
    if (h->thread.joinable()) h->thread.join();
  }
}

void UcxAcceptor::AcceptLoop() {
  while (!stopping_.load()) {
    std::string peer;
    Socket s = listener_.Accept(100, &peer, /*nonblocking=*/true);
    Reap(/*all=*/false);
    if (!s.valid()) continue;
    auto hs = std::make_unique<Handshake>();
    Handshake* raw = hs.get();
    auto sock = std::make_shared<Socket>(std::move(s));
    raw->thread = std::thread([this, raw, sock, peer] {
      try {
        auto ep = Endpoint::Accept(context_, std::move(*sock), peer, options_.limits, authorize_,
                                   on_connection_, DeadlineAfter(options_.handshake_timeout));
        if (ep) {
          accepted_.fetch_add(1);
        } else {
          refused_.fetch_add(1);
          std::lock_guard<std::mutex> lock(mu_);
          last_error_ = "refused " + peer;
        }
      } catch (const std::exception& e) {
        refused_.fetch_add(1);
        std::lock_guard<std::mutex> lock(mu_);
        last_error_ = peer + ": " + e.what();
      }
      raw->done.store(true);
    });
    std::lock_guard<std::mutex> lock(mu_);
    handshakes_.push_back(std::move(hs));
  }
}

}  // namespace bagpipe::server
