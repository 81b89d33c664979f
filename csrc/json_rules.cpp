// A fast first look at JSON text for recckpt's metadata rules (recckpt/format/checked_json.py): nesting
// depth, integers of too many digits, \u escapes of UTF-16 surrogates that are not a high-low pair
// (which decode to text that is not Unicode), and keys that appear twice in one object. Conservative: it
// answers "follows the rules" only when they surely hold; otherwise the Python walk (check_tree) or the
// decoder's key check looks again and words the problem. A metadata file of a thousand tables is one pass
// here instead of a Python call per value (json.loads then needs no Python hook per object either).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "pybuf.h"

namespace py = pybind11;

namespace recckpt {
namespace {

int hex_value(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The code unit of "\uXXXX" at p (p[0] == '\\'), or -1 if p does not start one.
int32_t escaped_unit(const unsigned char* p, const unsigned char* end) {
  if (end - p < 6 || p[0] != '\\' || p[1] != 'u') return -1;
  int32_t v = 0;
  for (int i = 2; i < 6; i++) {
    const int h = hex_value(p[i]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

// The keys of the objects open at the current point of the text, raw (as they stand between their
// quotes): a key with an escape is not compared raw ("a" and "\u0061" are one key), so it makes the
// verdict "keys unknown", as does a text with more keys open at once than `max_open` (memory stays
// bounded; the decoder's hook then checks them).
class OpenKeys {
 public:
  explicit OpenKeys(size_t max_open) : max_open_(max_open) {}
  void open(bool object) {
    if (!unknown_) frames_.push_back({object, keys_.size()});
  }
  bool in_object() const { return !unknown_ && !frames_.empty() && frames_.back().object; }
  void add(std::string_view key) {
    if (unknown_) return;
    if (keys_.size() >= max_open_) {
      give_up();
      return;
    }
    keys_.push_back(key);
  }
  // Closes the innermost open value; false if there is none (the text is not JSON: the decoder says so).
  bool close() {
    if (unknown_) return true;   // nothing is tracked any more
    if (frames_.empty()) return false;
    const Frame f = frames_.back();
    frames_.pop_back();
    if (f.object && keys_.size() - f.first > 1) {
      // sorted, duplicates are neighbours: O(k log k) whatever keys a hostile text chose
      std::sort(keys_.begin() + (std::ptrdiff_t)f.first, keys_.end());
      if (std::adjacent_find(keys_.begin() + (std::ptrdiff_t)f.first, keys_.end()) != keys_.end()) {
        give_up();
        return true;
      }
    }
    keys_.resize(f.first);
    return true;
  }
  void give_up() {  // and let go of what was held: memory stays bounded by what was open then
    unknown_ = true;
    std::vector<Frame>().swap(frames_);
    std::vector<std::string_view>().swap(keys_);
  }
  bool unknown() const { return unknown_; }

 private:
  struct Frame {
    bool object;
    size_t first;  // its first key in keys_
  };
  std::vector<Frame> frames_;
  std::vector<std::string_view> keys_;
  size_t max_open_;
  bool unknown_ = false;
};

}  // namespace

enum class RulesVerdict : int {
  kFollows = 0,      // every rule surely holds
  kLookCloser = 1,   // depth, digits or text may break a rule
  kKeysUnknown = 2,  // the rest holds; keys may repeat
};

RulesVerdict json_rules_verdict(const unsigned char* p, size_t n, int64_t max_depth, int64_t max_digits,
                                size_t max_open_keys) {
  const unsigned char* end = p + n;
  int64_t depth = 0, digits = 0;
  OpenKeys keys(max_open_keys);
  bool expect_key = false;  // the next string is an object's key
  while (p < end) {
    const unsigned char c = *p++;
    if (c >= '0' && c <= '9') {
      if (++digits > max_digits) return RulesVerdict::kLookCloser;
      continue;
    }
    digits = 0;
    if (c == '[' || c == '{') {
      if (++depth > max_depth) return RulesVerdict::kLookCloser;
      keys.open(c == '{');
      expect_key = c == '{';
    } else if (c == ']' || c == '}') {
      if (--depth < 0) return RulesVerdict::kKeysUnknown;  // more closed than opened: not JSON (the decoder says so)
      if (!keys.close()) keys.give_up();
      expect_key = false;
    } else if (c == ',') {
      expect_key = keys.in_object();
    } else if (c == '"') {
      const unsigned char* s = p;
      bool escaped = false;
      while (p < end && *p != '"') {
        if (*p >= 0x80) return RulesVerdict::kLookCloser;  // raw non-ASCII text: the walk checks it
        if (*p != '\\') {
          p++;
          continue;
        }
        escaped = true;
        const int32_t u = escaped_unit(p, end);
        if (u < 0) {  // any other escape: two characters
          p += 2;
          continue;
        }
        p += 6;
        if (u >= 0xDC00 && u <= 0xDFFF) return RulesVerdict::kLookCloser;  // a low surrogate with no high one before it
        if (u >= 0xD800 && u <= 0xDBFF) {
          const int32_t low = escaped_unit(p, end);
          if (low < 0xDC00 || low > 0xDFFF) return RulesVerdict::kLookCloser;  // a high surrogate alone
          p += 6;
        }
      }
      if (expect_key) {
        if (escaped) {
          keys.give_up();
        } else {
          keys.add(std::string_view(reinterpret_cast<const char*>(s), (size_t)(p - s)));
        }
        expect_key = false;
      }
      p++;  // the closing quote
    }
  }
  return keys.unknown() ? RulesVerdict::kKeysUnknown : RulesVerdict::kFollows;
}

}  // namespace recckpt

namespace {

// A str's UTF-8 form (for ASCII text, metadata, its own characters: no copy) or a buffer's bytes; the
// verdict is taken without the GIL.
constexpr size_t kMaxOpenKeys = size_t(1) << 20;   // 16 MiB of key views at most

recckpt::RulesVerdict verdict_of(const py::object& text, int64_t max_depth, int64_t max_digits,
                                 size_t max_open_keys = kMaxOpenKeys) {
  if (PyUnicode_Check(text.ptr())) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
    if (p == nullptr) {  // not encodable (a lone surrogate in the str itself): look closer
      PyErr_Clear();
      return recckpt::RulesVerdict::kLookCloser;
    }
    py::gil_scoped_release nogil;
    return recckpt::json_rules_verdict(reinterpret_cast<const unsigned char*>(p), (size_t)n, max_depth, max_digits,
                                       max_open_keys);
  }
  py::buffer_info b = recckpt::byte_view(text, "json_rules_verdict: text");
  const auto* p = static_cast<const unsigned char*>(b.ptr);
  const size_t n = (size_t)recckpt::nbytes(b);
  py::gil_scoped_release nogil;
  return recckpt::json_rules_verdict(p, n, max_depth, max_digits, max_open_keys);
}

}  // namespace

void bind_json_rules(py::module_& m) {
  m.attr("JSON_FOLLOWS") = (int)recckpt::RulesVerdict::kFollows;
  m.attr("JSON_LOOK_CLOSER") = (int)recckpt::RulesVerdict::kLookCloser;
  m.attr("JSON_KEYS_UNKNOWN") = (int)recckpt::RulesVerdict::kKeysUnknown;
  m.def(
      "json_rules_verdict",
      [](const py::object& text, int64_t max_depth, int64_t max_digits, int64_t max_open_keys) {
        if (max_open_keys < 0) throw py::value_error("json_rules_verdict: max_open_keys must be >= 0");
        return (int)verdict_of(text, max_depth, max_digits, (size_t)max_open_keys);
      },
      py::arg("text"), py::arg("max_depth"), py::arg("max_digits"), py::arg("max_open_keys") = (int64_t)kMaxOpenKeys,
      "JSON_FOLLOWS when the JSON text (a str, or UTF-8 bytes) surely nests at most max_depth deep, has no run "
      "of more than max_digits digits outside strings, no raw non-ASCII byte in a string, no \\u escape of a "
      "lone surrogate and no key twice in one object; JSON_LOOK_CLOSER where one of the first four may not "
      "hold (checked_json.check_tree decides); JSON_KEYS_UNKNOWN where only the keys may repeat (a key twice, "
      "a key with an escape, or more than max_open_keys keys open at once: the decoder's key check decides)");
  m.def(
      "json_follows_rules",
      [](const py::object& text, int64_t max_depth, int64_t max_digits) {
        return verdict_of(text, max_depth, max_digits) != recckpt::RulesVerdict::kLookCloser;
      },
      py::arg("text"), py::arg("max_depth"), py::arg("max_digits"),
      "json_rules_verdict without the key check: True unless it says JSON_LOOK_CLOSER");
}
