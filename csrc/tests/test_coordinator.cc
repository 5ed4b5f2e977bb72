#include <cstring>
#include <memory>
#include <vector>

#include "common/errors.h"
#include "shard/coordinator.h"
#include "tests/ps_test_util.h"
#include "tests/test_harness.h"

using namespace bagpipe;
using namespace bagpipe::shard;
using bagpipe::testing::MapTable;
using bagpipe::testing::RecordingLink;
using wire::Disposition;
using wire::MsgType;
using wire::Status;

namespace {

constexpr uint32_t kDim = 2;
constexpr float kLr = 0.25f;

struct Fixture {
  MapTable* table;
  std::unique_ptr<CommitCoordinator> coord;
  std::vector<std::shared_ptr<RecordingLink>> links;
  TableSchema spec;
  SessionParams params;
  // owned: chunks arrive in `reader`, a receive buffer the coordinator may take over (as
  // the TCP server's), which is then overwritten by the next frame.
  bool owned = false;
  transport::RecvBuffer reader;

  explicit Fixture(uint32_t world, bool division = true) {
    spec.dim = kDim;
    spec.init.kind = store::InitKind::kConstant;
    spec.init.value = 1.0f;
    spec.key_bound = 1000;
    auto t = std::make_unique<MapTable>(spec);
    table = t.get();
    coord = std::make_unique<CommitCoordinator>("emb", std::move(t), -1, CoordinatorOptions{});
    params.session = 77;
    params.world_size = world;
    params.dim = kDim;
    params.grad_division = division;
    for (uint32_t r = 0; r < world; ++r) {
      links.push_back(std::make_shared<RecordingLink>());
      CHECK_EQ(coord->Open(params, r, spec, links.back()), int64_t{-1});
    }
  }

  // Submits a chunk from rank r; returns the frames its link received.
  std::vector<RecordingLink::Frame> Send(int64_t step, uint32_t rank, uint32_t index,
                                         uint32_t count, const std::vector<int64_t>& keys,
                                         const std::vector<float>& grads, float lr = kLr) {
    wire::CommitBody b{};
    b.session = params.session;
    b.step = step;
    b.rank = rank;
    b.world_size = params.world_size;
    b.chunk_index = index;
    b.chunk_count = count;
    b.dim = kDim;
    b.lr = lr;
    b.nrows = static_cast<uint32_t>(keys.size());
    auto bytes = bagpipe::testing::CommitBodyBytes(b, keys, grads);
    const uint8_t* body = bytes.data();
    if (owned) {
      reader.Reserve(bytes.size());
      std::memcpy(reader.data.get(), bytes.data(), bytes.size());
      body = reader.data.get();
    }
    wire::CommitView v;
    std::string why;
    CHECK(wire::ParseCommit(body, bytes.size(), &v, &why));
    coord->SubmitChunk(v, links[rank], 1000 + index, index, owned ? &reader : nullptr);
    if (owned && reader.cap > 0) {
      std::memset(reader.data.get(), 0xAB, reader.cap);  // the reader's next frame
    }
    return links[rank]->Take();
  }
};

Disposition AckOf(const std::vector<RecordingLink::Frame>& frames) {
  for (const auto& f : frames) {
    if (f.type == MsgType::kAck) return static_cast<Disposition>(wire::Load<wire::AckBody>(f.fixed.data()).disposition);
  }
  throw bagpipe::testing::CheckFailure("no ACK among the frames");
}

bool HasError(const std::vector<RecordingLink::Frame>& frames, Status st, const std::string& text) {
  for (const auto& f : frames) {
    if (f.type == MsgType::kError && f.status == st && f.Text().find(text) != std::string::npos) return true;
  }
  return false;
}

std::vector<float> ReadRow(CommitCoordinator& c, int64_t key) {
  std::vector<float> out(kDim);
  c.Read(&key, 1, out.data(), /*with_state=*/false);
  return out;
}

}  // namespace

