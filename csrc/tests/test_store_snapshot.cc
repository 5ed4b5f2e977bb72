// Non-blocking checkpoints (embedding_store.h invariant 8, embedding_store_snapshot.cc): the
// checkpoint a BeginCheckpoint starts holds exactly the store of that moment, bit for bit,
// whatever ops (updates, assigns, inserts, erases and the reuse of erased slots) run before
// or during its Write; a dropped or failed one loses nothing for the next.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "common/errors.h"
#include "store/embedding_store.h"
#include "tests/store_chain_util.h"
#include "tests/temp_dir.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;
using namespace bagpipe::testing::store_chain;
using bagpipe::testing::TempDir;

namespace {

StoreOptions ThreadedOptions(OptimizerKind kind) {
  StoreOptions o = Options(kind);
  o.num_threads = 2;
  return o;
}

void Rounds(EmbeddingStore& s, std::mt19937_64& rng, int rounds, double frac) {
  Changes ch;
  for (int i = 0; i < rounds; ++i) Mutate(s, rng, frac, &ch);
}

}  // namespace

TEST_CASE(store_snapshot_is_the_moment_of_begin_whatever_runs_before_the_write) {
  for (const OptimizerKind kind :
       {OptimizerKind::kSgd, OptimizerKind::kRowWiseAdagrad, OptimizerKind::kAdam}) {
    TempDir dir;
    EmbeddingStore s(ThreadedOptions(kind));
    std::mt19937_64 rng(static_cast<uint64_t>(kind) + 5);
    Rounds(s, rng, 6, 0.4);
    const std::string chain = dir.path + "/ck";
    for (int step = 0; step < 4; ++step) {  // a base, then increments
      auto pending = s.BeginCheckpoint(chain, step, {{"step", std::to_string(step)}},
                                       Policy(8, 100.0));
      CHECK_EQ(pending->incremental(), step > 0);
      const Contents at_begin = ContentsOf(s);
      CHECK_EQ(s.Stats().dirty_rows, 0);
      // Rounds of every op kind, erases and the reuse of their slots included.
      Rounds(s, rng, 12, 0.3);
      CHECK(ContentsOf(s) != at_begin);
      const CheckpointResult r = pending->Write();
      CHECK_EQ(r.incremental, step > 0);
      CHECK_EQ(r.links, step + 1);
      std::map<std::string, std::string> meta;
      CHECK(ContentsOf(*LoadDir(chain, {}, &meta)) == at_begin);
      CHECK_EQ(meta.at("step"), std::to_string(step));
    }
    // The changes made while the snapshot was open belong to the next link.
    const CheckpointResult r = s.Checkpoint(chain, 9, {}, Policy(8, 100.0));
    CHECK(r.incremental);
    CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
  }
}

TEST_CASE(store_snapshot_write_overlapping_ops_is_the_moment_of_begin) {
  TempDir dir;
  EmbeddingStore s(ThreadedOptions(OptimizerKind::kAdagrad));
  std::mt19937_64 rng(77);
  Rounds(s, rng, 8, 0.5);
  const std::string chain = dir.path + "/ck";
  for (int step = 0; step < 3; ++step) {
    auto pending = s.BeginCheckpoint(chain, step, {}, Policy(8, 100.0));
    const Contents at_begin = ContentsOf(s);
    CheckpointResult r;
    std::thread writer([&] { r = pending->Write(); });
    Rounds(s, rng, 20, 0.2);
    writer.join();
    CHECK_EQ(r.links, step + 1);
    CHECK(ContentsOf(*LoadDir(chain)) == at_begin);
  }
  s.Checkpoint(chain, 5, {}, Policy(8, 100.0));
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
}

