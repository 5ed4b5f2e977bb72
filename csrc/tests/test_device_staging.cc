// DeviceStager against a fake device API (no GPU needed): sources are read only after their
// producer event completed, buffers are pinned-pool buffers kept alive by the commit, waits
// are bounded, and a PSClient commit of staged gradients equals one of host gradients.
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "client/device_staging.h"
#include "client/ps_client.h"
#include "common/cuda_api.h"
#include "common/errors.h"
#include "shard/ps_shard.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"
#include "transport/local_channel.h"

using namespace bagpipe;
using namespace bagpipe::client;
using namespace bagpipe::transport;

namespace {

// "Device memory" is host memory; an event is an atomic flag the test sets once its
// "kernel" wrote the source. A copy reads the source only when its stream is queried, like
// an asynchronous DMA, and records whether the source's event had completed by then.
class FakeDevice : public DeviceApi {
 public:
  std::string name() const override { return "fake"; }
  void SetDevice(int device) override { last_device = device; }
  bool EventDone(void* event) override {
    return static_cast<std::atomic<bool>*>(event)->load();
  }
  void* CreateStream() override {
    ++streams;
    return new int(0);
  }
  void DestroyStream(void* s) override { delete static_cast<int*>(s); }
  void CopyToHostAsync(void* dst, const void* src, size_t bytes, void* stream) override {
    std::lock_guard<std::mutex> lock(mu);
    pending[stream].push_back({dst, src, bytes});
  }
  bool StreamDone(void* stream) override {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& c : pending[stream]) {
      auto it = events.find(c.src);
      if (it != events.end() && !it->second->load()) early_reads = true;
      std::memcpy(c.dst, c.src, c.bytes);
    }
    pending[stream].clear();
    return true;
  }
  void* AllocPinned(size_t bytes) override {
    ++pinned_allocs;
    return ::operator new(bytes);
  }
  void FreePinned(void* p) override { ::operator delete(p); }

  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  std::mutex mu;
  std::map<void*, std::vector<Copy>> pending;
  std::map<const void*, std::atomic<bool>*> events;  // source -> its event (test bookkeeping)
  std::atomic<int> last_device{-1};
  std::atomic<int> streams{0};
  std::atomic<int> pinned_allocs{0};
  bool early_reads = false;
};

}  // namespace

TEST_CASE(staging_reads_sources_only_after_their_event) {
  auto dev = std::make_shared<FakeDevice>();
  DeviceStager stager(dev, 5.0);
  const size_t n = 1000;
  std::vector<float> src(n, -1.0f);  // stale until the "kernel" runs
  std::atomic<bool> event{false};
  dev->events[src.data()] = &event;
  auto rows = stager.Stage({src.data(), n * 4, 3, &event});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(!rows->Done());  // the stager is waiting for the producer
  CHECK_THROWS(TimeoutError, rows->Wait(DeadlineAfter(0.01)));
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<float>(i) * 0.5f;  // the backward pass
  event.store(true);
  const float* got = rows->Wait(DeadlineAfter(5));
  for (size_t i = 0; i < n; ++i) CHECK_EQ(got[i], static_cast<float>(i) * 0.5f);
  CHECK(!dev->early_reads);
  CHECK_EQ(dev->last_device.load(), 3);
  const auto st = stager.stats();
  CHECK_EQ(st.staged, uint64_t{1});
  CHECK_EQ(st.bytes, uint64_t{n * 4});
  CHECK(st.event_polls > 0);
}

TEST_CASE(staging_reuses_pinned_buffers_after_the_commit_releases_them) {
  auto dev = std::make_shared<FakeDevice>();
  DeviceStager stager(dev, 5.0);
  std::atomic<bool> done{true};
  std::vector<float> a(300, 1.0f), b(200, 2.0f);
  {
    auto r1 = stager.Stage({a.data(), a.size() * 4, 0, &done});
    r1->Wait(DeadlineAfter(5));
  }  // released by the commit; the worker drops its own reference before its next job
  stager.Stage({nullptr, 0, 0, nullptr})->Wait(DeadlineAfter(5));
  auto r2 = stager.Stage({b.data(), b.size() * 4, 0, &done});
  const float* got = r2->Wait(DeadlineAfter(5));
  CHECK_EQ(got[199], 2.0f);
  CHECK_EQ(dev->pinned_allocs.load(), 1);
  // Held buffers are not reused: a second concurrent job gets its own.
  auto r3 = stager.Stage({a.data(), a.size() * 4, 0, &done});
  r3->Wait(DeadlineAfter(5));
  CHECK_EQ(dev->pinned_allocs.load(), 2);
  CHECK_EQ(dev->streams.load(), 1);
  // Empty gradients need no buffer and no event.
  auto r4 = stager.Stage({nullptr, 0, 0, nullptr});
  CHECK(r4->Wait(DeadlineAfter(5)) == nullptr);
  CHECK_THROWS(ValueError, stager.Stage({nullptr, 16, 0, &done}));
}

