// A LibTorch data-parallel trainer on deferalloc's distributed optimizer.
//
//   torchrun --nproc-per-node=N --no-python ./trainer --state-tier host --steps 20
//
// A small causal transformer language model (torch::nn) in BF16 trains on synthetic
// tokens (fixed seed: every run sees the same global batches).  Its BF16 parameters and
// gradients are views of two flat buffers allocated from deferalloc (tag "train"); the
// FP32 main params and Adam moments of this rank's shard are deferred and streamed by
// dist::distributed_adamw (--state-tier device|host|file).  Rendezvous: torchrun's
// environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and PyTorch's
// c10d TCPStore, through which rank 0 hands out the ncclUniqueId.  Without a GPU it runs
// at world size 1 on the host driver (CPU tensors), which is how CI smoke-tests it.
//
// Output: a progress line per step (loss, tokens/s, HBM in use and peak), and a final
// "RESULT" line per rank; --dump writes the whole BF16 model (rank 0) for comparisons.
#include <deferalloc/deferalloc.h>
#include <deferalloc/distributed/distributed.hpp>
#include <deferalloc/torch/torch.hpp>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

namespace dist = deferalloc::dist;
namespace optim = deferalloc::optim;

namespace {

struct options {
  std::string tier = "host", state_dir = "/tmp", save, resume, dump, nccl_buffers = "registered";
  int steps = 20, save_at = -1, pause_at = -1, accum = 1, layers = 4, seq = 128, batch = 16;
  int64_t vocab = 4096, d_model = 512;
  double window_mb = 80, lr = 1e-3, max_grad_norm = 1.0;
  uint64_t seed = 1234;
};

options parse(int argc, char** argv) {
  options o;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || i + 1 >= argc) throw std::invalid_argument("bad argument '" + a + "' (--key value)");
    kv[a.substr(2)] = argv[++i];
  }
  auto take = [&](const char* k, auto& v) {
    auto it = kv.find(k);
    if (it == kv.end()) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string>) v = it->second;
    else if constexpr (std::is_floating_point_v<std::decay_t<decltype(v)>>) v = std::stod(it->second);
    else v = static_cast<std::decay_t<decltype(v)>>(std::stoll(it->second));
    kv.erase(it);
  };
  take("state-tier", o.tier), take("state-dir", o.state_dir), take("save", o.save), take("resume", o.resume);
  take("dump", o.dump), take("nccl-buffers", o.nccl_buffers), take("steps", o.steps), take("save-at", o.save_at);
  take("pause-at", o.pause_at), take("accum", o.accum), take("layers", o.layers), take("seq", o.seq);
  take("batch", o.batch), take("vocab", o.vocab), take("d-model", o.d_model), take("window-mb", o.window_mb);
  take("lr", o.lr), take("max-grad-norm", o.max_grad_norm), take("seed", o.seed);
  if (!kv.empty()) throw std::invalid_argument("unknown option --" + kv.begin()->first);
  return o;
}

int env_int(const char* k, int def) {
  const char* v = std::getenv(k);
  return v && *v ? std::atoi(v) : def;
}

// ---- the model ---------------------------------------------------------------------
struct block_impl : torch::nn::Module {
  block_impl(int64_t d, int64_t heads) : h(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1), D = x.size(2), dh = D / h;
    auto q = qkv(ln1(x)).view({B, T, 3, h, dh}).permute({2, 0, 3, 1, 4});  // 3, B, h, T, dh
    auto s = torch::matmul(q[0], q[1].transpose(-2, -1)).to(torch::kFloat) / std::sqrt(double(dh));
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    auto a = torch::softmax(s.masked_fill(mask, -1e30), -1).to(x.scalar_type());
    auto y = torch::matmul(a, q[2]).permute({0, 2, 1, 3}).reshape({B, T, D});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t h;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE_IMPL(block, block_impl);

struct lm_impl : torch::nn::Module {
  lm_impl(int64_t vocab, int64_t d, int layers) {
    emb = register_module("emb", torch::nn::Embedding(vocab, d));
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), block(d, 8)));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, vocab).bias(false)));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = emb(tokens);
    for (auto& b : blocks) x = b(x);
    return head(ln(x));
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<block> blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE_IMPL(lm, lm_impl);

// Global batch of step `t`: B sequences of T+1 tokens; each next token follows
// (3 * prev + 1) mod V with probability 7/8, so the loss has something to learn.
torch::Tensor global_batch(const options& o, int t) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003ULL + static_cast<uint64_t>(t));
  auto rnd = at::randint(o.vocab, {o.batch, o.seq + 1}, g, torch::TensorOptions().dtype(torch::kLong));
  auto keep = at::randint(8, {o.batch, o.seq + 1}, g, torch::TensorOptions().dtype(torch::kLong)) != 0;
  auto acc = rnd.accessor<int64_t, 2>();
  auto kp = keep.accessor<bool, 2>();
  for (int64_t b = 0; b < o.batch; ++b)
    for (int64_t i = 1; i <= o.seq; ++i)
      if (kp[b][i]) acc[b][i] = (3 * acc[b][i - 1] + 1) % o.vocab;
  return rnd;
}

