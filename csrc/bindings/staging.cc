// Python bindings of gradient staging from device memory: torchrec_bagpipe._C.{
// cuda_runtime_status, DeviceStagerCore, commit_async_device}. Built in every configuration;
// the CUDA runtime is loaded at run time (common/cuda_api.h), so on a machine without CUDA
// DeviceStagerCore raises a RuntimeError naming libcudart.
//
// Thread safety: the GIL is released around native calls. Device pointers and CUDA events
// cross as integers (tensor.data_ptr(), torch.cuda.Event.cuda_event); the Python client keeps
// the tensor and the event alive in the commit's handle until the commit is done.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "bindings/buffers.h"
#include "bindings/registry.h"
#include "commit/client.h"
#include "common/cuda_api.h"
#include "common/errors.h"
#include "transport/device_staging.h"

namespace py = pybind11;

namespace bagpipe::bindings {

BAGPIPE_BINDING(staging) {
  m.def("cuda_runtime_status", [] {
    std::string why;
    auto api = CudaRuntimeApi(&why);
    return py::make_tuple(api != nullptr, api ? api->name() : why);
  });

  py::class_<transport::DeviceStager>(m, "DeviceStagerCore")
      .def(py::init([](double timeout) {
             std::string why;
             auto api = CudaRuntimeApi(&why);
             if (!api) throw std::runtime_error(why);
             return std::make_unique<transport::DeviceStager>(api, timeout);
           }),
           py::arg("timeout"))
      .def("stats", [](transport::DeviceStager& s) {
        const auto st = s.stats();
        py::dict d;
        d["staged"] = st.staged;
        d["bytes"] = st.bytes;
        d["event_polls"] = st.event_polls;
        d["failed"] = st.failed;
        d["pinned_bytes"] = st.pinned_bytes;
        return d;
      });

  m.def(
      "commit_async_device",
      [](commit::PSClient& client, int64_t step, const py::array& keys,
         transport::DeviceStager& stager, uintptr_t src, size_t nbytes, int device,
         uintptr_t event) {
        auto k = Vec<int64_t>(keys, "keys");
        const size_t want = k.size * client.options().dim * sizeof(float);
        if (nbytes != want) {
          throw ValueError("grads must hold " + std::to_string(k.size) + " x " +
                           std::to_string(client.options().dim) + " float32 values (" +
                           std::to_string(want) + " bytes), got " + std::to_string(nbytes));
        }
        py::gil_scoped_release release;
        transport::DeviceSource s;
        s.src = reinterpret_cast<const void*>(src);
        s.bytes = nbytes;
        s.device = device;
        s.event = reinterpret_cast<void*>(event);
        auto rows = stager.Stage(s);
        // The worker waits for the copy before it reads the grads; the hook keeps the staged
        // buffer alive as long as the commit op.
        const auto deadline = DeadlineAfter(client.options().timeout);
        return client.CommitAsync(step, k.data, k.size, rows->data(),
                                  [rows, deadline] { rows->Wait(deadline); });
      },
      py::arg("client"), py::arg("step"), py::arg("keys"), py::arg("stager"), py::arg("src"),
      py::arg("nbytes"), py::arg("device"), py::arg("event"));
}

}  // namespace bagpipe::bindings
