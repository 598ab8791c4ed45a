// A log sink that tells whether a line was delivered while a lock of the library was
// held (Note [Logging outside locks] in allocator/core/log/log.hpp): for each line it
// runs `call` (a call that takes the lock under test) on another thread and waits for it
// up to two seconds; a line delivered under the lock blocks the call.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace dfa_test {

struct log_probe {
  explicit log_probe(std::function<void()> c) : call(std::move(c)) {}
  ~log_probe() {
    for (auto& t : threads) t.join();  // a blocked call ends once the lock is released
  }
  log_probe(const log_probe&) = delete;
  log_probe& operator=(const log_probe&) = delete;

  std::function<void()> call;
  std::vector<std::string> lines;    // every line at or below the sink's level
  std::vector<std::string> blocked;  // the lines during which `call` could not run
  std::vector<std::thread> threads;

  // The sink (dfa_log_fn / detail::log_sink signature).
  static void fn(int, const char* msg, void* user) {
    auto& p = *static_cast<log_probe*>(user);
    p.lines.emplace_back(msg);
    auto done = std::make_shared<std::atomic<bool>>(false);
    p.threads.emplace_back([call = p.call, done] {
      call();
      done->store(true);
    });
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!done->load() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!done->load()) p.blocked.emplace_back(msg);
  }
};

}  // namespace dfa_test
