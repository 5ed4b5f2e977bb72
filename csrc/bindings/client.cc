// Python binding of the trainer-side PS client: torchrec_bagpipe._C.{PSClientCore,
// ClientOpCore}, wrapped by torchrec_bagpipe.ps.client.PSClient (which owns argument
// conversion from tensors); settings arrive as the option structs of options.cc. Types and
// calls only: what a call does lives in csrc/client/.
//
// Thread safety: the GIL is released around every native call that may wait; enqueueing an
// operation keeps it (microseconds of work). Native threads (the client's worker, receive
// threads) never touch Python objects. Buffers passed to the *_async methods are borrowed: the
// Python wrapper keeps the tensors alive until the operation is done.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/buffers.h"
#include "bindings/registry.h"
#include "client/ps_client.h"
#include "common/errors.h"
#include "shard/ps_shard.h"
#include "transport/connect.h"

namespace bagpipe::bindings {
namespace {

using client::ClientOp;
using client::PSClient;
using shard::PSShard;
using transport::ShardEndpoint;
using OpClass = py::class_<ClientOp, std::shared_ptr<ClientOp>>;
using ClientClass = py::class_<PSClient>;

// A PSClientCore endpoint: a PSShardCore (local), (host, port) (tcp) or ("ucx", host, port).
ShardEndpoint EndpointOf(py::handle e, size_t index) {
  if (py::isinstance<PSShard>(e)) return ShardEndpoint::Local(e.cast<std::shared_ptr<PSShard>>());
  if (py::isinstance<py::tuple>(e) && py::len(e) == 3) {
    auto t = e.cast<py::tuple>();
    if (t[0].cast<std::string>() != "ucx") {
      throw ValueError("endpoint " + std::to_string(index) + ": unknown scheme");
    }
    return ShardEndpoint::Rdma(t[1].cast<std::string>(), t[2].cast<uint16_t>());
  }
  if (py::isinstance<py::tuple>(e)) {
    auto t = e.cast<py::tuple>();
    return ShardEndpoint::Tcp(t[0].cast<std::string>(), t[1].cast<uint16_t>());
  }
  throw TypeError("endpoint " + std::to_string(index) +
                  " must be a PSShardCore, a (host, port) or a ('ucx', host, port) tuple");
}

py::dict ClientStatsDict(const client::ClientStats& s) {
  py::dict d;
  d["commits"] = s.commits;
  d["gets"] = s.gets;
  d["packets"] = s.packets;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["ack_waits"] = s.slot_waits;
  d["rows_committed"] = s.rows_committed;
  d["rows_read"] = s.rows_read;
  return d;
}

// ClientOpCore: the handle of an asynchronous operation.
void BindClientOp(OpClass& cls) {
  cls.def("done", &ClientOp::Done);
  cls.def("wait", [](ClientOp& op, double timeout) {
    if (op.Done()) {  // finished: report without giving the GIL away
      op.Wait(DeadlineAfter(0.0));
      return;
    }
    py::gil_scoped_release release;
    op.Wait(DeadlineAfter(timeout));
  });
  cls.def_property_readonly("step", &ClientOp::step);
  cls.def_property_readonly("shard_steps", &ClientOp::shard_steps);
}

// Connecting, and the asynchronous operations (their inputs are borrowed until done).
void BindClientOperations(ClientClass& cls) {
  cls.def(py::init([](py::list endpoints, const client::ClientOptions& options,
                      const transport::ConnectOptions& connect) {
            // Collect the endpoints with the GIL, connect without it.
            std::vector<ShardEndpoint> eps;
            for (size_t j = 0; j < endpoints.size(); ++j)
              eps.push_back(EndpointOf(endpoints[j], j));
            py::gil_scoped_release release;
            return PSClient::Connect(options, eps, connect);
          }),
          py::arg("endpoints"), py::arg("options"), py::arg("connect"));
  cls.def_property_readonly("state_dim", &PSClient::state_dim);
  cls.def(
      "commit_async",
      [](PSClient& c, int64_t step, const py::array& keys, const py::array& grads, float lr,
         const py::object& evict) {
        auto k = Vec<int64_t>(keys, "keys");
        auto g = Mat<float>(grads, "grads", static_cast<py::ssize_t>(k.size), c.options().dim);
        // The GIL stays held: enqueueing is microseconds of work (the client's worker
        // thread stages the packets), and releasing the GIL would hand it to another
        // Python thread of the trainer for longer than that.
        if (evict.is_none()) return c.CommitAsync(step, k.data, k.size, g.data, nullptr, lr);
        auto e = Vec<int64_t>(py::cast<py::array>(evict), "evict");
        return c.CommitAsync(step, k.data, k.size, g.data, nullptr, lr, e.data, e.size);
      },
      py::arg("step"), py::arg("keys"), py::arg("grads"), py::arg("lr"),
      py::arg("evict") = py::none());
  cls.def(
      "get_async",
      [](PSClient& c, const py::array& keys, int64_t at_step, const py::array& out,
         bool with_state) {
        auto k = Vec<int64_t>(keys, "keys");
        const py::ssize_t width = c.options().dim + (with_state ? c.state_dim() : 0);
        auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), width);
        // Enqueue only: GIL held.
        return c.GetAsync(k.data, k.size, at_step, o.data, with_state);
      },
      py::arg("keys"), py::arg("at_step"), py::arg("out"), py::arg("with_state") = false);
  cls.def(
      "assign_async",
      [](PSClient& c, const py::array& keys, const py::array& rows, bool with_state) {
        auto k = Vec<int64_t>(keys, "keys");
        const py::ssize_t width = c.options().dim + (with_state ? c.state_dim() : 0);
        auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size), width);
        py::gil_scoped_release release;
        return c.AssignAsync(k.data, k.size, r.data, with_state);
      },
      py::arg("keys"), py::arg("rows"), py::arg("with_state") = false);
  cls.def("checkpoint_async", &PSClient::CheckpointAsync, py::arg("label") = std::string(),
          py::call_guard<py::gil_scoped_release>());
}

