// The torchrec_bagpipe._C extension: the core's error classes and every registered binding.
#include <pybind11/pybind11.h>

#include "bindings/errors.h"
#include "bindings/registry.h"
#include "common/errors.h"

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {
ErrorClasses& Classes() {
  static ErrorClasses classes;
  return classes;
}
}  // namespace
}  // namespace bagpipe::bindings

PYBIND11_MODULE(_C, m) {
  using namespace bagpipe;
  using namespace bagpipe::bindings;
  m.doc() = "torchrec_bagpipe native core (no libtorch dependency)";
  py::exception<SessionError> session(m, "SessionError", PyExc_RuntimeError);
  py::exception<TransportError> transport(m, "TransportError", PyExc_ConnectionError);
  py::exception<ShuttingDownError> shutting_down(m, "ShuttingDownError", transport);
  py::exception<StartStepError> start_step(m, "StartStepError", PyExc_ValueError);
  Classes() = {session.release().ptr(), transport.release().ptr(), shutting_down.release().ptr(),
               start_step.release().ptr()};
  py::register_exception_translator([](std::exception_ptr p) {
    if (p) TranslateError(p, Classes());
  });
  RunBindings(m);
}
