// The process the kill tests kill.
//   durability_child STATE_DIR CHECKPOINT_DIR STEPS EVERY OUT
// A file-tier run of the durability model that resumes from its state file when there
// is one, saves a checkpoint every `every` steps, and at the end writes its state to `out`.
//   durability_child load STATE_DIR SOURCE ck|sd [CRASH_AT_WRITE]
// Resumes the file tier from STATE_DIR and loads new state into it: ck, the checkpoint
// directory SOURCE (load_checkpoint); sd, the state (write_state's format, arrays and
// per-shard step counts) in file SOURCE as load_state_dict does (one state write:
// write_state_range per array, set_shard_step per shard); sdi, the same without
// begin/end_state_write (the destructor publishes the implicit write).  CRASH_AT_WRITE: the nth
// write request of the file tier exits the process at once (0: the commit).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "durability_model.hpp"

using namespace dfa_test::durability;
namespace optim = deferalloc::optim;

static int load(int argc, char** argv) {
  model m(host(), config(optim::tier::file, argv[2], true));
  if (!m.opt->resumed()) return 4;
  if (argc == 6) {
    const std::uint64_t n = std::strtoull(argv[5], nullptr, 10);
    optim::detail::inject_file_fault(*m.opt, n == 0 ? optim::detail::file_fault_op::commit : optim::detail::file_fault_op::write,
                                     optim::detail::file_fault_kind::crash, n == 0 ? 1 : n);
  }
  const std::string kind = argv[4];
  if (kind == "ck") {
    m.opt->load_checkpoint(argv[3]);
    return 0;
  }
  state st;
  const bool explicit_write = kind == "sd";
  if ((kind != "sd" && kind != "sdi") || !read_state(argv[3], st)) return 5;
  const auto sizes = shard_sizes();
  if (explicit_write) m.opt->begin_state_write();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const float* f = reinterpret_cast<const float*>(st.bytes[i].data());
    for (int a = 0; a < 3; ++a)
      m.opt->write_state_range(i, static_cast<optim::state_array>(a), 0, sizes[i], f + a * sizes[i]);
    std::uint64_t step = 0;
    std::memcpy(&step, st.bytes[i].data() + sizes[i] * 14, 8);
    m.opt->set_shard_step(i, step);
  }
  if (explicit_write) m.opt->end_state_write();
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 5 && std::strcmp(argv[1], "load") == 0) try {
      return load(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "durability_child: %s\n", e.what());
      return 1;
    }
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s STATE_DIR CHECKPOINT_DIR STEPS EVERY OUT\n", argv[0]);
    return 2;
  }
  try {
    const std::uint64_t steps = std::strtoull(argv[3], nullptr, 10), every = std::strtoull(argv[4], nullptr, 10);
    model m(host(),
            config(deferalloc::optim::tier::file, argv[1], true));
    if (m.opt->resumed()) m.opt->sync_model_params();
    else m.opt->initialize();
    for (std::uint64_t t = m.opt->steps(); t < steps; ++t) {
      m.step(t);
      if ((t + 1) % every == 0) m.opt->save_checkpoint(argv[2]);
    }
    const std::string out = argv[5], tmp = out + ".tmp";
    if (!write_state(tmp, m.snapshot()) || std::rename(tmp.c_str(), out.c_str()) != 0) return 3;
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "durability_child: %s\n", e.what());
    return 1;
  }
}
