// The C++ LibTorch trainer of the acceptance test: the loop of train.py op for op
// (same weights from the CPU generator, AdamW written as tensor ops), losses printed in
// hex.  `trainer install` calls deferalloc::torch::install() first; `trainer native`
// uses PyTorch's allocator.  Exit 77 without a GPU.
#include <deferalloc/deferalloc.h>
#include <deferalloc/torch/torch.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "native";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 60;
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  if (!torch::cuda::is_available()) {
    std::printf("SKIPPED: no GPU\n");
    return 77;
  }
  if (mode == "install") deferalloc::torch::install();
  at::globalContext().setDeterministicAlgorithms(true, false);
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  const int64_t d_in = 256, d_hid = 512, d_out = 64, batch = 128;
  const double lr = 1e-3, b1c = 0.9, b2c = 0.999, eps = 1e-8, wd = 1e-2;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const auto cuda = torch::Device(torch::kCUDA);
  auto randn = [&](std::vector<int64_t> s) { return at::randn(s, gen, at::TensorOptions().dtype(at::kFloat)); };
  auto w1 = (randn({d_hid, d_in}) * 0.05).to(cuda).requires_grad_();
  auto b1 = torch::zeros({d_hid}).to(cuda).requires_grad_();
  auto w2 = (randn({d_out, d_hid}) * 0.05).to(cuda).requires_grad_();
  auto b2 = torch::zeros({d_out}).to(cuda).requires_grad_();
  std::vector<torch::Tensor> params{w1, b1, w2, b2}, m, v;
  for (auto& p : params) {
    m.push_back(torch::zeros_like(p));
    v.push_back(torch::zeros_like(p));
  }
  auto x = randn({steps, batch, d_in}).to(cuda);
  auto y = randn({steps, batch, d_out}).to(cuda);
  std::vector<double> losses;
  for (int step = 1; step <= steps; ++step) {
    auto h = torch::relu(torch::nn::functional::linear(x[step - 1], w1, b1));
    auto out = torch::nn::functional::linear(h, w2, b2);
    auto loss = torch::nn::functional::mse_loss(out, y[step - 1]);
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    loss.backward();
    {
      torch::NoGradGuard ng;
      const double c1 = 1.0 - std::pow(b1c, step), c2 = 1.0 - std::pow(b2c, step);
      for (size_t i = 0; i < params.size(); ++i) {
        auto& p = params[i];
        m[i].mul_(b1c).add_(p.grad(), 1.0 - b1c);
        v[i].mul_(b2c).addcmul_(p.grad(), p.grad(), 1.0 - b2c);
        p.mul_(1.0 - lr * wd);
        auto denom = (v[i] / c2).sqrt_().add_(eps);
        p.addcdiv_(m[i] / c1, denom, -lr);
      }
    }
    losses.push_back(loss.item<float>());
  }
  dfa_reservation r = 0;
  // dfa_find names only reservations of dfa_reserve; a block of deferalloc's caching
  // allocator is refused with a message that says so.
  const bool ours = dfa_find(w1.data_ptr(), &r) == DFA_SUCCESS ||
                    std::string(dfa_last_error()).find("caching allocator") != std::string::npos;
  if (ours != (mode == "install")) {
    std::printf("FAIL: mode %s: the weights' memory %s a deferalloc reservation\n", mode.c_str(), ours ? "is" : "is not");
    return 1;
  }
  for (double l : losses) std::printf("%a\n", l);
  return 0;
}
