// Python bindings of the rdma (UCX) transport: torchrec_bagpipe._C.{HAVE_UCX, UCX_VERSION,
// RDMA_UNAVAILABLE, UcxServerOptions, UcxShardServerCore, serve_ucx}. Built in every
// configuration; without UCX only the flags exist (torchrec_bagpipe.ps.rdma turns them into a
// clear error). Clients reach UCX shards through PSClientCore endpoints
// ("ucx", host, port) (client.cc).
//
// Thread safety: the GIL is released around every call that may wait; the server runs on
// native threads that never touch Python objects.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings/convert.h"
#include "bindings/registry.h"
#include "shard/ps_shard.h"
#include "transport/rdma.h"

#ifdef BAGPIPE_HAVE_UCX
#include "server/ucx_server.h"
#endif

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(ucx) {
  m.attr("HAVE_UCX") = transport::RdmaAvailable();
  m.attr("UCX_VERSION") = transport::RdmaLibraryVersion();
  m.attr("RDMA_UNAVAILABLE") = transport::RdmaUnavailableReason();
#ifdef BAGPIPE_HAVE_UCX
  using server::UcxServerOptions;
  using server::UcxShardServer;
  py::class_<UcxServerOptions>(m, "UcxServerOptions",
                               "A UCX shard server's options (csrc/server/ucx_server.h).")
      .def(py::init<>())
      .def_readwrite("host", &UcxServerOptions::host)
      .def_readwrite("port", &UcxServerOptions::port)
      .def_readwrite("job_token", &UcxServerOptions::job_token)
      .def_readwrite("allow_no_token", &UcxServerOptions::allow_no_token)
      .def_readwrite("max_unauthenticated", &UcxServerOptions::max_unauthenticated)
      .def_readwrite("max_unauthenticated_per_host",
                     &UcxServerOptions::max_unauthenticated_per_host)
      .def_readwrite("io_threads", &UcxServerOptions::io_threads)
      .def_readwrite("progress_threads", &UcxServerOptions::progress_threads)
      .def_property(
          "ucx_tls", [](const UcxServerOptions& o) { return o.config.tls; },
          [](UcxServerOptions& o, const std::string& v) { o.config.tls = v; },
          "UCX transports ('' : $UCX_TLS)")
      .def_property(
          "ucx_devices", [](const UcxServerOptions& o) { return o.config.net_devices; },
          [](UcxServerOptions& o, const std::string& v) { o.config.net_devices = v; },
          "UCX devices ('' : $UCX_NET_DEVICES)")
      .def_readwrite("handshake_timeout", &UcxServerOptions::handshake_timeout)
      .def_readwrite("max_connections", &UcxServerOptions::max_connections);
  py::class_<UcxShardServer>(m, "UcxShardServerCore")
      .def_property_readonly("host", &UcxShardServer::host)
      .def_property_readonly("port", &UcxShardServer::port)
      .def_property_readonly("stopped", &UcxShardServer::stopped)
      .def("stop", &UcxShardServer::Stop, py::arg("drain_timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("stats", [](UcxShardServer& s) { return ServerStatsDict(s.stats()); });
  m.def(
      "serve_ucx",
      [](std::shared_ptr<shard::PSShard> shard, const UcxServerOptions& options) {
        py::gil_scoped_release release;
        return std::make_unique<UcxShardServer>(std::move(shard), options);
      },
      py::arg("shard"), py::arg("options"));
#endif
}

}  // namespace bagpipe::bindings