TEST_CASE(coordinator_open_refuses_mismatches_naming_the_field) {
  Fixture fx(2);
  auto link = std::make_shared<RecordingLink>();
  auto refused = [&](SessionParams p, TableSchema s, const char* field) {
    try {
      fx.coord->Open(p, 0, s, link);
    } catch (const ValueError& e) {
      if (std::string(e.what()).find(field) == std::string::npos) {
        throw bagpipe::testing::CheckFailure(std::string("message lacks ") + field + ": " + e.what());
      }
      return;
    }
    throw bagpipe::testing::CheckFailure(std::string("open with another ") + field + " was accepted");
  };
  auto p = fx.params;
  p.world_size = 3;
  refused(p, fx.spec, "world_size");
  p = fx.params;
  p.dim = 4;
  auto s = fx.spec;
  s.dim = 4;
  refused(p, s, "dim");
  p = fx.params;
  p.grad_division = false;
  refused(p, fx.spec, "gradient_division");
  p = fx.params;
  p.session = 5;
  refused(p, fx.spec, "session");
  s = fx.spec;
  s.init.value = 2.0f;
  refused(fx.params, s, "init_value");
  s = fx.spec;
  s.key_bound = 5;
  refused(fx.params, s, "key_bound");
  // The table's optimizer: another kind, or another constant the kind uses.
  s = fx.spec;
  s.optimizer.kind = store::OptimizerKind::kRowWiseAdagrad;
  refused(fx.params, s, "optimizer.kind 'rowwise_adagrad' differs from the table's 'sgd'");
  s = fx.spec;
  s.optimizer.weight_decay = 0.01;
  refused(fx.params, s, "optimizer.weight_decay");
  // Rank 0 is attached through another link.
  refused(fx.params, fx.spec, "already has the session open");
}

TEST_CASE(coordinator_sums_in_rank_then_chunk_order_and_applies_once) {
  Fixture fx(2);
  // Rank 1 sends chunk 1 first, then rank 0 its single chunk, then rank 1 chunk 0.
  CHECK(AckOf(fx.Send(0, 1, 1, 2, {5}, {0.3f, -0.7f})) == Disposition::kStored);
  CHECK(AckOf(fx.Send(0, 0, 0, 1, {5, 9}, {0.1f, 0.2f, 1.5f, 2.5f})) == Disposition::kStored);
  CHECK_EQ(fx.table->apply_calls, 0);
  CHECK_EQ(fx.coord->committed_step(), int64_t{-1});
  // Duplicate copy of a pending chunk: acknowledged, nothing changes.
  CHECK(AckOf(fx.Send(0, 1, 1, 2, {5}, {0.3f, -0.7f})) == Disposition::kDuplicate);
  auto frames = fx.Send(0, 1, 0, 2, {9, 5}, {0.5f, 0.5f, 0.25f, 0.125f});
  CHECK(AckOf(frames) == Disposition::kStored);
  CHECK_EQ(fx.table->apply_calls, 1);
  CHECK_EQ(fx.coord->committed_step(), int64_t{0});
  // Every rank heard about the commit.
  bool notified = false;
  for (const auto& f : frames) notified |= f.type == MsgType::kNotifyCommitted;
  CHECK(notified);
  CHECK(fx.links[0]->Take().size() == 1);

  // The reference: one update over rank 0 chunk 0, rank 1 chunk 0, rank 1 chunk 1.
  MapTable ref(fx.spec);
  std::vector<int64_t> keys{5, 9, 9, 5, 5};
  std::vector<float> grads{0.1f, 0.2f, 1.5f, 2.5f, 0.5f, 0.5f, 0.25f, 0.125f, 0.3f, -0.7f};
  ref.ApplyGradients(keys.data(), keys.size(), grads.data(), kLr, 2);
  for (int64_t k : {5, 9}) {
    auto got = ReadRow(*fx.coord, k);
    auto want = ref.Row(k);
    CHECK(std::memcmp(got.data(), want.data(), kDim * 4) == 0);
  }
  // A retry of the committed step: acknowledged without SGD.
  CHECK(AckOf(fx.Send(0, 0, 0, 1, {5, 9}, {9.f, 9.f, 9.f, 9.f})) == Disposition::kAlreadyCommitted);
  CHECK_EQ(fx.table->apply_calls, 1);
}

