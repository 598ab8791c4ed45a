// The C ABI's reservation calls and the DLPack export.
//
// They act only on the reservations the ABI handed out (Note [Reservations of the ABI] in
// process_state.cpp); on the host driver a touch of released memory is reported by name
// (Note [Released-memory faults] in fault_report.hpp).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dlpack_abi.hpp"
#include "fault_report.hpp"
#include "process_state.hpp"

using namespace deferalloc;
using namespace deferalloc::abi;

namespace {

struct dlpack_holder {
  DLManagedTensor tensor{};
  std::vector<std::int64_t> shape;
  dfa_reservation id = 0;
  std::uint64_t generation = 0;
};

extern "C" void dfa_dlpack_deleter(DLManagedTensor* t) {
  auto* h = static_cast<dlpack_holder*>(t->manager_ctx);
  if (h->generation == g_generation.load()) {
    // The instance that made the reservation still exists: free it.
    if (dfa_free_reservation(h->id, nullptr) != DFA_SUCCESS) log_hook_error("DLPack deleter");
  }
  delete h;
}

// Runs `op(manager, ranges)` on the whole of each reservation of `rs` (every one handed out
// by dfa_reserve), under the ABI's guard.
template <class Op>
dfa_status on_whole_reservations(const char* call, const dfa_reservation* rs, size_t n, Op op) {
  return guard(call, [&] {
    if (n != 0) need(rs, "rs");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    std::vector<range> ws;
    ws.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      expect_handed_out(m, rs[i]);
      ws.push_back({rs[i], 0, whole});
    }
    op(m, ws);
  });
}

// dfa_materialize and dfa_materialize_whole_pieces: one range of a reservation handed out.
dfa_status materialize_range(const char* call, dfa_reservation r, size_t offset, size_t length, dfa_fill fill,
                             void* stream, bool whole_pieces) {
  return guard(call, [&] {
    // Range-checked by materialize (Note [Enum values from callers]).
    const auto f = detail::enum_from_c<fill_mode>(fill);
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    const range rg{r, offset, length};
    if (whole_pieces) m.materialize_whole_pieces(std::span<const range>(&rg, 1), f, stream_t{stream});
    else m.materialize(r, offset, length, f, stream_t{stream});
  });
}

}  // namespace

extern "C" {

dfa_status dfa_reserve(size_t bytes, dfa_reservation* out, void** address) {
  return guard("dfa_reserve", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    reservation_id id = m.reserve(bytes);
    try {
      std::lock_guard ids(g_ids_mu);
      g_ids.insert(id);
    } catch (...) {
      m.free(id);
      throw;
    }
    if (g_report_faults.load()) {
      const reservation_info info = m.info(id);
      detail::faults().add(id, info.address, info.reserved_bytes);
    }
    *out = id;
    if (address) *address = m.address(id);
  });
}

dfa_status dfa_materialize(dfa_reservation r, size_t offset, size_t length, dfa_fill fill, void* stream) {
  return materialize_range("dfa_materialize", r, offset, length, fill, stream, false);
}
dfa_status dfa_materialize_whole_pieces(dfa_reservation r, size_t offset, size_t length, dfa_fill fill, void* stream) {
  return materialize_range("dfa_materialize_whole_pieces", r, offset, length, fill, stream, true);
}

dfa_status dfa_release(dfa_reservation r, size_t offset, size_t length, dfa_keep keep, void* stream) {
  return guard("dfa_release", [&] {
    const auto k = detail::enum_from_c<keep_mode>(keep);  // range-checked by release
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.release(r, offset, length, k, stream_t{stream});
  });
}

dfa_status dfa_release_many(const dfa_reservation* rs, size_t n, dfa_keep keep, void* stream) {
  return on_whole_reservations("dfa_release_many", rs, n, [&](reservation_manager& m, const std::vector<range>& ws) {
    m.release(ws, detail::enum_from_c<keep_mode>(keep), stream_t{stream});
  });
}

dfa_status dfa_release_many_keeping(const dfa_reservation* rs, size_t n, const dfa_range* kept, size_t n_kept,
                                    void* stream) {
  return on_whole_reservations("dfa_release_many_keeping", rs, n, [&](reservation_manager& m, const std::vector<range>& ws) {
    if (n_kept != 0) need(kept, "kept");
    std::vector<range> ks;
    ks.reserve(n_kept);
    for (size_t i = 0; i < n_kept; ++i) {
      if (std::find(rs, rs + n, kept[i].r) == rs + n)
        throw invalid_argument("kept[" + std::to_string(i) + "] is not in a reservation of rs");
      ks.push_back({kept[i].r, kept[i].offset, kept[i].length});
    }
    m.release_keeping(ws, ks, stream_t{stream});
  });
}
dfa_status dfa_materialize_many(const dfa_reservation* rs, size_t n, dfa_fill fill, void* stream) {
  return on_whole_reservations("dfa_materialize_many", rs, n, [&](reservation_manager& m, const std::vector<range>& ws) {
    m.materialize(ws, detail::enum_from_c<fill_mode>(fill), stream_t{stream});
  });
}

