// Chained (incremental) checkpoints of the EmbeddingStore (embedding_store_incremental.cc):
// a chain loads bitwise as the full checkpoint of the same step, a full base is written
// every K increments or past the chain fraction (older links compacted away), a torn or
// corrupt increment is refused while the links before it still load, version 2 manifests
// still load.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/checksum.h"
#include "store/embedding_store.h"
#include "store/manifest.h"
#include "tests/store_chain_util.h"
#include "tests/temp_dir.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;
using namespace bagpipe::testing::store_chain;
using bagpipe::testing::TempDir;

namespace {

bool HasIncrementFiles(const std::string& dir) {
  for (const auto& n : Files(dir)) {
    if (n.rfind("inc-", 0) == 0) return true;
  }
  return false;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}



}  // namespace

TEST_CASE(store_chain_loads_bitwise_as_the_full_checkpoint_of_each_step) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdagrad, OptimizerKind::kAdam}) {
    TempDir dir;
    EmbeddingStore s(Options(kind));
    std::mt19937_64 rng(3);
    Changes ch;
    for (int i = 0; i < 4; ++i) Mutate(s, rng, 0.3, &ch);
    const std::string chain = dir.path + "/chain";
    CheckpointResult r = s.Checkpoint(chain, 0, {{"step", "0"}}, Policy(8, 100.0));
    CHECK(!r.incremental);
    CHECK_EQ(r.links, 1);
    CHECK_EQ(s.Stats().dirty_rows, 0);
    std::vector<Contents> at_step{ContentsOf(s)};
    std::set<int64_t> stored_before;
    for (auto& [k, _] : at_step[0]) stored_before.insert(k);
    for (int step = 1; step <= 6; ++step) {
      Changes c;
      for (int i = 0; i < 3; ++i) Mutate(s, rng, step % 2 ? 0.02 : 0.2, &c);
      const Contents now = ContentsOf(s);
      // Exactly the rows changed and still stored, and the erased keys not stored again.
      size_t changed = 0, deleted = 0;
      for (int64_t k : c.touched) changed += now.count(k);
      for (int64_t k : c.erased) deleted += now.count(k) == 0;
      CHECK_EQ(static_cast<size_t>(s.Stats().dirty_rows), changed);
      const std::string full = dir.path + "/full-" + std::to_string(step);
      s.Save(full, {{"step", std::to_string(step)}}, false);
      r = s.Checkpoint(chain, step, {{"step", std::to_string(step)}}, Policy(8, 100.0));
      CHECK(r.incremental);
      CHECK_EQ(r.links, step + 1);
      CHECK_EQ(r.rows, changed);
      CHECK_EQ(r.deletions, deleted);
      at_step.push_back(now);
      std::map<std::string, std::string> meta;
      auto loaded = LoadDir(chain, {}, &meta);
      CHECK(ContentsOf(*loaded) == now);
      CHECK(ContentsOf(*LoadDir(full)) == now);
      CHECK_EQ(meta["step"], std::to_string(step));
      CHECK_EQ(EmbeddingStore::ReadCheckpointMeta(chain)["step"], std::to_string(step));
    }
    // Every earlier point of the chain loads on request.
    for (int links = 1; links <= 7; ++links) {
      std::map<std::string, std::string> meta;
      auto t = LoadDir(chain, links, &meta);
      CHECK(ContentsOf(*t) == at_step[links - 1]);
      CHECK_EQ(meta["step"], std::to_string(links - 1));
    }
    CHECK(Contains(ErrorOf([&] { LoadDir(chain, 8); }), "chain_links"));
    CHECK(Contains(ErrorOf([&] { LoadDir(chain, 0); }), "chain_links"));
    // A weights-only load of the chain: the head's weights, every state initial.
    LoadOverrides wo;
    wo.weights_only = true;
    auto w = EmbeddingStore::Load(chain, wo, nullptr);
    CHECK_EQ(w->Size(), at_step.back().size());
  }
}