// Chunks kept in taken receive buffers: the reader's buffer is overwritten after every
// frame, so a chunk that still referred to it would apply (or compare) garbage.
TEST_CASE(coordinator_owned_receive_buffers_stay_exact) {
  Fixture fx(2);
  fx.owned = true;
  MapTable ref(fx.spec);
  for (int64_t step = 0; step < 4; ++step) {
    const float s = static_cast<float>(step + 1);
    const std::vector<int64_t> k10{5, 9}, k11{9}, k00{7, 5, 5};
    const std::vector<float> g10{0.1f * s, 0.2f, 1.5f, 2.5f * s}, g11{0.3f, -0.7f * s};
    const std::vector<float> g00{1.f, s, 0.25f, 0.5f, s, -2.f};
    CHECK(AckOf(fx.Send(step, 1, 1, 2, k11, g11)) == Disposition::kStored);
    CHECK(AckOf(fx.Send(step, 0, 0, 1, k00, g00)) == Disposition::kStored);
    // A duplicate is compared with the kept copy, not with the reader's buffer.
    CHECK(AckOf(fx.Send(step, 1, 1, 2, k11, g11)) == Disposition::kDuplicate);
    CHECK(AckOf(fx.Send(step, 0, 0, 1, k00, g00)) == Disposition::kDuplicate);
    CHECK(AckOf(fx.Send(step, 1, 0, 2, k10, g10)) == Disposition::kStored);
    CHECK_EQ(fx.coord->committed_step(), step);
    std::vector<int64_t> keys = k00;
    keys.insert(keys.end(), k10.begin(), k10.end());
    keys.insert(keys.end(), k11.begin(), k11.end());
    std::vector<float> grads = g00;
    grads.insert(grads.end(), g10.begin(), g10.end());
    grads.insert(grads.end(), g11.begin(), g11.end());
    ref.ApplyGradients(keys.data(), keys.size(), grads.data(), kLr, 2);
    for (int64_t k : {5, 7, 9}) {
      auto got = ReadRow(*fx.coord, k);
      auto want = ref.Row(k);
      CHECK(std::memcmp(got.data(), want.data(), kDim * 4) == 0);
    }
  }
  CHECK_EQ(fx.table->apply_calls, 4);
  // A conflicting retry of a kept chunk is still detected.
  fx.Send(4, 0, 0, 1, {1}, {1.f, 1.f});
  CHECK(HasError(fx.Send(4, 0, 0, 1, {1}, {1.f, 2.f}), Status::kSessionFailed, "conflicting retry"));
}

// Each step applies the learning rate its chunks carry (an LR schedule): here a different
// one per step, 0 included (a warm-up may start there).
TEST_CASE(coordinator_applies_each_steps_lr) {
  Fixture fx(2);
  MapTable ref(fx.spec);
  const float lrs[] = {0.0f, 0.5f, 0.125f, 3.0f};
  for (int64_t step = 0; step < 4; ++step) {
    const float lr = lrs[step];
    fx.Send(step, 1, 0, 1, {9, 5}, {0.5f, 0.25f, 1.f, -1.f}, lr);
    fx.Send(step, 0, 0, 1, {5}, {2.f, 0.75f}, lr);
    CHECK_EQ(fx.coord->committed_step(), step);
    std::vector<int64_t> keys{5, 9, 5};
    std::vector<float> grads{2.f, 0.75f, 0.5f, 0.25f, 1.f, -1.f};
    ref.ApplyGradients(keys.data(), keys.size(), grads.data(), lr, 2);
    for (int64_t k : {5, 9}) {
      auto got = ReadRow(*fx.coord, k);
      auto want = ref.Row(k);
      CHECK(std::memcmp(got.data(), want.data(), kDim * 4) == 0);
    }
  }
}

TEST_CASE(coordinator_conflicting_lr_fails_the_session) {
  Fixture fx(2);
  CHECK(AckOf(fx.Send(0, 0, 0, 1, {1}, {1.f, 1.f}, 0.25f)) == Disposition::kStored);
  auto frames = fx.Send(0, 1, 0, 1, {2}, {1.f, 1.f}, 0.5f);
  CHECK(HasError(frames, Status::kSessionFailed, "conflicting lr"));
  CHECK(fx.coord->failed());
  CHECK(fx.coord->failure().find("0.25") != std::string::npos);
  CHECK_EQ(fx.table->apply_calls, 0);
}

