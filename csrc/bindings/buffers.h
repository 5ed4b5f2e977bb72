// Zero-copy argument checking for the bindings. Every check names the argument and raises
// TypeError (dtype, layout) or ValueError (shape) before any native work starts.
//
// Thread safety: the checks read Python objects, so they run with the GIL held; the views
// they return may be used after the GIL is released while the caller keeps the arrays alive.
// Invariants:
//   1. A view is never a copy: its data pointer is the array's own buffer.
//   2. A failed check has written nothing anywhere.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "common/errors.h"

namespace bagpipe::bindings {

namespace py = pybind11;

template <typename T>
struct ConstVec {
  const T* data = nullptr;
  size_t size = 0;
};

template <typename T>
struct MutMatrix {
  T* data = nullptr;
  size_t rows = 0;
  size_t cols = 0;
};

template <typename T>
struct ConstMatrix {
  const T* data = nullptr;
  size_t rows = 0;
  size_t cols = 0;
};

template <typename T>
const char* DtypeName();
template <>
inline const char* DtypeName<int64_t>() { return "int64"; }
template <>
inline const char* DtypeName<float>() { return "float32"; }
template <>
inline const char* DtypeName<uint8_t>() { return "uint8"; }
template <>
inline const char* DtypeName<int32_t>() { return "int32"; }

// Returns the buffer of `arr` after checking dtype T, C-contiguity, writability (when asked)
// and ndim (TypeError / ValueError naming `name`). REQUIRES (every check here): GIL held.
template <typename T>
py::buffer_info CheckedBuffer(const py::array& arr, const char* name, int ndim, bool writable) {
  if (!py::isinstance<py::array_t<T>>(arr) || arr.dtype().kind() != py::dtype::of<T>().kind() ||
      arr.itemsize() != static_cast<py::ssize_t>(sizeof(T))) {
    throw TypeError(std::string(name) + " must have dtype " + DtypeName<T>() + ", got " +
                    std::string(py::str(arr.dtype())));
  }
  if (!(arr.flags() & py::array::c_style)) {
    throw TypeError(std::string(name) + " must be C-contiguous");
  }
  if (writable && !arr.writeable()) {
    throw TypeError(std::string(name) + " must be writable");
  }
  if (arr.ndim() != ndim) {
    throw ValueError(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                     std::to_string(arr.ndim()) + "-D");
  }
  return arr.request(writable);
}

// A 1-D array of T.
template <typename T>
ConstVec<T> Vec(const py::array& arr, const char* name) {
  auto info = CheckedBuffer<T>(arr, name, 1, false);
  return {static_cast<const T*>(info.ptr), static_cast<size_t>(info.shape[0])};
}

// A (rows, cols) matrix; rows < 0 / cols < 0 accept any size.
template <typename T>
ConstMatrix<T> Mat(const py::array& arr, const char* name, py::ssize_t rows, py::ssize_t cols) {
  auto info = CheckedBuffer<T>(arr, name, 2, false);
  if ((rows >= 0 && info.shape[0] != rows) || (cols >= 0 && info.shape[1] != cols)) {
    throw ValueError(std::string(name) + " must have shape (" +
                     (rows >= 0 ? std::to_string(rows) : std::string("n")) + ", " +
                     (cols >= 0 ? std::to_string(cols) : std::string("m")) + "), got (" +
                     std::to_string(info.shape[0]) + ", " + std::to_string(info.shape[1]) + ")");
  }
  return {static_cast<const T*>(info.ptr), static_cast<size_t>(info.shape[0]),
          static_cast<size_t>(info.shape[1])};
}

template <typename T>
MutMatrix<T> MutMat(const py::array& arr, const char* name, py::ssize_t rows, py::ssize_t cols) {
  auto info = CheckedBuffer<T>(arr, name, 2, true);
  if ((rows >= 0 && info.shape[0] != rows) || (cols >= 0 && info.shape[1] != cols)) {
    throw ValueError(std::string(name) + " must have shape (" + std::to_string(rows) + ", " +
                     std::to_string(cols) + "), got (" + std::to_string(info.shape[0]) + ", " +
                     std::to_string(info.shape[1]) + ")");
  }
  return {static_cast<T*>(info.ptr), static_cast<size_t>(info.shape[0]),
          static_cast<size_t>(info.shape[1])};
}

}  // namespace bagpipe::bindings