TEST_CASE(store_chain_compacts_every_k_increments_and_past_the_fraction) {
  TempDir dir;
  EmbeddingStore s(Options(OptimizerKind::kAdagrad));
  std::mt19937_64 rng(5);
  Changes ch;
  Mutate(s, rng, 1.0, &ch);
  Mutate(s, rng, 1.0, &ch);
  const std::string chain = dir.path + "/ck";
  std::vector<int> links;
  for (int step = 0; step < 9; ++step) {
    Changes c;
    // A small change each time: only full_every forces a base.
    std::vector<int64_t> k{step * 3, step * 3 + 1};
    std::vector<float> g(2 * kDim, 0.5f);
    s.ApplyGradients(k.data(), 2, g.data(), 0.1f, 1);
    const CheckpointResult r = s.Checkpoint(chain, step, {}, Policy(3, 100.0));
    links.push_back(r.links);
    CHECK_EQ(r.incremental, r.links > 1);
    if (r.links == 1) CHECK(!HasIncrementFiles(chain));  // the old links are gone
    CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
  }
  CHECK(links == (std::vector<int>{1, 2, 3, 4, 1, 2, 3, 4, 1}));

  // Past the fraction: a change of half the rows against a 10 % budget writes a base.
  EmbeddingStore t(Options(OptimizerKind::kAdagrad));
  std::vector<int64_t> keys(1000);
  for (int i = 0; i < 1000; ++i) keys[i] = i;
  std::vector<float> rows(1000 * kDim, 1.0f);
  t.Assign(keys.data(), 1000, rows.data());
  const std::string d2 = dir.path + "/frac";
  CHECK(!t.Checkpoint(d2, 0, {}, Policy(8, 0.1)).incremental);
  t.Assign(keys.data(), 50, rows.data());  // 5 % of the rows
  CheckpointResult r = t.Checkpoint(d2, 1, {}, Policy(8, 0.1));
  CHECK(r.incremental);
  CHECK(r.chain_bytes <= r.base_bytes / 10);
  t.Assign(keys.data(), 80, rows.data());  // 8 % more: the chain would pass 10 %
  r = t.Checkpoint(d2, 2, {}, Policy(8, 0.1));
  CHECK(!r.incremental);
  CHECK_EQ(r.rows, 1000u);
  CHECK(!HasIncrementFiles(d2));
  CHECK(ContentsOf(*LoadDir(d2)) == ContentsOf(t));
  // incremental = false: always a base.
  ChainPolicy off;
  off.incremental = false;
  t.Assign(keys.data(), 1, rows.data());
  CHECK(!t.Checkpoint(d2, 3, {}, off).incremental);
  // A bad policy is refused before anything is written.
  CHECK(Contains(ErrorOf([&] { t.Checkpoint(d2, 4, {}, Policy(0, 0.5)); }), "full_every"));
  CHECK(Contains(ErrorOf([&] { t.Checkpoint(d2, 4, {}, Policy(1, 0.0)); }), "chain_fraction"));
}

