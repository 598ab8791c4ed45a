// The process the kill test kills: a file-tier run of the durability model that resumes
// from its state file when there is one, saves a checkpoint every `every` steps, and at
// the end writes its state to `out`.
//   durability_child STATE_DIR CHECKPOINT_DIR STEPS EVERY OUT
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "durability_model.hpp"

using namespace dfa_test::durability;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s STATE_DIR CHECKPOINT_DIR STEPS EVERY OUT\n", argv[0]);
    return 2;
  }
  try {
    const std::uint64_t steps = std::strtoull(argv[3], nullptr, 10), every = std::strtoull(argv[4], nullptr, 10);
    model m(deferalloc::make_host_driver({64 << 10, std::size_t{1} << 30}),
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