TEST_CASE(coordinator_get_refuses_another_state_width) {
  Fixture fx(1);
  auto link = fx.links[0];
  const int64_t key = 3;
  fx.coord->Get(-1, &key, 1, kDim, 7, link, 5, 0);
  CHECK(HasError(link->Take(), Status::kInvalidArgument, "state_dim 7"));
  fx.coord->Get(-1, &key, 1, kDim, 0, link, 6, 0);
  bool served = false;
  for (const auto& f : link->Take()) served |= f.type == MsgType::kGetOk && f.payload.size() == kDim * 4;
  CHECK(served);
}

TEST_CASE(coordinator_empty_step_advances) {
  Fixture fx(3, false);
  for (uint32_t r = 0; r < 3; ++r) fx.Send(0, r, 0, 1, {}, {});
  CHECK_EQ(fx.coord->committed_step(), int64_t{0});
  CHECK_EQ(fx.table->apply_calls, 0);  // nothing to apply, the step still commits
}

TEST_CASE(coordinator_conflicting_retry_fails_the_session) {
  Fixture fx(2);
  fx.Send(0, 0, 0, 1, {1}, {1.f, 1.f});
  auto frames = fx.Send(0, 0, 0, 1, {1}, {1.f, 2.f});
  CHECK(HasError(frames, Status::kSessionFailed, "conflicting retry"));
  CHECK(fx.coord->failed());
  // The other rank was told, and its next chunk is refused with the same error.
  bool told = false;
  for (const auto& f : fx.links[1]->Take()) told |= f.type == MsgType::kNotifyFailed;
  CHECK(told);
  CHECK(HasError(fx.Send(0, 1, 0, 1, {2}, {1.f, 1.f}), Status::kSessionFailed, "conflicting retry"));
  CHECK_EQ(fx.table->apply_calls, 0);
}

TEST_CASE(coordinator_chunk_count_change_is_a_conflict) {
  Fixture fx(1);
  fx.Send(0, 0, 0, 2, {1}, {1.f, 1.f});
  CHECK(HasError(fx.Send(0, 0, 1, 3, {2}, {1.f, 1.f}), Status::kSessionFailed, "chunk_count"));
}

TEST_CASE(coordinator_out_of_order_step_fails_the_session) {
  Fixture fx(2);
  auto frames = fx.Send(1, 0, 0, 1, {1}, {1.f, 1.f});
  CHECK(HasError(frames, Status::kSessionFailed, "out-of-order step"));
  CHECK(fx.coord->failed());
  CHECK(fx.coord->failure().find("step 1") != std::string::npos);
}

TEST_CASE(coordinator_bad_chunk_is_refused_without_failing) {
  Fixture fx(1);
  CHECK(HasError(fx.Send(0, 0, 0, 1, {1000}, {1.f, 1.f}), Status::kInvalidArgument, "outside [0, 1000)"));
  CHECK(!fx.coord->failed());
  fx.Send(0, 0, 0, 1, {3}, {1.f, 1.f});
  CHECK_EQ(fx.coord->committed_step(), int64_t{0});
}

TEST_CASE(coordinator_deferred_get_is_served_at_its_step) {
  Fixture fx(2);
  int64_t key = 4;
  fx.coord->Get(0, &key, 1, kDim, 0, fx.links[0], 55, 2);
  CHECK(fx.links[0]->Take().empty());  // waits for step 0
  fx.Send(0, 0, 0, 1, {4}, {1.f, 1.f});
  fx.Send(0, 1, 0, 1, {}, {});
  auto frames = fx.links[0]->Take();
  bool served = false;
  for (const auto& f : frames) {
    if (f.type != MsgType::kGetOk) continue;
    served = true;
    CHECK_EQ(f.tag, uint64_t{55});
    CHECK_EQ(wire::Load<wire::GetOkBody>(f.fixed.data()).served_step, int64_t{0});
    auto want = ReadRow(*fx.coord, 4);
    CHECK(std::memcmp(f.payload.data(), want.data(), kDim * 4) == 0);
  }
  CHECK(served);
  // A get of a committed step is served at once; a wrong dim is refused.
  fx.coord->Get(0, &key, 1, kDim, 0, fx.links[1], 56, 0);
  CHECK(fx.links[1]->Take().back().type == MsgType::kGetOk);
  fx.coord->Get(0, &key, 1, kDim + 1, 0, fx.links[1], 57, 0);
  CHECK(HasError(fx.links[1]->Take(), Status::kInvalidArgument, "dim"));
}

