// The few CUDA runtime calls gradient staging needs, behind an interface: the staging logic
// is tested with a fake, and CudaRuntimeApi() loads libcudart at run time (dlopen) — no build
// needs CUDA, and a process with torch's CUDA runtime already loaded shares it.
//
// Thread safety: DeviceApi implementations are thread-safe; SetDevice is per calling thread
// (as cudaSetDevice).
//
// Invariants:
//   1. Every failing call throws std::runtime_error with cudaGetErrorString's text and the
//      call's name; no call blocks without bound (queries only; the caller polls).
//   2. CudaRuntimeApi never throws: it returns nullptr and says which library is missing.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace bagpipe {

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;
  // What the API is, for messages ("libcudart.so.12", "fake").
  virtual std::string name() const = 0;
  // REQUIRES: before any call about device `device` on this thread.
  virtual void SetDevice(int device) = 0;
  // cudaEventQuery: true once the event completed, false while it is pending.
  virtual bool EventDone(void* event) = 0;
  // A non-blocking stream of the current device.
  virtual void* CreateStream() = 0;
  virtual void DestroyStream(void* stream) = 0;
  // Queues a device-to-host copy on `stream` (dst is pinned host memory).
  virtual void CopyToHostAsync(void* dst, const void* src, size_t bytes, void* stream) = 0;
  // cudaStreamQuery: true once everything queued on `stream` completed.
  virtual bool StreamDone(void* stream) = 0;
  // Page-locked host memory (cudaHostAlloc / cudaFreeHost).
  virtual void* AllocPinned(size_t bytes) = 0;
  virtual void FreePinned(void* p) = 0;
};

// The CUDA runtime of this process, or nullptr with *why naming what is missing.
std::shared_ptr<DeviceApi> CudaRuntimeApi(std::string* why);

}  // namespace bagpipe