TEST_CASE(store_chain_torn_or_corrupt_increment_is_refused_previous_point_loads) {
  TempDir dir;
  EmbeddingStore s(Options(OptimizerKind::kAdagrad));
  std::mt19937_64 rng(9);
  Changes ch;
  Mutate(s, rng, 0.5, &ch);
  const std::string chain = dir.path + "/ck";
  s.Checkpoint(chain, 10, {{"step", "10"}}, Policy(8, 100.0));
  std::vector<Contents> points{ContentsOf(s)};
  for (int i = 1; i <= 2; ++i) {
    std::vector<int64_t> k{static_cast<int64_t>(i), 500 + static_cast<int64_t>(i)};
    std::vector<float> g(2 * kDim, 0.25f * i);
    s.ApplyGradients(k.data(), 2, g.data(), 0.1f, 1);
    CHECK(s.Checkpoint(chain, 10 + i, {{"step", std::to_string(10 + i)}}, Policy(8, 100.0))
              .incremental);
    points.push_back(ContentsOf(s));
  }
  const std::string good = chain + "-copy";
  CHECK(std::system(("cp -a '" + chain + "' '" + good + "'").c_str()) == 0);

  // Corrupt: one flipped byte in the last increment's state. Refused, naming the way back.
  std::string victim;
  for (const auto& n : Files(chain)) {
    if (n.rfind("inc-0002-state-", 0) == 0 && ReadFile(chain + "/" + n).size() > 0) victim = n;
  }
  CHECK(!victim.empty());
  {
    std::string bytes = ReadFile(chain + "/" + victim);
    bytes[bytes.size() / 2] ^= 0x10;
    // Unlink first: the file is a hard link shared with the copy above.
    unlink((chain + "/" + victim).c_str());
    WriteFile(chain + "/" + victim, bytes);
  }
  std::string e = ErrorOf([&] { LoadDir(chain); });
  CHECK(Contains(e, "checksum mismatch"));
  CHECK(Contains(e, "increment 2 (step 12)"));
  CHECK(Contains(e, "chain_links=2"));
  std::map<std::string, std::string> meta;
  CHECK(ContentsOf(*LoadDir(chain, 2, &meta)) == points[1]);
  CHECK_EQ(meta["step"], std::string("11"));

  // Torn: the first increment's rows cut short. Refused; the base alone loads.
  std::string rows_file;
  for (const auto& n : Files(chain)) {
    if (n.rfind("inc-0001-rows-", 0) == 0 && ReadFile(chain + "/" + n).size() > 0) rows_file = n;
  }
  CHECK(!rows_file.empty());
  const std::string cut = ReadFile(chain + "/" + rows_file);
  unlink((chain + "/" + rows_file).c_str());
  WriteFile(chain + "/" + rows_file, cut.substr(0, cut.size() - 4));
  e = ErrorOf([&] { LoadDir(chain); });
  CHECK(Contains(e, "torn checkpoint"));
  CHECK(Contains(e, "chain_links=1"));
  CHECK(ContentsOf(*LoadDir(chain, 1)) == points[0]);
  CHECK(ContentsOf(*LoadDir(good)) == points[2]);  // the copy never shared the damage

  // A writer that died mid-increment left its temp directory (hard links to the chain and
  // a partial link): the directory still holds the last complete point, and the next
  // checkpoint removes the leftovers without harming the linked files.
  const std::string base = good;
  const std::string stale = dir.path + "/.ck-copy.tmp-999999999-0";
  CHECK(mkdir(stale.c_str(), 0755) == 0);
  for (const auto& n : Files(base)) {
    if (n != "MANIFEST") CHECK(link((base + "/" + n).c_str(), (stale + "/" + n).c_str()) == 0);
  }
  WriteFile(stale + "/inc-0003-rows-0000.bin", "partial");
  auto t = LoadDir(base);
  CHECK(ContentsOf(*t) == points[2]);
  // The loaded store extends the chain (it holds all of it, with state).
  std::vector<int64_t> k{7};
  std::vector<float> g(kDim, 1.0f);
  t->ApplyGradients(k.data(), 1, g.data(), 0.1f, 1);
  const CheckpointResult r = t->Checkpoint(base, 13, {{"step", "13"}}, Policy(8, 100.0));
  CHECK(r.incremental);
  CHECK_EQ(r.links, 4);
  CHECK_EQ(r.rows, 1u);
  struct stat st;
  CHECK(stat(stale.c_str(), &st) != 0);  // removed by the save
  CHECK(ContentsOf(*LoadDir(base)) == ContentsOf(*t));
  CHECK(ContentsOf(*LoadDir(base, 3)) == points[2]);
}

TEST_CASE(store_chain_failed_checkpoint_keeps_the_changes_for_the_next) {
  TempDir dir;
  EmbeddingStore s(Options(OptimizerKind::kRowWiseAdagrad));
  std::mt19937_64 rng(13);
  Changes ch;
  Mutate(s, rng, 0.5, &ch);
  const std::string chain = dir.path + "/ck";
  s.Checkpoint(chain, 0, {}, Policy(8, 100.0));
  Mutate(s, rng, 0.1, &ch);
  Mutate(s, rng, 0.1, &ch);
  const int64_t dirty = s.Stats().dirty_rows;
  CHECK(dirty > 0);
  // Take a base file away: linking it into the new increment fails, nothing is committed.
  const std::string f = chain + "/keys-0000.bin", aside = dir.path + "/aside";
  CHECK(rename(f.c_str(), aside.c_str()) == 0);
  bool threw = false;
  try {
    s.Checkpoint(chain, 1, {}, Policy(8, 100.0));
  } catch (const std::exception&) {
    threw = true;
  }
  CHECK(threw);
  CHECK_EQ(s.Stats().dirty_rows, dirty);
  CHECK(rename(aside.c_str(), f.c_str()) == 0);
  Mutate(s, rng, 0.1, &ch);
  const CheckpointResult r = s.Checkpoint(chain, 2, {}, Policy(8, 100.0));
  CHECK(r.incremental);
  CHECK_EQ(r.links, 2);
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));

  // Another writer's checkpoint in the directory: the next one is a full base.
  EmbeddingStore other(Options(OptimizerKind::kRowWiseAdagrad));
  other.Save(chain, {}, false);
  Mutate(s, rng, 0.1, &ch);
  CHECK(!s.Checkpoint(chain, 3, {}, Policy(8, 100.0)).incremental);
  CHECK(ContentsOf(*LoadDir(chain)) == ContentsOf(s));
  // A step below the chain's last: a full base too.
  Mutate(s, rng, 0.1, &ch);
  CHECK(s.Checkpoint(chain, 4, {}, Policy(8, 100.0)).incremental);
  CHECK(!s.Checkpoint(chain, 1, {}, Policy(8, 100.0)).incremental);
}

