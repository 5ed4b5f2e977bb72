#include <string>

#include "common/errors.h"
#include "store/checksum.h"
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
  CHECK(d.optimizer == OptimizerSpec{});
  CHECK_EQ(d.version, kCheckpointVersion);
}

TEST_CASE(store_manifest_optimizer_spec_round_trips_bit_for_bit) {
  Manifest m = Sample();
  m.optimizer.kind = OptimizerKind::kAdam;
  m.optimizer.eps = 1e-300;  // below fp32 range: rounds to 0, still a valid spec
  m.optimizer.beta1 = 0.1 + 0.2;
  m.optimizer.beta2 = 0.9999999999999999;
  m.optimizer.weight_decay = 5e-324;
  m.optimizer.initial_accumulator_value = 0.7;
  m.state_dim = 2 * m.dim;
  for (auto& s : m.segments) {
    s.has_state = true;
    s.state = {"state-" + s.keys.file, s.count * 4 * 8, 1};  // names are unique
  }
  const Manifest d = DecodeManifest(EncodeManifest(m), "x");
  CHECK(d.optimizer == m.optimizer);
  CHECK_EQ(d.state_dim, 8);
}

TEST_CASE(store_manifest_reads_version_1_as_sgd) {
  // A version 1 manifest: the optimizer has a name and a state_dim, no *_bits fields (and,
  // as version 2, no chain).
  Manifest v2 = Sample();
  v2.version = 2;
  std::string text = EncodeManifest(v2);
  text = text.substr(0, text.rfind("#xxh64 "));
  auto cut = [&](const std::string& from, const std::string& to) {
    const size_t a = text.find(from);
    const size_t b = text.find(to, a);
    CHECK(a != std::string::npos && b != std::string::npos);
    text.erase(a, b - a);
  };
  cut(", \"eps_bits\"", "}");
  const size_t v = text.find("\"version\": 2");
  CHECK(v != std::string::npos);
  text.replace(v, 12, "\"version\": 1");
  auto sign = [](const std::string& body) {
    Checksum c;
    c.Update(body.data(), body.size());
    return body + "#xxh64 " + Checksum::Hex(c.Digest()) + "\n";
  };
  const Manifest d = DecodeManifest(sign(text), "v1");
  CHECK_EQ(d.version, 1);
  CHECK(d.optimizer == OptimizerSpec{});
  std::string adagrad = text;
  adagrad.replace(adagrad.find("\"sgd\""), 5, "\"adagrad\"");
  CHECK(Contains(ErrorOf(sign(adagrad)), "optimizer.name"));
}

TEST_CASE(store_manifest_refuses_torn_corrupt_and_unknown) {
  const std::string text = EncodeManifest(Sample());
  CHECK(Contains(ErrorOf(text.substr(0, text.size() / 2)), "torn or corrupt"));
  CHECK(Contains(ErrorOf(text.substr(0, text.size() - 1)), "torn or corrupt"));
  std::string flipped = text;
  flipped[20] = flipped[20] == 'a' ? 'b' : 'a';
  CHECK(Contains(ErrorOf(flipped), "checksum mismatch"));

  Manifest v4 = Sample();
  v4.version = kCheckpointVersion + 1;
  CHECK(Contains(ErrorOf(EncodeManifest(v4)), "unknown checkpoint version 4"));
  Manifest v0 = Sample();
  v0.version = 0;
  CHECK(Contains(ErrorOf(EncodeManifest(v0)), "unknown checkpoint version 0"));

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
  state.optimizer.kind = OptimizerKind::kRowWiseAdagrad;
  state.state_dim = 1;  // segments lack state files
  CHECK(Contains(ErrorOf(EncodeManifest(state)), "segments[0].state"));
  Manifest wrong_dim = Sample();
  wrong_dim.optimizer.kind = OptimizerKind::kAdagrad;
  wrong_dim.state_dim = 3;  // Adagrad keeps dim (4) floats
  CHECK(Contains(ErrorOf(EncodeManifest(wrong_dim)), "optimizer.state_dim"));
  Manifest bad_beta = Sample();
  bad_beta.optimizer.beta2 = 1.0;
  CHECK(Contains(ErrorOf(EncodeManifest(bad_beta)), "optimizer.beta2"));
  CHECK(Contains(ErrorOf("{}\n#xxh64 0000000000000000\n"), "checksum mismatch"));
}

TEST_CASE(store_manifest_weights_only_and_state_files) {
  Manifest m = Sample();
  m.optimizer.kind = OptimizerKind::kRowWiseAdagrad;
  m.state_dim = 1;
  for (auto& s : m.segments) {
    s.has_state = true;
    s.state = {"state-" + s.keys.file, s.count * 4, 1};
  }
  const Manifest d = DecodeManifest(EncodeManifest(m), "x");
  CHECK(d.segments[0].has_state);
  CHECK_EQ(d.segments[0].state.bytes, 12u);
  CHECK(d.optimizer.kind == OptimizerKind::kRowWiseAdagrad);
  Manifest w = Sample();
  w.weights_only = true;
  CHECK(DecodeManifest(EncodeManifest(w), "x").weights_only);
  // A weights-only checkpoint records its optimizer and state_dim, without state files.
  Manifest wa = m;
  wa.weights_only = true;
  for (auto& s : wa.segments) s.has_state = false;
  const Manifest dwa = DecodeManifest(EncodeManifest(wa), "x");
  CHECK(dwa.weights_only && dwa.state_dim == 1 && !dwa.segments[0].has_state);
  for (auto& s : wa.segments) s.has_state = true;
  CHECK(Contains(ErrorOf(EncodeManifest(wa)), "state"));
}