void check(dfa_status s, const char* what) {
  if (s != DFA_SUCCESS) throw std::runtime_error(std::string(what) + ": " + dfa_last_error());
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1), local = env_int("LOCAL_RANK", 0);
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const bool gpu = torch::cuda::is_available();
  if (!gpu && world > 1) {
    std::fprintf(stderr, "SKIPPED: world size %d needs GPUs (none visible)\n", world);
    return 77;
  }
  if (!gpu) setenv("DEFERALLOC_CONF", "driver:host", 0);
  torch::Device dev = gpu ? torch::Device(torch::kCUDA, local) : torch::Device(torch::kCPU);
  if (gpu) {
    c10::cuda::set_device(local);
    deferalloc::torch::install();  // before any CUDA tensor: the whole trainer on deferalloc
  }
  at::globalContext().setDeterministicAlgorithms(true, false);
  at::globalContext().setAllowTF32CuBLAS(false);
  auto drv = gpu ? deferalloc::make_cuda_driver(local) : deferalloc::make_host_driver();

  // Rendezvous: rank 0 makes the NCCL id, the others read it from the TCPStore.
  std::shared_ptr<dist::communicator> comm;
  if (world > 1) {
    const char* addr = std::getenv("MASTER_ADDR");
    const int port = env_int("MASTER_PORT", 29500);
    // Under torchrun the agent already serves a TCPStore at MASTER_ADDR:MASTER_PORT.
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = agent && std::string(agent) == "True";
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = !agent_store && rank == 0;
    if (so.isServer) so.numWorkers = world;
    so.timeout = std::chrono::seconds(300);
    c10d::TCPStore store(addr ? addr : "127.0.0.1", so);
    const std::string key = "deferalloc/nccl_id/" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0));
    dist::unique_id id{};
    if (rank == 0) {
      id = dist::nccl_unique_id();
      store.set(key, std::vector<uint8_t>(id.begin(), id.end()));
    } else {
      auto v = store.get(key);
      if (v.size() != id.size()) throw std::runtime_error("rendezvous: bad ncclUniqueId in the store");
      std::copy(v.begin(), v.end(), id.begin());
    }
    comm = dist::make_nccl_communicator(drv, id, world, rank);
    store.add("deferalloc/joined", 1);
  } else {
    comm = dist::make_local_communicator(drv);
  }

  // The model: FP32 init from the seed on the CPU, then BF16 views of one flat buffer.
  torch::manual_seed(o.seed);
  lm model(o.vocab, o.d_model, o.layers);
  auto params = model->parameters();
  std::size_t numel = 0;
  for (auto& p : params) numel += static_cast<std::size_t>(p.numel());
  const auto lay = dist::distributed_adamw::layout_for(numel, *comm);
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(dev);
  if (gpu) check(dfa_tag_begin("train"), "dfa_tag_begin");
  auto flat = torch::zeros({static_cast<int64_t>(lay.padded_numel)}, bf16);
  auto gflat = torch::zeros({static_cast<int64_t>(lay.padded_numel)}, bf16);
  {
    torch::NoGradGuard ng;
    int64_t off = 0;
    for (auto& p : params) {
      auto view = flat.narrow(0, off, p.numel()).view(p.sizes());
      view.copy_(p.detach().to(bf16));
      p.set_data(view);
      p.mutable_grad() = gflat.narrow(0, off, p.numel()).view(p.sizes());
      off += p.numel();
    }
  }
  if (gpu) check(dfa_tag_end(), "dfa_tag_end");
  if (o.nccl_buffers == "resident" && gpu) {
    check(dfa_set_resident(flat.data_ptr(), 1), "dfa_set_resident(params)");
    check(dfa_set_resident(gflat.data_ptr(), 1), "dfa_set_resident(grads)");
  }
  void* stream = gpu ? static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()) : nullptr;
  const deferalloc::stream_t typed_stream{stream};  // the same stream for the C++ API

  std::size_t hbm_peak = 0, hbm_now = 0;
  auto sample = [&] {
    if (!gpu) return;
    auto m = drv->get_memory_info();
    hbm_now = m.total_bytes - m.free_bytes;
    hbm_peak = std::max(hbm_peak, hbm_now);
  };
  dist::dist_config cfg;
  cfg.optimizer.home = optim::parse_tier(o.tier);
  cfg.optimizer.directory = o.state_dir;
  cfg.optimizer.window_bytes = static_cast<std::size_t>(o.window_mb * (1 << 20));
  cfg.optimizer.adamw = {static_cast<float>(o.lr), 0.9f, 0.95f, 1e-8f, 0.1f};
  cfg.optimizer.on_progress = [&](const optim::progress&) { sample(); };
  cfg.max_grad_norm = static_cast<float>(o.max_grad_norm);
  cfg.register_buffers = o.nccl_buffers != "none";
  dist::distributed_adamw opt(drv, comm, numel, static_cast<std::uint16_t*>(flat.data_ptr()), gflat.data_ptr(), cfg);
  if (!o.resume.empty()) {
    opt.load_checkpoint(o.resume, typed_stream);
  } else {
    opt.initialize(typed_stream);
  }
  if (rank == 0)
    std::printf("trainer: world %d, %zu params (shard %zu, padded %zu), tier %s, window %.0f MiB, comm %s, nccl buffers %s\n",
                world, numel, lay.shard, lay.padded_numel, o.tier.c_str(), o.window_mb, comm->name().c_str(),
                o.nccl_buffers.c_str());

  const int per_rank = o.batch / world, micro = per_rank / o.accum;
  if (per_rank * world != o.batch || micro * o.accum != per_rank)
    throw std::invalid_argument("--batch must be divisible by world size * --accum");
  double last_loss = 0;
  for (int t = static_cast<int>(opt.steps()); t < o.steps; ++t) {
    auto t0 = std::chrono::steady_clock::now();
    auto batch = global_batch(o, t).narrow(0, rank * per_rank, per_rank).to(dev);
    gflat.zero_();
    double loss_sum = 0;
    for (int a = 0; a < o.accum; ++a) {
      auto mb = batch.narrow(0, a * micro, micro);
      auto logits = model->forward(mb.narrow(1, 0, o.seq));
      auto loss = torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, o.vocab}),
                                                       mb.narrow(1, 1, o.seq).reshape({-1})) /
                  o.accum;
      loss.backward();
      loss_sum += loss.item<double>();
      sample();
    }
    auto r = opt.step(typed_stream);
    if (gpu) c10::cuda::getCurrentCUDAStream().synchronize();
    sample();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last_loss = loss_sum;
    if (rank == 0)
      std::printf("step %4d  loss %.5f  tokens/s %9.0f  hbm %7.1f MiB  peak %7.1f MiB  grad_norm %.4f  "
                  "(reduce %.1f ms, step %.1f ms)\n",
                  t + 1, loss_sum, double(o.batch) * o.seq / sec, hbm_now / 1048576.0, hbm_peak / 1048576.0, r.grad_norm,
                  r.seconds_reduce * 1e3, r.seconds_step * 1e3);
    std::fflush(stdout);
    if (t + 1 == o.save_at && !o.save.empty()) {
      opt.save_checkpoint(o.save);
      if (rank == 0) std::printf("saved checkpoint at step %d to %s\n", t + 1, o.save.c_str());
    }
    if (t + 1 == o.pause_at && gpu) {
      // What an RL framework does around a rollout: the training memory goes away.
      const bool reg = opt.buffers_registered() && o.nccl_buffers == "registered";
      if (reg) opt.deregister_buffers();  // before the physical memory is released
      check(dfa_tag_pause("train", DFA_KEEP_HOST, stream), "dfa_tag_pause");
      auto m = drv->get_memory_info();
      const double paused = (m.total_bytes - m.free_bytes) / 1048576.0;
      check(dfa_tag_resume("train", stream), "dfa_tag_resume");
      c10::cuda::getCurrentCUDAStream().synchronize();
      if (reg) opt.register_buffers();  // after it is back
      if (rank == 0)
        std::printf("paused/resumed tag 'train' after step %d: hbm %.1f MiB while paused, buffers %s\n", t + 1, paused,
                    o.nccl_buffers.c_str());
    }
  }
  if (gpu) c10::cuda::getCurrentCUDAStream().synchronize();
  std::printf("RESULT rank %d world %d tier %s steps %llu hbm_peak %zu shard %zu window %zu loss %.6f\n", rank, world,
              o.tier.c_str(), static_cast<unsigned long long>(opt.steps()), hbm_peak, lay.shard,
              cfg.optimizer.window_bytes, last_loss);
  if (!o.dump.empty() && rank == 0) {
    auto host = flat.narrow(0, 0, static_cast<int64_t>(numel)).to(torch::kCPU).contiguous();
    std::ofstream f(o.dump, std::ios::binary | std::ios::trunc);
    f.write(static_cast<const char*>(host.data_ptr()), static_cast<std::streamsize>(numel * 2));
    if (!f) throw std::runtime_error("cannot write " + o.dump);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "trainer: %s\n", e.what());
  return 1;
}
