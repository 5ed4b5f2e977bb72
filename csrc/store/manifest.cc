#include "store/manifest.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

#include "common/errors.h"
#include "store/checksum.h"
#include "store/manifest_json.h"
#include "store/manifest_parts.h"

namespace bagpipe::store {

using manifest_json::Json;
using manifest_json::Quote;
using manifest_json::Reader;

namespace {

uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
std::string Readable(float f) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(f));
  return buf;
}
uint64_t DoubleBits(double d) {
  uint64_t b;
  std::memcpy(&b, &d, 8);
  return b;
}
double BitsDouble(uint64_t b) {
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}
std::string Readable(double d) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  return buf;
}

// The optimizer's double fields, in manifest order.
struct DoubleField {
  const char* name;
  double OptimizerSpec::*member;
};
constexpr DoubleField kOptimizerFields[] = {
    {"eps", &OptimizerSpec::eps},
    {"beta1", &OptimizerSpec::beta1},
    {"beta2", &OptimizerSpec::beta2},
    {"weight_decay", &OptimizerSpec::weight_decay},
    {"initial_accumulator_value", &OptimizerSpec::initial_accumulator_value},
};

const char* KindName(InitKind k) {
  switch (k) {
    case InitKind::kUniform: return "uniform";
    case InitKind::kZeros: return "zeros";
    case InitKind::kConstant: return "constant";
  }
  return "unknown";
}

}  // namespace

namespace manifest_parts {

void EncodeFile(std::ostringstream& os, const FileEntry& f) {
  os << "{\"file\": ";
  Quote(os, f.file);
  os << ", \"bytes\": " << f.bytes << ", \"xxh64\": \"" << Checksum::Hex(f.xxh64) << "\"}";
}

FileEntry DecodeFile(const Reader& r) {
  FileEntry f;
  f.file = r.Str("file");
  if (f.file.empty() || f.file.find('/') != std::string::npos || f.file[0] == '.') {
    r.Fail(r.Name("file"), "is not a plain file name");
  }
  f.bytes = r.UInt("bytes");
  f.xxh64 = r.Hex("xxh64");
  return f;
}

void EncodeSegments(std::ostringstream& os, const std::vector<SegmentEntry>& segs, int indent) {
  const std::string pad(static_cast<size_t>(indent), ' ');
  os << "[";
  for (size_t i = 0; i < segs.size(); ++i) {
    const SegmentEntry& s = segs[i];
    os << (i ? "," : "") << "\n" << pad << "  {\"count\": " << s.count << ", \"keys\": ";
    EncodeFile(os, s.keys);
    os << ", \"rows\": ";
    EncodeFile(os, s.rows);
    if (s.has_state) {
      os << ", \"state\": ";
      EncodeFile(os, s.state);
    }
    os << "}";
  }
  os << "\n" << pad << "]";
}

std::vector<SegmentEntry> DecodeSegments(const Reader& r, const std::string& key,
                                         const Manifest& m) {
  std::vector<SegmentEntry> out;
  const auto& segs = r.Arr(key);
  for (size_t i = 0; i < segs.size(); ++i) {
    const Reader s(segs[i], r.Name(key) + "[" + std::to_string(i) + "]", r.what());
    SegmentEntry e;
    e.count = s.UInt("count");
    e.keys = DecodeFile(s.Obj("keys"));
    e.rows = DecodeFile(s.Obj("rows"));
    if (s.Find("state") != nullptr) {
      e.has_state = true;
      e.state = DecodeFile(s.Obj("state"));
    }
    if (e.keys.bytes != e.count * 8 || e.rows.bytes != e.count * static_cast<uint64_t>(m.dim) * 4) {
      s.Fail(s.Name("count"), "disagrees with the file sizes");
    }
    if (e.has_state != (m.state_dim > 0 && !m.weights_only)) {
      s.Fail(s.Name("state"), "does not match optimizer.state_dim and contents");
    }
    if (e.has_state && e.state.bytes != e.count * static_cast<uint64_t>(m.state_dim) * 4) {
      s.Fail(s.Name("state.bytes"), "disagrees with count and state_dim");
    }
    out.push_back(std::move(e));
  }
  return out;
}

void EncodeStringMap(std::ostringstream& os, const std::map<std::string, std::string>& map) {
  os << "{";
  bool first = true;
  for (const auto& [k, v] : map) {
    os << (first ? "" : ", ");
    first = false;
    Quote(os, k);
    os << ": ";
    Quote(os, v);
  }
  os << "}";
}

std::map<std::string, std::string> DecodeStringMap(const Reader& r, const std::string& key) {
  std::map<std::string, std::string> out;
  for (const auto& [mk, mv] : r.Get(key, Json::kObject).fields) {
    if (mv.kind != Json::kString) r.Fail(r.Name(key) + "." + mk, "is not a string");
    out[mk] = mv.text;
  }
  return out;
}

}  // namespace manifest_parts

