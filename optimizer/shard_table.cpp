#include "shard_table.hpp"

namespace deferalloc::optim {

std::size_t shard_table::add(shard s) {
  infos_.reserve(infos_.size() + 1);  // both vectors grow, or neither
  shards_.push_back(std::move(s));
  infos_.push_back(shards_.back().info);
  return shards_.size() - 1;
}

void shard_table::mark_resident(std::size_t s) {
  shards_[s].resident = true;
  infos_[s].resident = true;
}

void shard_table::mark_speculative(std::size_t s) {
  if (!shards_[s].speculative) ++speculating_;
  shards_[s].speculative = true;
}

void shard_table::end_speculation() {
  for (auto& s : shards_) s.speculative = false;
  speculating_ = 0;
}

void shard_table::set_param(std::size_t s, void* param) {
  // Both copies of the pointer (and an FP32 parameter's main, itself), and nothing else:
  // infos_[s] also carries `resident`.
  auto* bf16 = shards_[s].info.param_type == value_type::bf16 ? static_cast<std::uint16_t*>(param) : nullptr;
  for (shard_info* info : {&shards_[s].info, &infos_[s]}) {
    info->param = param;
    info->param_bf16 = bf16;
    if (info->param_type == value_type::fp32) info->main_param = static_cast<float*>(param);  // its own main
  }
}

std::vector<std::uint64_t> shard_table::steps() const {
  std::vector<std::uint64_t> v;
  v.reserve(shards_.size());
  for (const auto& s : shards_) v.push_back(s.step);
  return v;
}

std::string shard_table::where(const piece_ref& p) const {
  return "shard " + std::to_string(p.shard) + " ('" + shards_[p.shard].info.name + "') elements [" + std::to_string(p.e0) +
         ", " + std::to_string(p.e0 + p.n) + ")";
}

}  // namespace deferalloc::optim