TEST_CASE(coordinator_leaving_with_a_pending_step_fails_and_reset_follows) {
  Fixture fx(2);
  fx.Send(0, 0, 0, 1, {1}, {1.f, 1.f});
  fx.coord->Detach(fx.links[1].get());  // rank 1 vanished before sending step 0
  CHECK(fx.coord->failed());
  CHECK(fx.coord->failure().find("rank 1 disconnected") != std::string::npos);
  bool told = false;
  for (const auto& f : fx.links[0]->Take()) told |= f.type == MsgType::kNotifyFailed;
  CHECK(told);
  // Re-opening while rank 0 is still attached: refused with the failure.
  CHECK_THROWS(SessionError, fx.coord->Open(fx.params, 1, fx.spec, std::make_shared<RecordingLink>()));
  fx.coord->Close(0, fx.links[0].get());
  CHECK_EQ(fx.coord->attached_ranks(), 0);
  // Every rank left: a new job may open the table at the same committed step.
  auto p = fx.params;
  p.session = 99;
  p.world_size = 1;
  auto l = std::make_shared<RecordingLink>();
  CHECK_EQ(fx.coord->Open(p, 0, fx.spec, l), int64_t{-1});
  CHECK(!fx.coord->failed());
}

TEST_CASE(coordinator_read_at_times_out) {
  Fixture fx(1);
  int64_t key = 1;
  float out[kDim];
  CHECK_THROWS(TimeoutError, fx.coord->ReadAt(3, &key, 1, out, DeadlineAfter(0.05)));
  fx.Send(0, 0, 0, 1, {1}, {1.f, 1.f});
  CHECK_EQ(fx.coord->ReadAt(0, &key, 1, out, DeadlineAfter(1)), int64_t{0});
}

// The session's start step (wire::OpenBody::start_step): an Open that would renumber the
// table's committed steps is refused naming the table and both steps, whichever rank and
// session asks; a declared resume from the committed step opens, and kAnyStartStep attaches
// without a check. A refused Open attaches nothing.
TEST_CASE(coordinator_refuses_an_open_whose_start_step_is_not_the_committed_step) {
  Fixture fx(1);
  for (int64_t t = 0; t < 5; ++t) fx.Send(t, 0, 0, 1, {1}, {1.f, 1.f});
  CHECK_EQ(fx.coord->committed_step(), int64_t{4});
  fx.coord->Close(0, fx.links[0].get());
  auto expect_refused = [&](int64_t start, uint64_t session, const char* why) {
    auto p = fx.params;
    p.session = session;
    p.start_step = start;
    try {
      fx.coord->Open(p, 0, fx.spec, std::make_shared<RecordingLink>());
      CHECK(false);
    } catch (const StartStepError& e) {
      const std::string what = e.what();
      CHECK(what.find("table 'emb'") != std::string::npos);
      if (what.find(why) == std::string::npos) throw testing::CheckFailure(what);
    }
    CHECK_EQ(fx.coord->attached_ranks(), 0);
  };
  expect_refused(-1, 77, "committed steps up to 4");  // the same job's session id
  expect_refused(-1, 99, "steps 0..4 would be acknowledged without being applied");
  expect_refused(3, 77, "resumes after step 3, but the table's committed step is 4");
  expect_refused(5, 77, "resumes after step 5");
  auto p = fx.params;
  p.start_step = 4;  // a declared resume
  auto l = std::make_shared<RecordingLink>();
  CHECK_EQ(fx.coord->Open(p, 0, fx.spec, l), int64_t{4});
  fx.coord->Close(0, l.get());
  p.start_step = wire::kAnyStartStep;
  CHECK_EQ(fx.coord->Open(p, 0, fx.spec, l), int64_t{4});
}
