// The torchrec_bagpipe.testing._C_testing extension: the native test and benchmark tools of
// csrc/testing/ (protocol links driven by hand, frame fuzzers, raw loopback baselines), built
// for development checkouts only and never installed with the package. It raises the product
// module's error classes (errors.h), so it imports torchrec_bagpipe._C first; PSShardCore
// arguments are the product module's objects.
#include <pybind11/pybind11.h>

#include "bindings/errors.h"
#include "bindings/registry.h"

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {
ErrorClasses& Classes() {
  static ErrorClasses classes;
  return classes;
}
}  // namespace
}  // namespace bagpipe::bindings

PYBIND11_MODULE(_C_testing, m) {
  using namespace bagpipe::bindings;
  m.doc() = "torchrec_bagpipe native test tools (not part of the installed package)";
  py::module_ core = py::module_::import("torchrec_bagpipe._C");
  auto cls = [&](const char* name) { return py::object(core.attr(name)).release().ptr(); };
  Classes() = {cls("SessionError"), cls("TransportError"), cls("ShuttingDownError"),
               cls("StartStepError")};
  py::register_local_exception_translator([](std::exception_ptr p) {
    if (p) TranslateError(p, Classes());
  });
  RunBindings(m);
}