TEST_CASE(staging_times_out_when_the_producer_never_finishes) {
  auto dev = std::make_shared<FakeDevice>();
  DeviceStager stager(dev, 0.05);
  std::vector<float> src(8, 1.0f);
  std::atomic<bool> never{false};
  auto rows = stager.Stage({src.data(), 32, 1, &never});
  try {
    rows->Wait(DeadlineAfter(5));
    CHECK(false);
  } catch (const TimeoutError& e) {
    CHECK(std::string(e.what()).find("device 1") != std::string::npos);
  }
  CHECK_EQ(stager.stats().failed, uint64_t{1});
  // Later jobs still run.
  std::atomic<bool> ok{true};
  auto next = stager.Stage({src.data(), 32, 1, &ok});
  CHECK_EQ(next->Wait(DeadlineAfter(5))[7], 1.0f);
}

TEST_CASE(staged_commit_equals_host_commit) {
  auto dev = std::make_shared<FakeDevice>();
  DeviceStager stager(dev, 5.0);
  auto make_shard = [] {
    shard::ShardOptions o;
    return std::make_shared<shard::PSShard>(o, bagpipe::testing::MapTableFactory(),
                                             bagpipe::testing::NoLoader());
  };
  auto shard_a = make_shard();
  auto shard_b = make_shard();
  client::ClientOptions o;
  o.table = "emb";
  o.session = 3;
  o.dim = 4;
  o.lr = 0.25f;
  o.init.kind = store::InitKind::kConstant;
  o.init.value = 1.0f;
  o.max_packet_rows = 2;
  o.inflight_packets = 2;
  o.timeout = 10;
  ChannelOptions co;
  co.num_slots = o.inflight_packets;
  co.slot_bytes = client::SlotBytesFor(o);
  auto client = [&](std::shared_ptr<shard::PSShard> s) {
    std::vector<std::unique_ptr<Channel>> c;
    c.push_back(std::make_unique<LocalChannel>(s, co));
    return std::make_unique<client::PSClient>(o, std::move(c));
  };
  auto ca = client(shard_a);
  auto cb = client(shard_b);
  std::vector<int64_t> keys = {3, 1, 4, 1, 5};
  for (int t = 0; t < 6; ++t) {
    std::vector<float> grads(keys.size() * 4);
    for (size_t i = 0; i < grads.size(); ++i) grads[i] = static_cast<float>((i * 7 + t) % 11) - 5;
    ca->CommitAsync(t, keys.data(), keys.size(), grads.data())->Wait(DeadlineAfter(10));
    std::atomic<bool> event{false};
    {
      std::lock_guard<std::mutex> lock(dev->mu);
      dev->events[grads.data()] = &event;
    }
    auto staged = stager.Stage({grads.data(), grads.size() * 4, 0, &event});
    const auto deadline = DeadlineAfter(10);
    auto op = cb->CommitAsync(t, keys.data(), keys.size(), staged->data(),
                              [staged, deadline] { staged->Wait(deadline); });
    staged.reset();  // the op's ready hook keeps the staged rows alive
    event.store(true);
    op->Wait(DeadlineAfter(10));
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->events.erase(grads.data());
  }
  std::vector<float> ra(5 * 4), rb(5 * 4);
  ca->GetAsync(keys.data(), keys.size(), 5, ra.data())->Wait(DeadlineAfter(10));
  cb->GetAsync(keys.data(), keys.size(), 5, rb.data())->Wait(DeadlineAfter(10));
  CHECK(std::memcmp(ra.data(), rb.data(), ra.size() * 4) == 0);
  CHECK(!dev->early_reads);
  CHECK_EQ(stager.stats().staged, uint64_t{6});
  ca->Close(5);
  cb->Close(5);
}

TEST_CASE(cuda_runtime_absence_is_explained) {
  std::string why;
  auto api = CudaRuntimeApi(&why);
  if (!api) CHECK(why.find("libcudart") != std::string::npos);
}
