#pragma once
// Errors and checks. Every validation in AutoAcc throws a subclass of acc::Error with the offending
// values in a lower-case message; checks stay on in release builds. Library code never calls
// exit/abort and never validates with assert.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace acc {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A bad argument or configuration value.
class ValueError : public Error {
  using Error::Error;
};
/// Tensor shapes that do not fit together.
class ShapeError : public Error {
  using Error::Error;
};
/// A dtype or device that an operation does not support.
class TypeError : public Error {
  using Error::Error;
};
/// Reading or writing a file failed, or a file is malformed.
class IoError : public Error {
  using Error::Error;
};
/// A collective or point-to-point operation failed.
class CommError : public Error {
  using Error::Error;
};
/// A collective did not complete within its timeout.
class TimeoutError : public Error {
  using Error::Error;
};
/// A checkpoint is missing, truncated, corrupted or belongs to another model.
class CheckpointError : public Error {
  using Error::Error;
};
/// An allocation that the system refused, or that would take the tracked tensor memory past the
/// budget set with acc::memory::set_limit (how a dry-run makes a memory budget real).
class OutOfMemoryError : public Error {
  using Error::Error;
};
/// A broken internal invariant: a bug in AutoAcc, not in the caller's input.
class InternalError : public Error {
  using Error::Error;
};

namespace detail {

template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

}  // namespace detail
}  // namespace acc

/// ACC_CHECK_AS(ExcType, cond, msg...): throw ExcType(msg...) unless cond holds.
#define ACC_CHECK_AS(Exc, cond, ...)                  \
  do {                                                \
    if (!(cond)) [[unlikely]] {                       \
      throw Exc(::acc::detail::str_cat(__VA_ARGS__)); \
    }                                                 \
  } while (0)

#define ACC_CHECK(cond, ...) ACC_CHECK_AS(::acc::ValueError, cond, __VA_ARGS__)
#define ACC_CHECK_SHAPE(cond, ...) ACC_CHECK_AS(::acc::ShapeError, cond, __VA_ARGS__)
#define ACC_CHECK_TYPE(cond, ...) ACC_CHECK_AS(::acc::TypeError, cond, __VA_ARGS__)
#define ACC_CHECK_INTERNAL(cond, ...) ACC_CHECK_AS(::acc::InternalError, cond, __VA_ARGS__)
#define ACC_THROW(Exc, ...) throw Exc(::acc::detail::str_cat(__VA_ARGS__))
