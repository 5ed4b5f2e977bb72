#include <string>

#include "common/errors.h"
#include "store/manifest.h"
#include "tests/test_harness.h"

using namespace bagpipe::store;

static Manifest Sample() {
  Manifest m;
  m.dim = 4;
  m.init.kind = InitKind::kUniform;
  m.init.bound = 0.1f;
  m.init.seed = 0xFFFFFFFFFFFFFFFFULL;
  m.init.bound_starts = {-5, 10};
  m.init.bound_values = {0.5f, 1e-30f};
  m.key_bound = 1000;
  m.num_shards = 2;
  m.page_rows = 64;
  SegmentEntry s;
  s.count = 3;
  s.keys = {"keys-0000.bin", 24, 0x1234};
  s.rows = {"rows-0000.bin", 48, 0xabcdef0123456789ULL};
  m.segments.push_back(s);
  SegmentEntry empty;
  empty.keys = {"keys-0001.bin", 0, 7};
  empty.rows = {"rows-0001.bin", 0, 8};
  m.segments.push_back(empty);
  m.rows = 3;
  m.meta = {{"committed_step", "17"}, {"weird \"key\"\n", "tab\there\\ \x01 \xc3\xbc"}};
  return m;
}

static std::string ErrorOf(const std::string& text) {
  try {
    DecodeManifest(text, "ck/MANIFEST");
  } catch (const bagpipe::ValueError& e) {
    return e.what();
  }
  return "";
}

static bool Contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

TEST_CASE(store_manifest_round_trip) {
  const Manifest m = Sample();
  const Manifest d = DecodeManifest(EncodeManifest(m), "x");
  CHECK_EQ(d.dim, 4);
  CHECK(d.init == m.init);
  CHECK_EQ(d.key_bound, 1000);
  CHECK_EQ(d.num_shards, 2);
  CHECK_EQ(d.page_rows, 64u);
  CHECK_EQ(d.rows, 3u);
  CHECK_EQ(d.segments.size(), 2u);
  CHECK_EQ(d.segments[0].rows.xxh64, 0xabcdef0123456789ULL);
  CHECK_EQ(d.segments[0].keys.file, std::string("keys-0000.bin"));
  CHECK(d.meta == m.meta);
  CHECK(!d.weights_only);
  CHECK_EQ(d.optimizer, std::string("sgd"));
}

TEST_CASE(store_manifest_refuses_torn_corrupt_and_unknown) {
  const std::string text = EncodeManifest(Sample());
  CHECK(Contains(ErrorOf(text.substr(0, text.size() / 2)), "torn or corrupt"));
  CHECK(Contains(ErrorOf(text.substr(0, text.size() - 1)), "torn or corrupt"));
  std::string flipped = text;
  flipped[20] = flipped[20] == 'a' ? 'b' : 'a';
  CHECK(Contains(ErrorOf(flipped), "checksum mismatch"));

  Manifest v2 = Sample();
  v2.version = 2;
  CHECK(Contains(ErrorOf(EncodeManifest(v2)), "unknown checkpoint version 2"));

  Manifest bad_rows = Sample();
  bad_rows.rows = 4;
  CHECK(Contains(ErrorOf(EncodeManifest(bad_rows)), "'rows'"));

  Manifest bad_size = Sample();
  bad_size.segments[0].rows.bytes = 47;
  CHECK(Contains(ErrorOf(EncodeManifest(bad_size)), "segments[0].count"));

  Manifest bad_name = Sample();
  bad_name.segments[1].keys.file = "../etc/passwd";
  CHECK(Contains(ErrorOf(EncodeManifest(bad_name)), "plain file name"));

  Manifest bad_init = Sample();
  bad_init.init.bound_values = {0.5f, -1.0f};
  CHECK(Contains(ErrorOf(EncodeManifest(bad_init)), "'init'"));

  Manifest state = Sample();
  state.state_dim = 2;  // segments lack state files
  CHECK(Contains(ErrorOf(EncodeManifest(state)), "state"));
  CHECK(Contains(ErrorOf("{}\n#xxh64 0000000000000000\n"), "checksum mismatch"));
}

TEST_CASE(store_manifest_weights_only_and_state_files) {
  Manifest m = Sample();
  m.optimizer = "adagrad";
  m.state_dim = 1;
  for (auto& s : m.segments) {
    s.has_state = true;
    s.state = {"state.bin", s.count * 4, 1};
  }
  const Manifest d = DecodeManifest(EncodeManifest(m), "x");
  CHECK(d.segments[0].has_state);
  CHECK_EQ(d.segments[0].state.bytes, 12u);
  CHECK_EQ(d.optimizer, std::string("adagrad"));
  Manifest w = Sample();
  w.weights_only = true;
  CHECK(DecodeManifest(EncodeManifest(w), "x").weights_only);
}
