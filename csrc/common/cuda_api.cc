#include "common/cuda_api.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace bagpipe {
namespace {

// cudaError_t values used here (stable across CUDA releases).
constexpr int kCudaSuccess = 0;
constexpr int kCudaErrorNotReady = 600;
constexpr int kCudaMemcpyDeviceToHost = 2;
constexpr unsigned kCudaStreamNonBlocking = 1;

class CudaRuntime : public DeviceApi {
 public:
  explicit CudaRuntime(void* lib, std::string soname) : lib_(lib), soname_(std::move(soname)) {}

  bool Resolve(std::string* missing) {
    bool ok = true;
    auto get = [&](auto& fn, const char* sym) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib_, sym));
      if (fn == nullptr) {
        ok = false;
        *missing = sym;
      }
    };
    get(set_device_, "cudaSetDevice");
    get(event_query_, "cudaEventQuery");
    get(stream_create_, "cudaStreamCreateWithFlags");
    get(stream_destroy_, "cudaStreamDestroy");
    get(memcpy_async_, "cudaMemcpyAsync");
    get(stream_query_, "cudaStreamQuery");
    get(host_alloc_, "cudaHostAlloc");
    get(free_host_, "cudaFreeHost");
    get(error_string_, "cudaGetErrorString");
    return ok;
  }

  std::string name() const override { return soname_; }
  void SetDevice(int device) override { Check(set_device_(device), "cudaSetDevice"); }
  bool EventDone(void* event) override { return Ready(event_query_(event), "cudaEventQuery"); }
  void* CreateStream() override {
    void* s = nullptr;
    Check(stream_create_(&s, kCudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }
  void DestroyStream(void* stream) override { stream_destroy_(stream); }
  void CopyToHostAsync(void* dst, const void* src, size_t bytes, void* stream) override {
    Check(memcpy_async_(dst, src, bytes, kCudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  }
  bool StreamDone(void* stream) override { return Ready(stream_query_(stream), "cudaStreamQuery"); }
  void* AllocPinned(size_t bytes) override {
    void* p = nullptr;
    Check(host_alloc_(&p, bytes == 0 ? 1 : bytes, 0), "cudaHostAlloc");
    return p;
  }
  void FreePinned(void* p) override { free_host_(p); }

 private:
  void Check(int err, const char* call) {
    if (err != kCudaSuccess) {
      throw std::runtime_error(std::string(call) + " failed: " + error_string_(err));
    }
  }
  bool Ready(int err, const char* call) {
    if (err == kCudaSuccess) return true;
    if (err == kCudaErrorNotReady) return false;
    Check(err, call);
    return false;
  }

  void* const lib_;  // never closed: the runtime stays loaded for the process
  const std::string soname_;
  int (*set_device_)(int) = nullptr;
  int (*event_query_)(void*) = nullptr;
  int (*stream_create_)(void**, unsigned) = nullptr;
  int (*stream_destroy_)(void*) = nullptr;
  int (*memcpy_async_)(void*, const void*, size_t, int, void*) = nullptr;
  int (*stream_query_)(void*) = nullptr;
  int (*host_alloc_)(void**, size_t, unsigned) = nullptr;
  int (*free_host_)(void*) = nullptr;
  const char* (*error_string_)(int) = nullptr;
};

}  // namespace

std::shared_ptr<DeviceApi> CudaRuntimeApi(std::string* why) {
  static std::mutex mu;
  static std::shared_ptr<DeviceApi> api;
  static std::string error;
  std::lock_guard<std::mutex> lock(mu);
  if (api) return api;
  // Prefer a runtime the process already loaded (torch's), then any on the library path.
  const char* names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
  for (int pass = 0; pass < 2 && !api; ++pass) {
    for (const char* n : names) {
      void* lib = dlopen(n, RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (lib == nullptr) continue;
      auto rt = std::make_shared<CudaRuntime>(lib, n);
      std::string missing;
      if (rt->Resolve(&missing)) {
        api = rt;
        break;
      }
      error = std::string(n) + " lacks " + missing;
    }
  }
  if (!api && why != nullptr) {
    *why = error.empty()
               ? "the CUDA runtime (libcudart.so) could not be loaded: staging gradients from CUDA "
                 "memory needs a CUDA build of torch or the CUDA toolkit on the library path"
               : "the CUDA runtime found is unusable: " + error;
  }
  return api;
}

}  // namespace bagpipe
