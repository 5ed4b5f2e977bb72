// Python bindings of the raw loopback baselines (csrc/testing/loopback_probe.h):
// torchrec_bagpipe.testing._C_testing.{raw_loopback_seconds, raw_pingpong_seconds}, the
// "what the machine's loopback does" baselines of benchmarks/ps_transport.py.
//
// Thread safety: the GIL is released while a probe runs; each owns its sockets and threads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/registry.h"
#include "testing/loopback_probe.h"

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(loopback) {
  m.def("raw_loopback_seconds", &testing::RawLoopbackSeconds, py::arg("total_bytes"),
        py::arg("chunk_bytes"), py::call_guard<py::gil_scoped_release>());
  m.def("raw_pingpong_seconds", &testing::RawPingPongSeconds, py::arg("iterations"),
        py::arg("msg_bytes"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace bagpipe::bindings
