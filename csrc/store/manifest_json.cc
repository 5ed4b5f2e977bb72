#include "store/manifest_json.h"

#include <cstdio>
#include <cstring>
#include <string>

namespace bagpipe::store::manifest_json {
namespace {

class Parser {
 public:
  Parser(const std::string& s, const std::string& what) : s_(s), what_(what) {}

  Json ParseDocument() {
    Json v = ParseValue(0);
    SkipSpace();
    if (pos_ != s_.size()) Fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& why) {
    throw ValueError(what_ + ": malformed manifest (" + why + " at byte " + std::to_string(pos_) +
                     ")");
  }
  void SkipSpace() {
    while (pos_ < s_.size() && std::strchr(" \t\r\n", s_[pos_]) != nullptr) ++pos_;
  }
  char Peek() {
    SkipSpace();
    if (pos_ >= s_.size()) Fail("unexpected end");
    return s_[pos_];
  }
  void Expect(char c) {
    if (Peek() != c) Fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  Json ParseValue(int depth) {
    if (depth > 32) Fail("nesting too deep");
    const char c = Peek();
    Json v;
    if (c == '{') {
      v.kind = Json::kObject;
      ++pos_;
      if (Peek() == '}') {
        ++pos_;
        return v;
      }
      for (;;) {
        if (Peek() != '"') Fail("expected a key");
        std::string key = ParseString();
        Expect(':');
        v.fields.emplace_back(std::move(key), ParseValue(depth + 1));
        if (Peek() == ',') {
          ++pos_;
          continue;
        }
        Expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++pos_;
      if (Peek() == ']') {
        ++pos_;
        return v;
      }
      for (;;) {
        v.items.push_back(ParseValue(depth + 1));
        if (Peek() == ',') {
          ++pos_;
          continue;
        }
        Expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::kString;
      v.text = ParseString();
      return v;
    }
    if (s_.compare(pos_, 4, "true") == 0 || s_.compare(pos_, 5, "false") == 0) {
      v.kind = Json::kBool;
      v.boolean = s_[pos_] == 't';
      pos_ += v.boolean ? 4 : 5;
      return v;
    }
    if (s_.compare(pos_, 4, "null") == 0) {
      pos_ += 4;
      return v;
    }
    const size_t start = pos_;
    while (pos_ < s_.size() && std::strchr("+-0123456789.eE", s_[pos_]) != nullptr) ++pos_;
    if (pos_ == start) Fail("unexpected character");
    v.kind = Json::kNumber;
    v.text = s_.substr(start, pos_ - start);
    return v;
  }
  std::string ParseString() {
    Expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) Fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) Fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          if (pos_ + 4 > s_.size()) Fail("short \\u escape");
          const unsigned long cp = std::stoul(s_.substr(pos_, 4), nullptr, 16);
          pos_ += 4;
          if (cp > 0xFF) Fail("\\u escape above 0xFF (the writer escapes bytes only)");
          out.push_back(static_cast<char>(cp));
          break;
        }
        default:
          Fail("bad escape");
      }
    }
  }

  const std::string& s_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

Json Parse(const std::string& text, const std::string& what) {
  return Parser(text, what).ParseDocument();
}

// Strings are byte strings: control bytes and '"' '\\' are escaped, other bytes (UTF-8
// included) pass through unchanged.
void Quote(std::ostringstream& os, const std::string& s) {
  os << '"';
  for (unsigned char c : s) {
    if (c == '"') {
      os << "\\\"";
    } else if (c == '\\') {
      os << "\\\\";
    } else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      os << buf;
    } else {
      os << c;
    }
  }
  os << '"';
}

}  // namespace bagpipe::store::manifest_json