dfa_status dfa_record_stream(dfa_reservation r, void* stream) {
  return guard("dfa_record_stream", [&] {
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.record_stream(r, stream_t{stream});
  });
}

dfa_status dfa_free_reservation(dfa_reservation r, void* stream) {
  return guard("dfa_free_reservation", [&] {
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.free(r, stream_t{stream});
    detail::faults().remove(r);
    std::lock_guard ids(g_ids_mu);
    g_ids.erase(r);
    g_hidden.erase(r);
  });
}

dfa_status dfa_hide_reservation(dfa_reservation r, const char* owner) {
  return guard("dfa_hide_reservation", [&] {
    need(owner, "owner");
    std::shared_lock<std::shared_mutex> lk;
    expect_handed_out(*instance(lk).reservations, r);
    std::lock_guard ids(g_ids_mu);
    g_hidden.insert_or_assign(r, owner);
  });
}

dfa_status dfa_is_backed(dfa_reservation r, size_t offset, size_t length, int* out) {
  return guard("dfa_is_backed", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    *out = m.is_backed(r, offset, length) ? 1 : 0;
  });
}

dfa_status dfa_find(const void* ptr, dfa_reservation* out) {
  return guard("dfa_find", [&] {
    need(out, "out");
    need(ptr, "ptr");
    std::shared_lock<std::shared_mutex> lk;
    auto id = instance(lk).reservations->find(ptr);
    if (!id) throw invalid_argument("pointer is not inside any reservation");
    if (!handed_out(*id))
      throw invalid_argument("pointer lies in a segment of deferalloc's caching allocator (a dfa_malloc block), "
                             "not in a reservation of dfa_reserve");
    {
      std::lock_guard ids(g_ids_mu);
      if (auto h = g_hidden.find(*id); h != g_hidden.end())
        throw invalid_argument("pointer lies in " + h->second +
                               ", whose owner hid it from dfa_find (Note [Hidden reservations]): the reservation "
                               "calls cannot act on a part of it");
    }
    *out = *id;
  });
}

dfa_status dfa_export_dlpack(dfa_reservation r, const int64_t* shape, int ndim, uint8_t code, uint8_t bits,
                             uint16_t lanes, struct DLManagedTensor** out) {
  return guard("dfa_export_dlpack", [&] {
    need(out, "out");
    if (ndim < 0 || ndim > 64) throw invalid_argument("ndim " + std::to_string(ndim) + " is outside [0, 64]");
    if (ndim > 0) need(shape, "shape");
    if (bits == 0 || lanes == 0) throw invalid_argument("dtype bits and lanes must be positive");
    if (code > 17) throw invalid_argument("dtype code " + std::to_string(code) + " is not a DLPack type code");
    std::shared_lock<std::shared_mutex> lk;
    context& ctx = instance(lk);
    expect_handed_out(*ctx.reservations, r);
    const reservation_info info = ctx.reservations->info(r);
    unsigned __int128 bytes = (static_cast<unsigned>(bits) * lanes + 7) / 8;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] < 0) throw invalid_argument("shape[" + std::to_string(i) + "] is negative");
      bytes *= static_cast<std::uint64_t>(shape[i]);
      if (bytes > info.size) break;
    }
    if (bytes > info.size)
      throw invalid_argument("the shape needs more than the reservation's " + std::to_string(info.size) + " bytes");
    auto h = std::make_unique<dlpack_holder>();
    h->shape.assign(shape, shape + ndim);
    h->id = r;
    h->generation = g_generation.load();
    DLTensor& t = h->tensor.dl_tensor;
    t.data = reinterpret_cast<void*>(info.address);
    const bool host = ctx.drv->kind() == driver_kind::host;
    t.device = {host ? detail::k_dl_cpu : detail::k_dl_cuda, host ? 0 : ctx.drv->device()};
    t.ndim = ndim;
    t.dtype = {code, bits, lanes};
    t.shape = h->shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    h->tensor.manager_ctx = h.get();
    h->tensor.deleter = &dfa_dlpack_deleter;
    *out = &h.release()->tensor;
  });
}

}  // extern "C"