// What the client knows (steps, failures, checkpoints, counters), and Close.
void BindClientQueries(ClientClass& cls) {
  cls.def("committed_step", &PSClient::CommittedStep);  // a locked read: GIL held
  cls.def("shard_committed_steps", &PSClient::ShardCommittedSteps,
          py::call_guard<py::gil_scoped_release>());
  cls.def("shard_peers", &PSClient::shard_peers);
  cls.def("failure", [](PSClient& c) -> py::object {
    auto f = c.failure();
    if (!f) return py::none();
    return py::str(f->message);
  });
  cls.def("checkpoint_report", [](PSClient& c) {
    client::CheckpointReport r;
    {
      py::gil_scoped_release release;
      r = c.checkpoint_report();
    }
    py::dict d;
    d["succeeded"] = r.succeeded;
    d["failed"] = r.failed;
    d["consecutive_failures"] = r.consecutive_failures;
    d["last_step"] = r.last_step;
    d["last_error"] = r.last_error;
    return d;
  });
  cls.def("stats", [](PSClient& c) {
    client::ClientStats s;
    {
      py::gil_scoped_release release;
      s = c.stats();
    }
    return ClientStatsDict(s);
  });
  cls.def("channel_stats", [](PSClient& c) {
    std::vector<transport::ChannelStats> cs;
    {
      py::gil_scoped_release release;
      cs = c.channel_stats();
    }
    const auto peers = c.shard_peers();
    py::list out;
    for (size_t j = 0; j < cs.size(); ++j) {
      py::dict d;
      d["peer"] = j < peers.size() ? peers[j] : std::string();
      d["frames_sent"] = cs[j].frames_sent;
      d["bytes_sent"] = cs[j].bytes_sent;
      d["frames_received"] = cs[j].frames_received;
      d["bytes_received"] = cs[j].bytes_received;
      d["slot_waits"] = cs[j].slot_waits;
      d["flushes"] = cs[j].flushes;
      d["one_sided_writes"] = cs[j].one_sided_writes;
      d["doorbells"] = cs[j].doorbells;
      out.append(d);
    }
    return out;
  });
  cls.def("close", &PSClient::Close, py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace

// After options (ClientOptions, ConnectOptions; registry.h invariant 2).
BAGPIPE_BINDING(ps_client) {
  OpClass op(m, "ClientOpCore");
  BindClientOp(op);
  ClientClass client(m, "PSClientCore");
  BindClientOperations(client);
  BindClientQueries(client);
}

}  // namespace bagpipe::bindings
