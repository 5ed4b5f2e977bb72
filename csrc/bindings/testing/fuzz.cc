// Python bindings of the frame fuzzers (csrc/testing/{tcp,ucx}_fuzzer.h):
// torchrec_bagpipe.testing._C_testing.{fuzz_server, fuzz_ucx_server} (fuzz_ucx_server only in
// a build with UCX), each returning the fuzzer's counters as a dict (tests/test_ps_server.py).
//
// Thread safety: the GIL is released while a fuzzer runs; it uses only its own connections.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/registry.h"
#include "testing/frame_fuzzer.h"
#include "testing/tcp_fuzzer.h"

#ifdef BAGPIPE_HAVE_UCX
#include "testing/ucx_fuzzer.h"
#endif

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {

// REQUIRES: GIL held.
py::dict FuzzStatsDict(const testing::FuzzStats& st) {
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
}

}  // namespace

BAGPIPE_BINDING(fuzz) {
  m.def(
      "fuzz_server",
      [](const std::string& host, uint16_t port, const std::string& token, uint64_t frames,
         uint64_t seed) {
        testing::FuzzStats st;
        {
          py::gil_scoped_release release;
          st = testing::FuzzTcpServer(host, port, token, frames, seed);
        }
        return FuzzStatsDict(st);
      },
      py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("frames"), py::arg("seed"));
#ifdef BAGPIPE_HAVE_UCX
  m.def(
      "fuzz_ucx_server",
      [](const std::string& host, uint16_t port, const std::string& token, uint64_t bootstraps,
         uint64_t frames, uint64_t seed) {
        testing::FuzzStats st;
        {
          py::gil_scoped_release release;
          st = testing::FuzzUcxServer(host, port, token, bootstraps, frames, seed);
        }
        return FuzzStatsDict(st);
      },
      py::arg("host"), py::arg("port"), py::arg("job_token"), py::arg("bootstraps"),
      py::arg("frames"), py::arg("seed"));
#endif
}

}  // namespace bagpipe::bindings
