// The core's error types (common/errors.h) as Python exceptions, shared by the product
// module (torchrec_bagpipe._C, which creates SessionError, TransportError,
// ShuttingDownError and StartStepError) and the test module (torchrec_bagpipe.testing._C_testing, which raises
// the same classes, looked up in _C), so a caller catches one class whichever module threw.
//
// Thread safety: called by pybind11's exception translation, with the GIL held.
// Invariants:
//   1. ShuttingDownError is matched before TransportError (it is one), StartStepError
//      before ValueError.
//   2. An exception of another type is rethrown untouched (pybind11's next translator,
//      then its built-in ones, handle it).
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <new>

#include "common/errors.h"

namespace bagpipe::bindings {

// The Python classes of the core's own error types. Owned references, never released (the
// classes live as long as the interpreter).
struct ErrorClasses {
  PyObject* session = nullptr;        // SessionError (a RuntimeError)
  PyObject* transport = nullptr;      // TransportError (a ConnectionError)
  PyObject* shutting_down = nullptr;  // ShuttingDownError (a TransportError)
  PyObject* start_step = nullptr;     // StartStepError (a ValueError)
};

// REQUIRES: GIL held; p not null; classes set. Sets the Python error of the native
// exception in p; rethrows an exception of any other type (invariant 2).
inline void TranslateError(std::exception_ptr p, const ErrorClasses& classes) {
  try {
    std::rethrow_exception(p);
  } catch (const ShuttingDownError& e) {
    PyErr_SetString(classes.shutting_down, e.what());
  } catch (const TransportError& e) {
    PyErr_SetString(classes.transport, e.what());
  } catch (const SessionError& e) {
    PyErr_SetString(classes.session, e.what());
  } catch (const StartStepError& e) {
    PyErr_SetString(classes.start_step, e.what());
  } catch (const TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (const IOError& e) {
    PyErr_SetString(PyExc_OSError, e.what());
  } catch (const MemoryBudgetError& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const std::bad_alloc& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  }
}

}  // namespace bagpipe::bindings