TEST_CASE(store_chain_reads_version_2_manifests) {
  TempDir dir;
  EmbeddingStore s(Options(OptimizerKind::kAdagrad));
  std::mt19937_64 rng(21);
  Changes ch;
  Mutate(s, rng, 0.5, &ch);
  const std::string path = dir.path + "/v2";
  s.Save(path, {{"committed_step", "4"}}, false);
  // Rewrite the manifest as version 2 wrote it: no chain.
  Manifest m = CheckpointReader(path).manifest();
  m.version = 2;
  const std::string text = EncodeManifest(m);
  CHECK(!Contains(text, "\"chain\""));
  WriteFile(path + "/MANIFEST", text);
  std::map<std::string, std::string> meta;
  auto t = LoadDir(path, {}, &meta);
  CHECK(ContentsOf(*t) == ContentsOf(s));
  CHECK_EQ(meta["committed_step"], std::string("4"));
  CHECK_EQ(CheckpointReader(path).manifest().version, 2);
  CHECK(ContentsOf(*LoadDir(path, 1)) == ContentsOf(s));
  // A store loaded from a version 2 checkpoint starts its chain with a full base.
  CHECK(!t->Checkpoint(path, 5, {}, Policy(8, 100.0)).incremental);
  CHECK_EQ(CheckpointReader(path).manifest().version, kCheckpointVersion);
}

TEST_CASE(store_chain_manifest_round_trips_and_refuses_broken_links) {
  TempDir dir;
  EmbeddingStore s(Options(OptimizerKind::kSgd));  // no state: contents may read "weights"
  std::mt19937_64 rng(17);
  Changes ch;
  Mutate(s, rng, 0.5, &ch);
  const std::string path = dir.path + "/ck";
  s.Checkpoint(path, 1, {{"a", "1"}}, Policy(8, 100.0));
  Mutate(s, rng, 0.1, &ch);
  s.Checkpoint(path, 2, {{"a", "2"}}, Policy(8, 100.0));
  Mutate(s, rng, 0.1, &ch);
  s.Checkpoint(path, 2, {{"a", "3"}}, Policy(8, 100.0));  // the same step again is fine
  const Manifest m = CheckpointReader(path).manifest();
  CHECK_EQ(m.chain.increments.size(), 2u);
  CHECK_EQ(m.chain.base_step, 1);
  CHECK_EQ(m.chain.increments[1].step, 2);
  CHECK(m.chain.base_meta == (std::map<std::string, std::string>{{"a", "1"}}));
  CHECK(m.meta == (std::map<std::string, std::string>{{"a", "3"}}));
  const std::string text = EncodeManifest(m);
  CHECK_EQ(EncodeManifest(DecodeManifest(text, "x")), text);

  // A manifest edited with a valid checksum trailer: each broken link rule is refused.
  auto with_trailer = [](const std::string& body) {
    Checksum c;
    c.Update(body.data(), body.size());
    return body + "#xxh64 " + Checksum::Hex(c.Digest()) + "\n";
  };
  const std::string body = text.substr(0, text.rfind("#xxh64 "));
  auto refused = [&](const std::string& from, const std::string& to, const std::string& why) {
    std::string b = body;
    const size_t at = b.find(from);
    CHECK(at != std::string::npos);
    b.replace(at, from.size(), to);
    const std::string err = ErrorOf([&] { DecodeManifest(with_trailer(b), "ck/MANIFEST"); });
    if (!Contains(err, why)) throw bagpipe::testing::CheckFailure("'" + why + "' not in: " + err);
  };
  const std::string id = Checksum::Hex(m.chain.id);
  refused("\"parent\": \"" + id + ":1\"", "\"parent\": \"" + id + ":0\"", "previous link");
  refused("\"index\": 2", "\"index\": 3", "index");
  refused("\"step\": 2, \"rows\"", "\"step\": 0, \"rows\"", "below its parent");
  refused("inc-0002-deleted.bin", "inc-0001-deleted.bin", "a second time");
  refused("\"a\": \"3\"},\n  \"chain\"", "\"a\": \"9\"},\n  \"chain\"", "last link");
  refused("\"contents\": \"full\"", "\"contents\": \"weights\"", "weights-only");
}
