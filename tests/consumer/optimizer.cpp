// deferalloc::optimizer from an installed tree: one streamed AdamW step on the host driver.
#include <deferalloc/deferalloc.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <cstdint>
#include <cstdio>

int main() {
  using namespace deferalloc;
  context ctx(parse_settings("driver:host,host_granularity_kb:64"));
  auto& m = *ctx.reservations;
  const std::size_t n = 1 << 16;
  const auto params = m.reserve(n * 2), grads = m.reserve(n * 2);
  m.materialize(params, 0, whole, fill_mode::zero);
  m.materialize(grads, 0, whole, fill_mode::zero);
  auto* p = static_cast<std::uint16_t*>(m.address(params));
  auto* g = static_cast<std::uint16_t*>(m.address(grads));
  for (std::size_t i = 0; i < n; ++i) p[i] = g[i] = 0x3F80;  // BF16 1.0
  optim::optimizer_config cfg;
  cfg.home = optim::tier::host;
  cfg.adamw.lr = 0.1f;
  cfg.adamw.weight_decay = 0.0f;
  optim::streamed_adamw opt(ctx.drv, cfg);
  opt.add_shard(p, n, "w");
  opt.initialize();
  const void* gp[] = {g};
  opt.step(gp, optim::grad_type::bf16);
  // Adam's first step moves every weight by lr against the gradient's sign: 1.0 -> 0.9,
  // BF16 0x3F66.
  const bool ok = p[0] == 0x3F66 && p[n - 1] == 0x3F66;
  std::printf("consumer_optimizer: %s (param 0x%04x)\n", ok ? "ok" : "WRONG STEP", p[0]);
  return ok ? 0 : 1;
}
