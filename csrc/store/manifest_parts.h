// The pieces of the MANIFEST text (manifest.h) that the base (manifest.cc) and the chain
// (manifest_chain.cc) share: file entries, segment lists and string maps, each written and
// read back field for field.
//
// Thread safety: pure functions on values (a Reader as in manifest_json.h).
//
// Invariants:
//   1. Decode* of Encode*'s text gives the value back; every error is a ValueError naming
//      the manifest field (manifest_json.h invariant 3).
#pragma once

#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "store/manifest.h"
#include "store/manifest_json.h"

namespace bagpipe::store::manifest_parts {

// {"file": ..., "bytes": ..., "xxh64": "<16 hex>"}, and back (a plain file name only).
void EncodeFile(std::ostringstream& os, const FileEntry& f);
FileEntry DecodeFile(const manifest_json::Reader& r);

// The segment array, one segment a line at `indent` spaces.
void EncodeSegments(std::ostringstream& os, const std::vector<SegmentEntry>& segs, int indent);
// The array `key` of r, checked against m's dim, state_dim and contents (manifest.h
// invariant 2). REQUIRES: m's head (dim, contents) and optimizer decoded.
std::vector<SegmentEntry> DecodeSegments(const manifest_json::Reader& r, const std::string& key,
                                         const Manifest& m);

// A JSON object of strings, and back (the object `key` of r; ValueError for a non-string).
void EncodeStringMap(std::ostringstream& os, const std::map<std::string, std::string>& map);
std::map<std::string, std::string> DecodeStringMap(const manifest_json::Reader& r,
                                                   const std::string& key);

// The "chain" object (manifest_chain.cc): written after "meta"; read into m->chain and
// checked (manifest.h invariant 3). A version 1/2 manifest has none: a base alone at step
// -1 with m->meta as its meta. REQUIRES (Decode): m fully decoded but for the chain.
void EncodeChain(std::ostringstream& os, const Manifest& m);
void DecodeChain(const manifest_json::Reader& r, Manifest* m);

}  // namespace bagpipe::store::manifest_parts
