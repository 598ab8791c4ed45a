// Note [VMM cost probe]: where the time of a discard pause/resume of many VMM segments goes.
// Rationale: the preload library backs each of PyTorch's caching-allocator segments with its own
// reservation and mapping, so a pause with discard is N x (cuMemUnmap + cuMemRelease) and a
// resume N x (cuMemCreate + cuMemMap + cuMemSetAccess).  Before that layout is redesigned (one
// large reservation carved into segments, fewer and larger handles, one call over many mappings)
// the driver's own costs must be known: per call or per byte, and which calls may span mappings.
// Approach: CUDA driver API only, no project library, nothing copied or touched (the figures are
// the driver's alone).  For each configuration "T = N x S" and each repetition (the first one a
// warm-up, medians of the rest), with cuCtxSynchronize before and after each timed step:
//   seg  N reservations of S, each step a loop over the N: cuMemCreate, cuMemMap, cuMemSetAccess,
//        cuMemUnmap, cuMemRelease (today's layout);
//   adj  one reservation of N x S, N handles mapped side by side (a loop), then ONE cuMemSetAccess
//        and ONE cuMemUnmap over the whole range (the driver may refuse: the result is recorded,
//        the mappings then undone one by one, also timed);
//   one  one handle of N x S: cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease;
//   part once per configuration, outside the repetitions: cuMemUnmap of the first S of the one
//        mapping (may a large handle's mapping be given back piecewise?).
// A refused call stops its layout for that repetition and records the CUresult's name.  Last, sums
// of medians: a pause and a resume today, over one range (span calls) and with one handle.
// Limits: one device, one thread, the default (pinned, device-local) allocation properties; work
// the driver defers past cuCtxSynchronize (scrubbing released memory, say) shows up only as the
// next repetition's cost; first touches after mapping and memory pressure are not seen.
//   vmm_cost_probe [--reps R] [--json FILE] [T_MiB:S_MiB ...]   (default below; exit 2 without a GPU)
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {
constexpr size_t MiB = size_t(1) << 20;
struct Case {
  std::string name, base, err;  // base: the case a single call or a redesign compares with
  size_t n, s;
  std::vector<double> ms;
  double med() const {
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    return v.empty() ? -1 : v[v.size() / 2];
  }
};
std::vector<Case> cases;
CUmemAllocationProp prop{};
CUmemAccessDesc acc{};
bool recording = false;
size_t N, S;  // the configuration being probed
using Step = std::function<CUresult()>;
using Each = std::function<CUresult(size_t)>;

std::string errname(CUresult r) {
  const char* s = nullptr;
  return cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "CUresult " + std::to_string(r);
}
std::string quoted(const std::string& s) { return s.empty() ? "null" : "\"" + s + "\""; }
std::string key(const char* what) {
  auto mib = [](size_t b) { return std::to_string(b / MiB) + " MiB"; };
  return mib(N * S) + " = " + std::to_string(N) + " x " + mib(S) + ": " + what;
}
Case* find(const std::string& name) {
  for (Case& c : cases)
    if (c.name == name) return &c;
  return nullptr;
}
// One timed step between two cuCtxSynchronize; true when the driver did it.
bool timed(const char* what, const Step& f, const char* base = nullptr) {
  cuCtxSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  CUresult r = f();
  cuCtxSynchronize();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  Case* c = find(key(what));
  if (!c) c = &cases.emplace_back(Case{key(what), base ? key(base) : "", "", N, S, {}});
  if (r != CUDA_SUCCESS) c->err = errname(r);
  else if (recording) c->ms.push_back(ms);
  return r == CUDA_SUCCESS;
}
CUresult each(const Each& f) {
  for (size_t i = 0; i < N; ++i)
    if (CUresult r = f(i)) return r;
  return CUDA_SUCCESS;
}
bool loop(const char* what, const Each& f) { return timed(what, [&] { return each(f); }); }

// Today's layout: a reservation, a handle and a mapping per segment.
void separate() {
  std::vector<CUdeviceptr> va(N, 0);
  std::vector<CUmemGenericAllocationHandle> h(N, 0);
  bool ok = !each([&](size_t i) { return cuMemAddressReserve(&va[i], S, 0, 0, 0); }) &&
            loop("cuMemCreate per segment", [&](size_t i) { return cuMemCreate(&h[i], S, &prop, 0); }) &&
            loop("cuMemMap per segment", [&](size_t i) { return cuMemMap(va[i], S, 0, h[i], 0); }) &&
            loop("cuMemSetAccess per segment", [&](size_t i) { return cuMemSetAccess(va[i], S, &acc, 1); }) &&
            loop("cuMemUnmap per segment", [&](size_t i) { return cuMemUnmap(va[i], S); });
  if (ok) loop("cuMemRelease per segment", [&](size_t i) {
    CUresult r = cuMemRelease(h[i]);
    h[i] = r ? h[i] : 0;
    return r;
  });
  for (size_t i = 0; i < N; ++i) {  // after a refusal: undo what is left, errors ignored
    if (!ok && va[i]) cuMemUnmap(va[i], S);
    if (h[i]) cuMemRelease(h[i]);
    if (va[i]) cuMemAddressFree(va[i], S);
  }
}

// N handles side by side in one reservation; one call over all of them where the driver allows.
void adjacent() {
  CUdeviceptr va = 0;
  std::vector<CUmemGenericAllocationHandle> h(N, 0);
  size_t mapped = 0;  // undone at the end unless an unmap step undid them
  if (cuMemAddressReserve(&va, N * S, 0, 0, 0)) return;
  if (!each([&](size_t i) { return cuMemCreate(&h[i], S, &prop, 0); }))
    loop("cuMemMap per segment, one range", [&](size_t i) {
      CUresult r = cuMemMap(va + i * S, S, 0, h[i], 0);
      mapped += r == CUDA_SUCCESS;
      return r;
    });
  bool all = mapped == N;
  if (all && !timed("one cuMemSetAccess over N mappings", [&] { return cuMemSetAccess(va, N * S, &acc, 1); },
                    "cuMemSetAccess per segment"))
    each([&](size_t i) { return cuMemSetAccess(va + i * S, S, &acc, 1); });
  if (all && (timed("one cuMemUnmap over N mappings", [&] { return cuMemUnmap(va, N * S); },
                    "cuMemUnmap per segment") ||
              loop("cuMemUnmap per segment, one range", [&](size_t i) { return cuMemUnmap(va + i * S, S); })))
    mapped = 0;
  for (size_t i = 0; i < N; ++i) {
    if (i < mapped) cuMemUnmap(va + i * S, S);
    if (h[i]) cuMemRelease(h[i]);
  }
  cuMemAddressFree(va, N * S);
}

// One handle of N x S; part: unmap only its first S (once, outside the repetitions), then the rest.
void single(bool part) {
  size_t t = N * S;
  CUdeviceptr va = 0;
  CUmemGenericAllocationHandle h = 0;
  if (cuMemAddressReserve(&va, t, 0, 0, 0)) return;
  bool mapped = timed("one cuMemCreate of N x S", [&] { return cuMemCreate(&h, t, &prop, 0); },
                      "cuMemCreate per segment") &&
                timed("one cuMemMap of N x S", [&] { return cuMemMap(va, t, 0, h, 0); }, "cuMemMap per segment");
  if (mapped && part) {
    cuMemSetAccess(va, t, &acc, 1);
    recording = true;
    if (timed("cuMemUnmap of the first S of one N x S mapping", [&] { return cuMemUnmap(va, S); }))
      mapped = cuMemUnmap(va + S, t - S) != CUDA_SUCCESS;  // the rest; the whole range below if that is refused
    recording = false;
  } else if (mapped) {
    timed("one cuMemSetAccess of N x S", [&] { return cuMemSetAccess(va, t, &acc, 1); }, "cuMemSetAccess per segment");
    if (timed("one cuMemUnmap of N x S", [&] { return cuMemUnmap(va, t); }, "cuMemUnmap per segment")) {
      mapped = false;
      if (timed("one cuMemRelease of N x S", [&] { return cuMemRelease(h); }, "cuMemRelease per segment")) h = 0;
    }
  }
  if (mapped) cuMemUnmap(va, t);
  if (h) cuMemRelease(h);
  cuMemAddressFree(va, t);
}

// Sums of the medians: a pause and a resume today, over one range, and with one handle.
void derive() {
  const std::vector<std::pair<const char*, std::vector<const char*>>> sums = {
      {"pause today (unmap + release per segment)", {"cuMemUnmap per segment", "cuMemRelease per segment"}},
      {"resume today (create + map + setAccess per segment)",
       {"cuMemCreate per segment", "cuMemMap per segment", "cuMemSetAccess per segment"}},
      {"pause, one range (one unmap, release per segment)",
       {"one cuMemUnmap over N mappings", "cuMemRelease per segment"}},
      {"resume, one range (create + map per segment, one setAccess)",
       {"cuMemCreate per segment", "cuMemMap per segment, one range", "one cuMemSetAccess over N mappings"}},
      {"pause, one handle", {"one cuMemUnmap of N x S", "one cuMemRelease of N x S"}},
      {"resume, one handle", {"one cuMemCreate of N x S", "one cuMemMap of N x S", "one cuMemSetAccess of N x S"}}};
  for (size_t k = 0; k < sums.size(); ++k) {
    double sum = 0;
    for (const char* part : sums[k].second) {
      Case* c = find(key(part));
      sum = !c || c->ms.empty() || sum < 0 ? -1 : sum + c->med();
    }
    if (sum >= 0) cases.push_back({key(sums[k].first), k < 2 ? "" : key(sums[k % 2].first), "", N, S, {sum}});
  }
}
// The table on stdout and, with a path, the JSON of benchmarks/bench_json.py (schema 1).
void report(const char* json, const char* device, const std::string& cmd, const std::string& extra) {
  std::printf("%-62s %6s %6s %10s %11s %9s\n", "case", "N", "S MiB", "ms median", "us/segment", "GB/s");
  std::string res, refused;
  size_t n_refused = 0;
  for (const Case& c : cases) {
    double m = c.med();
    const char* what = c.name.c_str() + c.name.find(": ") + 2;  // N and S have their columns
    if (c.ms.empty()) {
      std::printf("%-62s %6zu %6zu %10s\n", what, c.n, c.s / MiB, c.err.c_str());
      refused += (n_refused++ ? ",\n  " : "\n  ") + quoted(c.name) + ": " + quoted(c.err);
      continue;
    }
    std::printf("%-62s %6zu %6zu %10.3f %11.2f %9.1f\n", what, c.n, c.s / MiB, m, m * 1e3 / c.n, c.n * c.s / (m * 1e6));
    Case* b = find(c.base);
    char buf[512];
    std::snprintf(buf, sizeof buf, "%s\n  {\"name\": \"%s\", \"value\": %.6g, \"unit\": \"ms\", \"baseline\": %s}",
                  res.empty() ? "" : ",", c.name.c_str(), m, quoted(b && !b->ms.empty() ? c.base : "").c_str());
    res += buf;
  }
  std::printf("%zu cases, %zu refused by the driver\n", cases.size(), n_refused);
  FILE* f = json ? std::fopen(json, "w") : nullptr;
  if (!f) return;
  std::fprintf(f, "{\"benchmark\": \"vmm_cost_probe\", \"schema\": 1, \"device\": \"%s\", \"command\": %s,\n"
               "\"results\": [%s],\n\"extra\": {%s, \"refused\": {%s},\n\"notes\": [\"CUDA driver calls only: "
               "the median of the repetitions after a warm-up, cuCtxSynchronize around each step, nothing copied or "
               "touched; 'refused' names the cases the driver refused (CUresult). A 'pause'/'resume' row is a sum "
               "of medians.\"]}}\n",
               device, quoted(cmd).c_str(), res.c_str(), extra.c_str(), refused.c_str());
  std::fclose(f);
}
}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  const char* json = nullptr;
  std::vector<std::pair<size_t, size_t>> cfg;  // (N, S bytes)
  std::string cmd = "benchmarks/pause_resume/vmm_cost_probe";
  for (int i = 1; i < argc; ++i) {
    size_t t, s;
    cmd += std::string(" ") + argv[i] + (i + 1 < argc && argv[i][0] == '-' ? std::string(" ") + argv[i + 1] : "");
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (std::sscanf(argv[i], "%zu:%zu", &t, &s) == 2 && s > 0 && t >= s) cfg.push_back({t / s, s * MiB});
    else return std::fprintf(stderr, "usage: %s [--reps R] [--json FILE] [T_MiB:S_MiB ...]\n", argv[0]), 2;
  }
  // bench_drop_in: 8 GiB in 512 tensors of 16 MiB, each its own segment (above 10 MiB PyTorch
  // rounds a segment to 2 MiB); PyTorch's small pool: 2 MiB; its large pool's least: 20 MiB.
  if (cfg.empty())
    for (auto [t, s] : {std::pair<size_t, size_t>{8192, 16}, {1024, 2}, {1024, 16}, {1024, 20}, {1024, 64}, {8192, 2},
                        {8192, 512}})
      cfg.push_back({t / s, s * MiB});
  CUdevice dev;
  CUcontext ctx;
  CUresult r = cuInit(0);
  if (r) return std::fprintf(stderr, "vmm_cost_probe: cuInit failed (%s): no GPU or driver, nothing measured\n",
                             errname(r).c_str()), 2;
  if (!(r = cuDeviceGet(&dev, 0)) && !(r = cuDevicePrimaryCtxRetain(&ctx, dev))) r = cuCtxSetCurrent(ctx);
  if (r) return std::fprintf(stderr, "vmm_cost_probe: no context on device 0 (%s)\n", errname(r).c_str()), 2;
  char name[256] = "?";
  int drv = 0;
  size_t gran = 0;
  cuDeviceGetName(name, sizeof name, dev);
  cuDriverGetVersion(&drv);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, static_cast<int>(dev)};
  acc = {prop.location, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  std::printf("%s, driver %d, granularity %zu KiB, %d repetitions + 1 warm-up\n", name, drv, gran >> 10, reps);
  for (auto [n, s] : cfg) {
    N = n, S = s;
    for (int i = 0; i <= reps; ++i) {
      recording = i > 0;
      separate();
      adjacent();
      single(false);
    }
    recording = false;
    single(true);
    derive();
  }
  report(json, name, cmd, "\"driver_version\": " + std::to_string(drv) + ", \"granularity_bytes\": " +
                              std::to_string(gran) + ", \"repetitions\": " + std::to_string(reps));
  return 0;
}