std::string LinkName(uint64_t id, uint32_t index) {
  return Checksum::Hex(id) + ":" + std::to_string(index);
}

uint64_t SegmentBytes(const std::vector<SegmentEntry>& segments) {
  uint64_t b = 0;
  for (const SegmentEntry& s : segments) b += s.keys.bytes + s.rows.bytes + s.state.bytes;
  return b;
}

uint64_t IncrementBytes(const IncrementEntry& inc) {
  return SegmentBytes(inc.segments) + inc.deletions.bytes;
}

std::string EncodeManifest(const Manifest& m) {
  std::ostringstream os;
  os << "{\n  \"format\": \"" << kCheckpointFormat << "\",\n  \"version\": " << m.version
     << ",\n  \"contents\": \"" << (m.weights_only ? "weights" : "full") << "\",\n  \"dim\": " << m.dim
     << ",\n  \"init\": {\"kind\": \"" << KindName(m.init.kind) << "\", \"seed\": " << m.init.seed
     << ", \"bound_bits\": " << FloatBits(m.init.bound) << ", \"bound\": \""
     << Readable(m.init.bound) << "\", \"value_bits\": " << FloatBits(m.init.value)
     << ", \"value\": \"" << Readable(m.init.value) << "\", \"bound_starts\": [";
  for (size_t i = 0; i < m.init.bound_starts.size(); ++i) {
    os << (i ? ", " : "") << m.init.bound_starts[i];
  }
  os << "], \"bound_value_bits\": [";
  for (size_t i = 0; i < m.init.bound_values.size(); ++i) {
    os << (i ? ", " : "") << FloatBits(m.init.bound_values[i]);
  }
  os << "]},\n  \"key_bound\": " << m.key_bound << ",\n  \"num_shards\": " << m.num_shards
     << ",\n  \"page_rows\": " << m.page_rows << ",\n  \"optimizer\": {\"name\": ";
  Quote(os, OptimizerKindName(m.optimizer.kind));
  os << ", \"state_dim\": " << m.state_dim;
  for (const DoubleField& f : kOptimizerFields) {
    const double v = m.optimizer.*f.member;
    os << ", \"" << f.name << "_bits\": " << DoubleBits(v) << ", \"" << f.name << "\": \""
       << Readable(v) << "\"";
  }
  os << "},\n  \"rows\": " << m.rows << ",\n  \"segments\": ";
  manifest_parts::EncodeSegments(os, m.segments, 2);
  os << ",\n  \"meta\": ";
  manifest_parts::EncodeStringMap(os, m.meta);
  if (m.version >= 3) {
    os << ",\n  \"chain\": ";
    manifest_parts::EncodeChain(os, m);
  }
  os << "\n}\n";
  const std::string body = os.str();
  Checksum c;
  c.Update(body.data(), body.size());
  return body + "#xxh64 " + Checksum::Hex(c.Digest()) + "\n";
}

