// The "chain" object of a version 3 MANIFEST (manifest.h): the base link and the increment
// links, written and read back field for field, and checked (manifest.h invariant 3).
#include <set>
#include <sstream>
#include <string>

#include "common/errors.h"
#include "store/checksum.h"
#include "store/manifest.h"
#include "store/manifest_json.h"
#include "store/manifest_parts.h"

namespace bagpipe::store::manifest_parts {

using manifest_json::Json;
using manifest_json::Quote;
using manifest_json::Reader;

void EncodeChain(std::ostringstream& os, const Manifest& m) {
  const ChainEntry& c = m.chain;
  os << "{\"id\": \"" << Checksum::Hex(c.id) << "\",\n    \"base\": {\"link\": ";
  Quote(os, LinkName(c.id, 0));
  // A base alone is the whole checkpoint: its meta is the manifest's.
  os << ", \"step\": " << c.base_step << ", \"meta\": ";
  EncodeStringMap(os, c.increments.empty() ? m.meta : c.base_meta);
  os << "},\n    \"increments\": [";
  for (size_t i = 0; i < c.increments.size(); ++i) {
    const IncrementEntry& inc = c.increments[i];
    os << (i ? "," : "") << "\n      {\"index\": " << inc.index << ", \"link\": ";
    Quote(os, LinkName(c.id, inc.index));
    os << ", \"parent\": ";
    Quote(os, LinkName(c.id, inc.index - 1));
    os << ", \"step\": " << inc.step << ", \"rows\": " << inc.rows
       << ", \"total_rows\": " << inc.total_rows << ",\n       \"deletions\": {\"count\": "
       << inc.deletion_count << ", \"file\": ";
    EncodeFile(os, inc.deletions);
    os << "},\n       \"segments\": ";
    EncodeSegments(os, inc.segments, 7);
    os << ",\n       \"meta\": ";
    EncodeStringMap(os, inc.meta);
    os << "}";
  }
  os << "\n    ]}";
}

namespace {

// Every data file of the manifest is named once (a file shared by two links would be read
// twice, or overwritten by a later link).
void CheckUniqueFiles(const Reader& r, const Manifest& m) {
  std::set<std::string> names;
  auto add = [&](const FileEntry& f, const std::string& where) {
    if (!names.insert(f.file).second) {
      r.Fail(where, "names the data file '" + f.file + "' a second time");
    }
  };
  auto add_segments = [&](const std::vector<SegmentEntry>& segs, const std::string& where) {
    for (const SegmentEntry& s : segs) {
      add(s.keys, where);
      add(s.rows, where);
      if (s.has_state) add(s.state, where);
    }
  };
  add_segments(m.segments, "segments");
  for (size_t i = 0; i < m.chain.increments.size(); ++i) {
    const std::string where = "chain.increments[" + std::to_string(i) + "]";
    add(m.chain.increments[i].deletions, where + ".deletions");
    add_segments(m.chain.increments[i].segments, where + ".segments");
  }
}

}  // namespace

void DecodeChain(const Reader& r, Manifest* m) {
  if (m->version < 3) {
    if (r.Find("chain") != nullptr) r.Fail("chain", "is not expected before version 3");
    m->chain = ChainEntry{};
    m->chain.base_meta = m->meta;
    return;
  }
  const Reader c = r.Obj("chain");
  ChainEntry& chain = m->chain;
  chain.id = c.Hex("id");
  const Reader base = c.Obj("base");
  if (base.Str("link") != LinkName(chain.id, 0)) base.Fail(base.Name("link"), "is not '<id>:0'");
  chain.base_step = base.Int("step");
  chain.base_meta = DecodeStringMap(base, "meta");
  const auto& incs = c.Arr("increments");
  if (!incs.empty() && m->weights_only) {
    c.Fail(c.Name("increments"), "are not allowed in a weights-only checkpoint");
  }
  int64_t parent_step = chain.base_step;
  for (size_t i = 0; i < incs.size(); ++i) {
    const Reader x(incs[i], c.Name("increments") + "[" + std::to_string(i) + "]", r.what());
    IncrementEntry inc;
    const uint64_t index = x.UInt("index");
    if (index != i + 1) x.Fail(x.Name("index"), "is not " + std::to_string(i + 1));
    inc.index = static_cast<uint32_t>(index);
    if (x.Str("link") != LinkName(chain.id, inc.index)) {
      x.Fail(x.Name("link"), "is not '" + LinkName(chain.id, inc.index) + "'");
    }
    if (x.Str("parent") != LinkName(chain.id, inc.index - 1)) {
      x.Fail(x.Name("parent"), "does not name the previous link '" +
                                   LinkName(chain.id, inc.index - 1) + "'");
    }
    inc.step = x.Int("step");
    if (inc.step < parent_step) x.Fail(x.Name("step"), "is below its parent's step");
    parent_step = inc.step;
    inc.rows = x.UInt("rows");
    inc.total_rows = x.UInt("total_rows");
    const Reader del = x.Obj("deletions");
    inc.deletion_count = del.UInt("count");
    inc.deletions = DecodeFile(del.Obj("file"));
    if (inc.deletions.bytes != inc.deletion_count * 8) {
      del.Fail(del.Name("count"), "disagrees with the file size");
    }
    inc.segments = DecodeSegments(x, "segments", *m);
    uint64_t total = 0;
    for (const SegmentEntry& s : inc.segments) total += s.count;
    if (total != inc.rows) x.Fail(x.Name("rows"), "is not the sum of the segment counts");
    inc.meta = DecodeStringMap(x, "meta");
    chain.increments.push_back(std::move(inc));
  }
  const auto& head_meta = chain.increments.empty() ? chain.base_meta : chain.increments.back().meta;
  if (head_meta != m->meta) r.Fail("meta", "is not the meta of the chain's last link");
  CheckUniqueFiles(r, *m);
}

}  // namespace bagpipe::store::manifest_parts
