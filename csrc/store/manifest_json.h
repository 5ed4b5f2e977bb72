// The manifest's JSON (manifest.h): a value type, a strict parser of what EncodeManifest
// writes, field access whose errors name the manifest field, and the writer's quoting.
//
// Thread safety: plain values and pure functions; a Reader refers to the Json and the
// `what` string it was made from, which must outlive it.
// Invariants:
//   1. Numbers stay text: Reader reads integers exactly, never through a double.
//   2. Strings are byte strings: Quote escapes '"', '\\' and control bytes (\u00XX), every
//      other byte passes through; Parse takes JSON's escapes (\u only up to 0xFF), so a
//      quoted string parses back to itself.
//   3. Every error is a ValueError that starts with `what` (e.g. the manifest's path).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/errors.h"

namespace bagpipe::store::manifest_json {

// A JSON value: objects (fields in document order), arrays, strings, numbers kept as text,
// booleans.
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  std::string text;  // number literal or string contents
  bool boolean = false;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;
};

// Parses a whole document; ValueError "<what>: malformed manifest (<why> at byte <n>)".
Json Parse(const std::string& text, const std::string& what);

// Strings are byte strings: control bytes and '"' '\\' are escaped, other bytes (UTF-8
// included) pass through unchanged.
void Quote(std::ostringstream& os, const std::string& s);

// Field access with errors that name the field ("<what>: manifest field '<path.key>' <why>").
class Reader {
 public:
  // The object `obj` at `path` ("" for the document). ValueError unless obj is an object.
  Reader(const Json& obj, std::string path, const std::string& what)
      : obj_(obj), path_(std::move(path)), what_(what) {
    if (obj_.kind != Json::kObject) Fail(path_, "is not an object");
  }
  // Throws the ValueError naming `field`.
  [[noreturn]] void Fail(const std::string& field, const std::string& why) const {
    throw ValueError(what_ + ": manifest field '" + field + "' " + why);
  }
  // The field `key` (the first of that name), or nullptr.
  const Json* Find(const std::string& key) const {
    for (const auto& [k, v] : obj_.fields) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  // The field `key` of `kind`; ValueError if it is missing or of another kind.
  const Json& Get(const std::string& key, Json::Kind kind) const {
    const Json* v = Find(key);
    if (v == nullptr) Fail(Name(key), "is missing");
    if (v->kind != kind) Fail(Name(key), "has the wrong type");
    return *v;
  }
  // The field's name in messages: path.key.
  std::string Name(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }
  // Typed fields (ValueError naming the field when missing, mistyped or out of range): a
  // 64-bit integer, an unsigned one, a string, 16 lowercase hex digits, an object, an array.
  int64_t Int(const std::string& key) const { return ToInt(Get(key, Json::kNumber), Name(key)); }
  uint64_t UInt(const std::string& key) const {
    return ToUInt(Get(key, Json::kNumber), Name(key));
  }
  std::string Str(const std::string& key) const { return Get(key, Json::kString).text; }
  uint64_t Hex(const std::string& key) const {
    const std::string t = Str(key);
    if (t.size() != 16 || t.find_first_not_of("0123456789abcdef") != std::string::npos) {
      Fail(Name(key), "is not 16 hex digits");
    }
    return std::stoull(t, nullptr, 16);
  }
  Reader Obj(const std::string& key) const {
    return Reader(Get(key, Json::kObject), Name(key), what_);
  }
  const std::vector<Json>& Arr(const std::string& key) const {
    return Get(key, Json::kArray).items;
  }
  // What errors start with.
  const std::string& what() const { return what_; }

  // An array element as a 64-bit integer / unsigned integer (ValueError naming `name`).
  int64_t ToInt(const Json& v, const std::string& name) const {
    if (v.kind != Json::kNumber) Fail(name, "is not a number");
    try {
      size_t used = 0;
      const long long x = std::stoll(v.text, &used);
      if (used != v.text.size()) Fail(name, "is not an integer");
      return x;
    } catch (const std::logic_error&) {
      Fail(name, "is not a 64-bit integer");
    }
  }
  uint64_t ToUInt(const Json& v, const std::string& name) const {
    if (v.kind != Json::kNumber || v.text.empty() || v.text[0] == '-') {
      Fail(name, "is not unsigned");
    }
    try {
      size_t used = 0;
      const unsigned long long x = std::stoull(v.text, &used);
      if (used != v.text.size()) Fail(name, "is not an integer");
      return x;
    } catch (const std::logic_error&) {
      Fail(name, "is not a 64-bit unsigned integer");
    }
  }

 private:
  const Json& obj_;
  std::string path_;
  const std::string& what_;
};

}  // namespace bagpipe::store::manifest_json