namespace {

// The manifest's body, once its checksum trailer ("#xxh64 <16 hex>\n") matches it.
std::string VerifiedBody(const std::string& text, const std::string& what) {
  // Trailer first: a manifest cut short anywhere fails here.
  const std::string tag = "#xxh64 ";
  const size_t at = text.rfind(tag);
  if (at == std::string::npos || text.size() != at + tag.size() + 17 || text.back() != '\n') {
    throw ValueError(what + ": torn or corrupt checkpoint (the manifest has no checksum trailer)");
  }
  std::string body = text.substr(0, at);
  Checksum c;
  c.Update(body.data(), body.size());
  if (Checksum::Hex(c.Digest()) != text.substr(at + tag.size(), 16)) {
    throw ValueError(what + ": torn or corrupt checkpoint (manifest checksum mismatch)");
  }
  return body;
}

// format, version, contents and dim.
void DecodeHead(const Reader& r, Manifest* m) {
  const std::string& what = r.what();
  if (r.Str("format") != kCheckpointFormat) {
    throw ValueError(what + ": not an EmbeddingStore checkpoint (format '" + r.Str("format") + "')");
  }
  const int64_t version = r.Int("version");
  if (version < kOldestCheckpointVersion || version > kCheckpointVersion) {
    throw ValueError(what + ": unknown checkpoint version " + std::to_string(version) +
                     " (this build reads versions " + std::to_string(kOldestCheckpointVersion) +
                     " to " + std::to_string(kCheckpointVersion) + ")");
  }
  m->version = static_cast<int>(version);
  const std::string contents = r.Str("contents");
  if (contents != "full" && contents != "weights") r.Fail("contents", "is not 'full' or 'weights'");
  m->weights_only = contents == "weights";
  const int64_t dim = r.Int("dim");
  if (dim <= 0 || dim > (1 << 20)) r.Fail("dim", "is out of range");
  m->dim = static_cast<int>(dim);
}

// The "init" object: kind, seed, bound and value (as float bits), bound ranges.
InitSpec DecodeInit(const Reader& init) {
  InitSpec spec;
  const std::string kind = init.Str("kind");
  if (kind == "uniform") {
    spec.kind = InitKind::kUniform;
  } else if (kind == "zeros") {
    spec.kind = InitKind::kZeros;
  } else if (kind == "constant") {
    spec.kind = InitKind::kConstant;
  } else {
    init.Fail("init.kind", "is unknown ('" + kind + "')");
  }
  spec.seed = init.UInt("seed");
  const uint64_t bound_bits = init.UInt("bound_bits");
  const uint64_t value_bits = init.UInt("value_bits");
  if (bound_bits > 0xFFFFFFFFu || value_bits > 0xFFFFFFFFu) init.Fail("init", "has bad float bits");
  spec.bound = BitsFloat(static_cast<uint32_t>(bound_bits));
  spec.value = BitsFloat(static_cast<uint32_t>(value_bits));
  for (const Json& v : init.Arr("bound_starts")) {
    spec.bound_starts.push_back(init.ToInt(v, "init.bound_starts"));
  }
  for (const Json& v : init.Arr("bound_value_bits")) {
    const uint64_t b = init.ToUInt(v, "init.bound_value_bits");
    if (b > 0xFFFFFFFFu) init.Fail("init.bound_value_bits", "has bad float bits");
    spec.bound_values.push_back(BitsFloat(static_cast<uint32_t>(b)));
  }
  try {
    ValidateInitSpec(spec);
  } catch (const ValueError& e) {
    throw ValueError(init.what() + ": manifest field 'init' is invalid: " + e.what());
  }
  return spec;
}

// The "optimizer" object: name, constants (version >= 2, as double bits) and state_dim.
// REQUIRES: m->version and m->dim decoded.
void DecodeOptimizer(const Reader& opt, Manifest* m) {
  try {
    m->optimizer.kind = ParseOptimizerKind(opt.Str("name"));
  } catch (const ValueError& e) {
    opt.Fail("optimizer.name", std::string("is invalid: ") + e.what());
  }
  if (m->version >= 2) {
    for (const DoubleField& f : kOptimizerFields) {
      m->optimizer.*f.member = BitsDouble(opt.UInt(std::string(f.name) + "_bits"));
    }
  } else if (m->optimizer.kind != OptimizerKind::kSgd) {
    opt.Fail("optimizer.name", "is not 'sgd' in a version 1 checkpoint");
  }
  try {
    ValidateOptimizerSpec(m->optimizer);
  } catch (const ValueError& e) {
    throw ValueError(opt.what() + ": manifest field 'optimizer' is invalid: " + e.what());
  }
  const int64_t state_dim = opt.Int("state_dim");
  if (state_dim != StateDim(m->optimizer.kind, m->dim)) {
    opt.Fail("optimizer.state_dim", "does not fit the optimizer and dim");
  }
  m->state_dim = static_cast<int>(state_dim);
}

}  // namespace

Manifest DecodeManifest(const std::string& text, const std::string& what) {
  const std::string body = VerifiedBody(text, what);
  const Json doc = manifest_json::Parse(body, what);
  Reader r(doc, "", what);
  Manifest m;
  DecodeHead(r, &m);
  m.init = DecodeInit(r.Obj("init"));
  m.key_bound = r.Int("key_bound");
  const int64_t shards = r.Int("num_shards");
  if (shards < 1 || shards > 4096) r.Fail("num_shards", "is out of range");
  m.num_shards = static_cast<int>(shards);
  const uint64_t page_rows = r.UInt("page_rows");
  if (page_rows > (1u << 24)) r.Fail("page_rows", "is out of range");
  m.page_rows = static_cast<uint32_t>(page_rows);
  DecodeOptimizer(r.Obj("optimizer"), &m);
  m.rows = r.UInt("rows");
  m.segments = manifest_parts::DecodeSegments(r, "segments", m);
  uint64_t total = 0;
  for (const SegmentEntry& e : m.segments) total += e.count;
  if (total != m.rows) r.Fail("rows", "is not the sum of the segment counts");
  m.meta = manifest_parts::DecodeStringMap(r, "meta");
  manifest_parts::DecodeChain(r, &m);
  return m;
}

}  // namespace bagpipe::store
