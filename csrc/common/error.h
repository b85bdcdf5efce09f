// Why a launcher did not launch: plain data, shared by every op's launchers (csrc/*/).
#pragma once

#include <cstring>
#include <string>

namespace fluxinductor {

// Plain data (no std::string crosses between the nvcc- and the host-compiled translation units).  Empty message =
// success.
struct Error {
  char message[384] = {0};
  bool failed() const { return message[0] != 0; }
};

// `message`, cut to what fits.
inline Error make_error(std::string const& message) {
  Error error;
  size_t const n = message.size() < sizeof(error.message) - 1 ? message.size() : sizeof(error.message) - 1;
  std::memcpy(error.message, message.data(), n);
  error.message[n] = 0;
  return error;
}

}  // namespace fluxinductor
