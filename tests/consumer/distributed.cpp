// deferalloc::distributed from an installed tree: a world of one (local communicator)
// on the host driver takes one step.
#include <deferalloc/deferalloc.hpp>
#include <deferalloc/distributed/distributed.hpp>

#include <cstdint>
#include <cstdio>

int main() {
  using namespace deferalloc;
  context ctx(parse_settings("driver:host,host_granularity_kb:64"));
  auto& m = *ctx.reservations;
  auto comm = dist::make_local_communicator(ctx.drv);
  const auto lay = dist::distributed_adamw::layout_for(5000, *comm);
  const auto params = m.reserve(lay.padded_numel * 2), grads = m.reserve(lay.padded_numel * 2);
  m.materialize(params, 0, whole, fill_mode::zero);
  m.materialize(grads, 0, whole, fill_mode::zero);
  auto* p = static_cast<std::uint16_t*>(m.address(params));
  auto* g = static_cast<std::uint16_t*>(m.address(grads));
  for (std::size_t i = 0; i < lay.numel; ++i) p[i] = g[i] = 0x3F80;  // BF16 1.0
  dist::dist_config cfg;
  cfg.optimizer.adamw.lr = 0.1f;
  cfg.optimizer.adamw.weight_decay = 0.0f;
  dist::distributed_adamw opt(ctx.drv, comm, lay.numel, p, g, cfg);
  opt.initialize();
  opt.step();
  const bool ok = p[0] == 0x3F66 && p[lay.numel - 1] == 0x3F66 && p[lay.numel] == 0;
  std::printf("consumer_distributed: %s (param 0x%04x, world %d)\n", ok ? "ok" : "WRONG STEP", p[0], lay.world);
  return ok ? 0 : 1;
}
