// Uses the C++ and C faces of an installed deferalloc on the host driver.
#include <deferalloc/deferalloc.h>
#include <deferalloc/deferalloc.hpp>

#include <cstdio>
#include <cstring>
#include <string>

namespace {
std::string g_logged;
void keep_log(int level, const char* message, void*) {
  if (level == 1) g_logged += message;
}
}  // namespace

int main() {
  auto ctx = deferalloc::context(deferalloc::parse_settings("driver:host,host_granularity_kb:64"));
  auto& m = *ctx.reservations;
  auto id = m.reserve(1 << 20);
  m.materialize(id, 0, deferalloc::whole, deferalloc::fill_mode::zero);
  std::memset(m.address(id), 7, 1 << 20);
  m.release(id, 0, deferalloc::whole, deferalloc::keep_mode::host);
  m.materialize(id, 0, deferalloc::whole, deferalloc::fill_mode::restore);
  const int ok = static_cast<unsigned char*>(m.address(id))[12345] == 7;
  m.free(id);
  dfa_reservation r = 0;
  if (dfa_init("driver:host") != DFA_SUCCESS || dfa_reserve(4096, &r, nullptr) != DFA_SUCCESS) {
    std::printf("consumer: C ABI failed: %s\n", dfa_last_error());
    return 1;
  }
  // The log callback gets the error of a free of a pointer deferalloc does not own.
  int buf = 0;
  const bool logged = dfa_set_log_callback(keep_log, nullptr, 2) == DFA_SUCCESS &&
                      (dfa_free(&buf, sizeof buf, 0, nullptr), g_logged.find("dfa_free") != std::string::npos) &&
                      dfa_set_log_callback(nullptr, nullptr, 0) == DFA_SUCCESS;
  dfa_shutdown();
  std::printf("consumer: %s%s\n", ok ? "ok" : "WRONG CONTENTS", logged ? "" : ", log callback got nothing");
  return ok && logged ? 0 : 1;
}