TEST_CASE(store_snapshot_dropped_keeps_the_changes_for_the_next) {
  TempDir dir;
  EmbeddingStore s(ThreadedOptions(OptimizerKind::kRowWiseAdagrad));
  std::mt19937_64 rng(3);
  Rounds(s, rng, 6, 0.4);
  const std::string chain = dir.path + "/ck";
  s.Checkpoint(chain, 0, {}, Policy(8, 100.0));
  Rounds(s, rng, 4, 0.1);
  const int64_t dirty = s.Stats().dirty_rows;
  CHECK(dirty > 0);
  // An increment dropped unwritten: its rows and deletions are tracked again.
  s.BeginCheckpoint(chain, 1, {}, Policy(8, 100.0)).reset();
  CHECK_EQ(s.Stats().dirty_rows, dirty);
  // Dropped after ops ran on the open snapshot: nothing they changed is lost either.
  {
    auto pending = s.BeginCheckpoint(chain, 1, {}, Policy(8, 100.0));
    Rounds(s, rng, 4, 0.1);
  }
  CheckpointResult r = s.Checkpoint(chain, 2, {}, Policy(8, 100.0));
  CHECK(r.incremental);
  CHECK_EQ(r.links, 2);
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
  // A base dropped: the next one is a full base.
  Rounds(s, rng, 2, 0.1);
  s.BeginCheckpoint(dir.path + "/other", 3, {}, Policy(8, 100.0)).reset();
  r = s.Checkpoint(chain, 3, {}, Policy(8, 100.0));
  CHECK(!r.incremental);
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
}

TEST_CASE(store_snapshot_one_at_a_time_and_written_once) {
  TempDir dir;
  EmbeddingStore s(ThreadedOptions(OptimizerKind::kSgd));
  std::mt19937_64 rng(9);
  Rounds(s, rng, 3, 0.4);
  const std::string chain = dir.path + "/ck";
  auto pending = s.BeginCheckpoint(chain, 0, {}, Policy(8, 100.0));
  const std::string second = ErrorOf([&] { s.Checkpoint(chain, 1, {}, Policy(8, 100.0)); });
  CHECK(Contains(second, "step 0"));
  CHECK(Contains(second, "still being written"));
  CHECK(Contains(ErrorOf([&] { s.BeginCheckpoint(dir.path + "/x", 1, {}, Policy(8, 1.0)); }),
                 "still being written"));
  pending->Write();
  CHECK(Contains(ErrorOf([&] { pending->Write(); }), "written already"));
  CHECK(s.BeginCheckpoint(chain, 1, {}, Policy(8, 100.0))->incremental());
  // A directory that is not a checkpoint is refused at Begin, before anything changes.
  const std::string junk = dir.path + "/junk";
  WriteFile(junk, "x");
  Rounds(s, rng, 1, 0.2);
  const int64_t dirty = s.Stats().dirty_rows;
  CHECK(!ErrorOf([&] { s.BeginCheckpoint(junk, 2, {}, Policy(8, 100.0)); }).empty());
  CHECK_EQ(s.Stats().dirty_rows, dirty);
}

TEST_CASE(store_snapshot_write_that_fails_keeps_the_changes_and_the_previous_point) {
  TempDir dir;
  EmbeddingStore s(ThreadedOptions(OptimizerKind::kAdagrad));
  std::mt19937_64 rng(41);
  Rounds(s, rng, 6, 0.4);
  const std::string chain = dir.path + "/ck";
  s.Checkpoint(chain, 0, {}, Policy(8, 100.0));
  const Contents at_zero = ContentsOf(s);
  Rounds(s, rng, 3, 0.1);
  auto pending = s.BeginCheckpoint(chain, 1, {}, Policy(8, 100.0));
  CHECK(pending->incremental());
  Rounds(s, rng, 3, 0.1);
  // The write's temp directory disappears (a full disk, an operator): the write fails.
  bool removed = false;
  for (const std::string& n : Files(dir.path)) {
    if (n.rfind(".ck.tmp-", 0) != 0) continue;
    for (const std::string& f : Files(dir.path + "/" + n)) {
      CHECK(unlink((dir.path + "/" + n + "/" + f).c_str()) == 0);
    }
    CHECK(rmdir((dir.path + "/" + n).c_str()) == 0);
    removed = true;
  }
  CHECK(removed);
  bool threw = false;
  try {
    pending->Write();
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
  CHECK(ContentsOf(*LoadDir(chain)) == at_zero);  // the previous complete point
  // Nothing the failed link held is lost: the next one extends the chain with it.
  const CheckpointResult r = s.Checkpoint(chain, 2, {}, Policy(8, 100.0));
  CHECK(r.incremental);
  CHECK_EQ(r.links, 2);
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
}
