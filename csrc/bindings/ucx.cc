// Python bindings of the rdma (UCX) transport: torchrec_bagpipe._C.{HAVE_UCX, UCX_VERSION,
// RDMA_UNAVAILABLE, UcxShardServerCore, serve_ucx, fuzz_ucx_server}. Built in every configuration; without
// UCX only the flags exist (torchrec_bagpipe.ps.rdma turns them into a clear error).
// Clients reach UCX shards through PSClientCore endpoints ("ucx", host, port) (ps.cc).
//
// Thread safety: the GIL is released around every call that may wait; the server runs on
// native threads that never touch Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/convert.h"
#include "bindings/registry.h"
#include "commit/ps_shard.h"
#include "transport/rdma.h"

#ifdef BAGPIPE_HAVE_UCX
#include "transport/ucx_fuzzer.h"
#include "transport/ucx_server.h"
#endif

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(ucx) {
  m.attr("HAVE_UCX") = transport::RdmaAvailable();
  m.attr("UCX_VERSION") = transport::RdmaLibraryVersion();
  m.attr("RDMA_UNAVAILABLE") = transport::RdmaUnavailableReason();
#ifdef BAGPIPE_HAVE_UCX
  using transport::UcxServerOptions;
  using transport::UcxShardServer;
  py::class_<UcxShardServer>(m, "UcxShardServerCore")
      .def_property_readonly("host", &UcxShardServer::host)
      .def_property_readonly("port", &UcxShardServer::port)
      .def_property_readonly("stopped", &UcxShardServer::stopped)
      .def("stop", &UcxShardServer::Stop, py::arg("drain_timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](UcxShardServer& s) { return ServerStatsDict(s.stats()); });
  m.def(
      "serve_ucx",
      [](std::shared_ptr<commit::PSShard> shard, const std::string& host, uint16_t port,
         const std::string& job_token, const std::string& tls, const std::string& devices,
         double handshake_timeout, size_t max_connections) {
        UcxServerOptions o;
        o.host = host;
        o.port = port;
        o.job_token = job_token;
        o.config.tls = tls;
        o.config.net_devices = devices;
        o.handshake_timeout = handshake_timeout;
        o.max_connections = max_connections;
        py::gil_scoped_release release;
        return std::make_unique<UcxShardServer>(std::move(shard), o);
      },
      py::arg("shard"), py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("tls"),
      py::arg("devices"), py::arg("handshake_timeout"), py::arg("max_connections"));
  m.def(
      "fuzz_ucx_server",
      [](const std::string& host, uint16_t port, const std::string& token, uint64_t bootstraps,
         uint64_t frames, uint64_t seed) {
        transport::UcxFuzzStats st;
        {
          py::gil_scoped_release release;
          st = transport::FuzzUcxServer(host, port, token, bootstraps, frames, seed);
        }
        py::dict d;
        d["bootstraps"] = st.bootstraps;
        d["bootstraps_refused"] = st.bootstraps_refused;
        d["frames"] = st.frames;
        d["connections"] = st.connections;
        d["error_replies"] = st.error_replies;
        d["closed_by_server"] = st.closed_by_server;
        d["accepted"] = st.accepted;
        d["timeouts"] = st.timeouts;
        d["first_accepted"] = st.first_accepted;
        return d;
      },
      py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("bootstraps"),
      py::arg("frames"), py::arg("seed"));
#endif
}

}  // namespace bagpipe::bindings
