// The file tier's home (file_home.cpp; Note [File tier] in store/file_store.cpp): made by
// make_home() from the settings of optimizer_config that it reads, and no others.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "home.hpp"

namespace deferalloc::optim {

/// The file tier's settings (optimizer_config's fields of the same names).
struct file_home_settings {
  std::string directory;  // holds this rank's state file
  int rank = 0;
  bool resume = false;
  int io_threads = 8;
  std::size_t io_request_bytes = std::size_t{8} << 20;
  moment_format moments = moment_format::fp32;
};

/// The file tier's home over `shards` (checks that `settings.directory` exists).
std::unique_ptr<home> make_file_home(vmm_ops& vmm, stream_ops& streams, const shard_table& shards,
                                     const file_home_settings& settings);

}  // namespace deferalloc::optim
