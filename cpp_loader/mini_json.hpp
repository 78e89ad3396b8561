// A small JSON reader: enough for manifest.json (objects, arrays, strings, numbers, literals).
#pragma once
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mini_json {

// A manifest that cannot be read: not JSON, or a key missing (the loader's exit 2, a user error).
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  const Value& at(const std::string& key) const {
    auto it = object.find(key);
    if (kind != Object || it == object.end()) throw Error("manifest.json lacks \"" + key + "\"");
    return it->second;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}
  Value parse() {
    Value v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;
  // Each level of nesting is a frame of value(): a hostile manifest of "[[[[..." overflowed the stack.
  // A manifest nests five levels; Python's json stops near its recursion limit, 1000.
  static constexpr int kMaxDepth = 512;
  int depth_ = 0;

  [[noreturn]] void fail(const std::string& what) {
    throw Error("manifest.json is not valid JSON (" + what + " at byte " + std::to_string(i_) + ")");
  }
  void ws() { while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_; }
  char peek() { ws(); if (i_ >= s_.size()) fail("unexpected end"); return s_[i_]; }
  void expect(char c) { if (peek() != c) fail(std::string("expected '") + c + "'"); ++i_; }

  Value value() {
    if (++depth_ > kMaxDepth) fail("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    Value v = parse_value();
    --depth_;
    return v;
  }

  Value parse_value() {
    char c = peek();
    Value v;
    if (c == '{') {
      v.kind = Value::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      while (true) {
        std::string key = str();
        expect(':');
        v.object[key] = value();
        if (peek() == ',') { ++i_; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Value::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      while (true) {
        v.array.push_back(value());
        if (peek() == ',') { ++i_; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') { v.kind = Value::String; v.string = str(); return v; }
    if (s_.compare(i_, 4, "true") == 0) { i_ += 4; v.kind = Value::Bool; v.boolean = true; return v; }
    if (s_.compare(i_, 5, "false") == 0) { i_ += 5; v.kind = Value::Bool; return v; }
    if (s_.compare(i_, 4, "null") == 0) { i_ += 4; return v; }
    if (c == '-' || (c >= '0' && c <= '9')) {
      const char* begin = s_.c_str() + i_;
      char* end = nullptr;
      v.kind = Value::Number;
      v.number = std::strtod(begin, &end);
      i_ += static_cast<size_t>(end - begin);
      return v;
    }
    fail("unexpected character");
  }

  std::string str() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') { out += c; continue; }
      if (i_ >= s_.size()) fail("bad escape");
      char e = s_[i_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {  // keep ASCII, replace the rest: names in manifests are ASCII
          // four hex digits: std::stoul skips blanks and signs, and its own error says only "stoul"
          for (size_t k = i_; k < i_ + 4; ++k)
            if (k >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[k]))) fail("bad \\u escape");
          unsigned code = std::stoul(s_.substr(i_, 4), nullptr, 16);
          i_ += 4;
          out += code < 128 ? static_cast<char>(code) : '?';
          break;
        }
        default: out += e;
      }
    }
    expect('"');
    return out;
  }
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mini_json
