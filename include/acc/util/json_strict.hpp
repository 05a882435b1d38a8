#pragma once
// The strict JSON reader behind acc::parse_json and the safetensors header: nlohmann's SAX parser
// with a DOM builder of our own, which refuses a repeated object key at any depth and nesting
// deeper than a limit, and says where (an RFC 6901 pointer).
//
// Why not nlohmann::json::parse(text, callback): its callback parser scans the enclosing container
// for discarded values each time an object ends, so an array of n objects costs n^2 (400,000 `{}`
// in a strategy file took 55 s, 200,000 in a checkpoint's metadata.json 11 s). This builder
// appends each value once: linear in the text (tests/util/json_test.cpp,
// ParseJson.TimeIsLinearInTheNumberOfObjects).

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace acc::detail {

/// What the caller is told of a refused document; it words (and throws) its own error. Each
/// function must throw.
struct StrictJsonSink {
  virtual ~StrictJsonSink() = default;
  /// nlohmann's message for a syntax error or trailing text (with line and column).
  virtual void syntax_error(const std::string& what) = 0;
  /// `key` repeats in the object at `pointer` ("" at the top); `depth` 1 is the top-level object.
  virtual void duplicate_key(const std::string& key, const std::string& pointer, size_t depth) = 0;
  /// A container opens deeper than `limit`, inside the one at `pointer`.
  virtual void too_deep(const std::string& pointer, size_t limit) = 0;
};

namespace strict_json {

template <class Json>
class Builder {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  Builder(size_t max_depth, StrictJsonSink& sink) : max_depth_(max_depth), sink_(sink) {}

  bool null() { return put(Json(nullptr)); }
  bool boolean(bool v) { return put(Json(v)); }
  bool number_integer(number_integer_t v) { return put(Json(v)); }
  bool number_unsigned(number_unsigned_t v) { return put(Json(v)); }
  bool number_float(number_float_t v, const string_t& /*text*/) { return put(Json(v)); }
  bool string(string_t& v) { return put(Json(std::move(v))); }
  bool binary(binary_t& v) { return put(Json::binary(std::move(v))); }

  bool start_object(size_t /*len*/) { return open(Json::object(), false); }
  bool start_array(size_t /*len*/) { return open(Json::array(), true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(string_t& k) {
    Frame& f = frames_.back();
    if (!f.keys.insert(k).second) sink_.duplicate_key(k, pointer(), frames_.size());
    f.key = k;
    return true;
  }

  bool parse_error(size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& e) {
    sink_.syntax_error(e.what());
    return false;
  }

  Json take() { return std::move(root_); }

 private:
  struct Frame {
    Json* value = nullptr;
    bool is_array = false;
    size_t index = 0;                      // arrays: the element being read
    std::unordered_set<std::string> keys;  // objects: keys so far
    std::string key;                       // objects: the member being read
  };

  // The pointer of the innermost open container: each enclosing container's member or index.
  std::string pointer() const {
    std::string out;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      out += '/';
      if (f.is_array) {
        out += std::to_string(f.index);
        continue;
      }
      for (char c : f.key) {
        if (c == '~') {
          out += "~0";
        } else if (c == '/') {
          out += "~1";
        } else {
          out += c;
        }
      }
    }
    return out;
  }

  // Appends `v` to the open container (or makes it the document); returns where it went. A
  // container that is open is the last one appended to its parent, so the parent's storage does
  // not move while a Frame points into it.
  Json* place(Json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.is_array) {
      auto& arr = f.value->template get_ref<typename Json::array_t&>();
      arr.push_back(std::move(v));
      return &arr.back();
    }
    return &append(f.value->template get_ref<typename Json::object_t&>(), f.key, std::move(v));
  }

  // The key is new (key() checked), so append without the container's own lookup: an
  // ordered_json object looks a key up linearly, which would make a large object quadratic.
  template <class Object>
  static Json& append(Object& obj, const std::string& key, Json&& v) {
    if constexpr (requires { typename Object::Container; }) {
      return obj.Object::Container::emplace_back(key, std::move(v)).second;
    } else {
      return obj.emplace(key, std::move(v)).first->second;
    }
  }

  void element_done() {
    if (!frames_.empty() && frames_.back().is_array) ++frames_.back().index;
  }

  bool put(Json&& v) {
    place(std::move(v));
    element_done();
    return true;
  }

  bool open(Json&& container, bool is_array) {
    if (frames_.size() >= max_depth_) sink_.too_deep(pointer(), max_depth_);
    Frame f;
    f.value = place(std::move(container));
    f.is_array = is_array;
    frames_.push_back(std::move(f));
    return true;
  }

  bool close() {
    frames_.pop_back();
    element_done();
    return true;
  }

  size_t max_depth_;
  StrictJsonSink& sink_;
  Json root_;
  std::vector<Frame> frames_;
};

}  // namespace strict_json

/// Parses `text` as one JSON value into a `Json` (nlohmann::json or ordered_json), linear in the
/// text. A syntax error or trailing text, a repeated key and nesting deeper than `max_depth` go
/// to `sink`, which throws.
template <class Json>
Json parse_strict_json(const std::string& text, size_t max_depth, StrictJsonSink& sink) {
  strict_json::Builder<Json> builder(max_depth, sink);
  Json::sax_parse(text, &builder, nlohmann::detail::input_format_t::json, /*strict=*/true);
  return builder.take();
}

}  // namespace acc::detail
