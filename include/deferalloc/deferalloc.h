/* deferalloc C ABI.
 *
 * One process-wide instance, created by dfa_init() or, on first use, from the
 * DEFERALLOC_CONF environment variable (grammar of PYTORCH_CUDA_ALLOC_CONF:
 * "key:value,key:[v1,v2]").  Every function returns a dfa_status; on failure
 * dfa_last_error() gives a thread-local message naming the call and the cause.
 * No exception ever crosses this interface, and no function exits the process.
 * Offsets and lengths are multiples of dfa_granularity(), except that a range may
 * end at the reservation's size; DFA_WHOLE as length means "to the end".
 *
 * The reservation calls (dfa_find .. dfa_is_backed, dfa_export_dlpack) act only on
 * reservations that dfa_reserve handed out: the segments behind dfa_malloc blocks belong
 * to the caching allocator, dfa_find does not name them and the other calls refuse their
 * ids with INVALID_ARGUMENT.  dfa_fill / dfa_keep values are checked as integers.
 *
 * On the host driver, a touch of released memory (unbacked, paused or freed) raises
 * SIGSEGV as it faults on the GPU; the library's SIGSEGV handler (installed with the
 * first host-driver instance, chained to the previous handler) first writes one line to
 * stderr naming the reservation: "[deferalloc] SIGSEGV at 0x..: reservation N (address
 * 0x.., S bytes), offset O, touched while released (...)".  The signal then proceeds. */
#ifndef DEFERALLOC_H
#define DEFERALLOC_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define DFA_C_API __declspec(dllexport)
#else
#define DFA_C_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dfa_status {
  DFA_SUCCESS = 0,
  DFA_ERROR_INVALID_ARGUMENT = 1, /* bad input; nothing changed */
  DFA_ERROR_INVALID_STATE = 2,    /* wrong state for the call; nothing changed */
  DFA_ERROR_OUT_OF_MEMORY = 3,    /* rolled back */
  DFA_ERROR_CUDA = 4,             /* a CUDA driver call failed */
  DFA_ERROR_NO_DEVICE = 5,        /* no usable CUDA driver or device */
  DFA_ERROR_IO = 6,
  DFA_ERROR_CORRUPT = 7,
  DFA_ERROR_INTERNAL = 8
} dfa_status;

typedef uint64_t dfa_reservation;
typedef enum dfa_fill { DFA_FILL_UNDEFINED = 0, DFA_FILL_ZERO = 1, DFA_FILL_RESTORE = 2 } dfa_fill;
typedef enum dfa_keep { DFA_KEEP_DISCARD = 0, DFA_KEEP_HOST = 1 } dfa_keep;
#define DFA_WHOLE ((size_t)-1)

typedef struct dfa_stats {
  size_t reservations;
  size_t reserved_bytes;      /* address space */
  size_t backed_bytes;        /* physical memory mapped behind reservations */
  size_t peak_backed_bytes;
  size_t backup_bytes;        /* contents waiting in host backups */
  size_t pool_alive_bytes;    /* chunks created and not released (mapped + cached) */
  size_t pool_cached_bytes;
  size_t pinned_bytes;        /* pinned host memory held (in use + cached) */
  uint64_t chunks_created;
  uint64_t chunks_reused;
  uint64_t driver_calls[8];   /* reserve, free_reservation, create, release, map, unmap, set_access, host_alloc */
} dfa_stats;

/* Creates the process-wide instance from `conf` (NULL: $DEFERALLOC_CONF).  Fails with
 * INVALID_STATE if one exists already; unknown keys give INVALID_ARGUMENT with the list
 * of valid keys.  Cost: driver load, one context. */
DFA_C_API dfa_status dfa_init(const char* conf);
/* Frees every reservation and the instance, and closes every thread's tagged regions
 * (they do not survive into the next instance).  Safe to call when none exists.  The exit of
 * the process does not run it (the CUDA driver takes the memory back with the context,
 * and nothing is left to tear down against a driver already shut down): call it to give
 * the memory back earlier. */
DFA_C_API dfa_status dfa_shutdown(void);
/* The last error of this thread ("" after a success). */
DFA_C_API const char* dfa_last_error(void);
/* Sends the library's log messages to `fn` instead of stderr: every message at or below
 * `level` (1 error, 2 warn, 3 info, 4 debug; the settings' log_level then does not
 * apply), from whichever thread logs, with `user` passed back.  NULL restores stderr
 * and log_level.  Python's logging bridge uses it (deferalloc/_logging.py).  Cost: none. */
typedef void (*dfa_log_fn)(int level, const char* message, void* user);
DFA_C_API dfa_status dfa_set_log_callback(dfa_log_fn fn, void* user, int level);
/* "cuda" or "host" (initializes on first use). */
DFA_C_API dfa_status dfa_driver_name(const char** out);
DFA_C_API dfa_status dfa_granularity(size_t* out);

/* Reserves `bytes` of address space (no physical memory).  Cost: one cuMemAddressReserve. */
DFA_C_API dfa_status dfa_reserve(size_t bytes, dfa_reservation* out, void** address);
/* Backs a range; fill on `stream` (a cudaStream_t, NULL = default stream).  No host sync. */
DFA_C_API dfa_status dfa_materialize(dfa_reservation r, size_t offset, size_t length, dfa_fill fill, void* stream);
/* Unbacks a range after the streams that used it; keeps contents in pinned host memory
 * with DFA_KEEP_HOST. */
DFA_C_API dfa_status dfa_release(dfa_reservation r, size_t offset, size_t length, dfa_keep keep, void* stream);
/* dfa_release and dfa_materialize of `n` whole reservations in one call, all or nothing: a
 * release enqueues every backup copy before its one host wait (one wait, not n). */
DFA_C_API dfa_status dfa_release_many(const dfa_reservation* rs, size_t n, dfa_keep keep, void* stream);
DFA_C_API dfa_status dfa_materialize_many(const dfa_reservation* rs, size_t n, dfa_fill fill, void* stream);
/* As dfa_materialize, but each unbacked run is one chunk of its exact size where one can be
 * had (cached or new), else each piece of the largest chunk class that fits is one chunk (a
 * cached one of its class, else a new one) before smaller cached chunks are used: one mapping
 * for a range that is paused and resumed often. */
DFA_C_API dfa_status dfa_materialize_whole_pieces(dfa_reservation r, size_t offset, size_t length, dfa_fill fill,
                                                  void* stream);
/* A range of a reservation (dfa_release_many_keeping). */
typedef struct dfa_range {
  dfa_reservation r;
  size_t offset;
  size_t length;
} dfa_range;
/* dfa_release_many with DFA_KEEP_HOST that copies only the `n_kept` ranges `kept` (parts of
 * the reservations of `rs`, granule-aligned, not overlapping; adjacent ones in one copy): the
 * other granules released keep nothing, and a later DFA_FILL_RESTORE leaves them undefined. */
DFA_C_API dfa_status dfa_release_many_keeping(const dfa_reservation* rs, size_t n, const dfa_range* kept, size_t n_kept,
                                              void* stream);
/* Releases waits for `stream` too. */
DFA_C_API dfa_status dfa_record_stream(dfa_reservation r, void* stream);
/* Releases everything and frees the address range.  Unknown or freed: INVALID_ARGUMENT.
 * (Named dfa_free_reservation so that dfa_free can be CUDAPluggableAllocator's free.) */
DFA_C_API dfa_status dfa_free_reservation(dfa_reservation r, void* stream);
DFA_C_API dfa_status dfa_is_backed(dfa_reservation r, size_t offset, size_t length, int* out);
/* The reservation of dfa_reserve containing `ptr` (a dfa_malloc block, or a reservation
 * hidden by dfa_hide_reservation: INVALID_ARGUMENT, the message says whose). */
DFA_C_API dfa_status dfa_find(const void* ptr, dfa_reservation* out);
/* Hides reservation `r` from dfa_find (until it is freed): a pointer inside it is refused with
 * INVALID_ARGUMENT naming `owner` (e.g. "the preload library's arena 'x'"), for a reservation
 * parcelled out to others (many segments in one), that no caller may act on whole for a part
 * of it.  The calls on the id itself (held by its owner) still act on it. */
DFA_C_API dfa_status dfa_hide_reservation(dfa_reservation r, const char* owner);
/* Gives cached chunks back to the driver until at most `keep_bytes` stay cached, and frees
 * the cached pinned backup buffers; `released`: device bytes given back. */
DFA_C_API dfa_status dfa_trim(size_t keep_bytes, size_t* released);
DFA_C_API dfa_status dfa_get_stats(dfa_stats* out);

/* ---- Disk spills (torch_memory_saver's disk backup; deferalloc.memory_saver) ----------
 * `n` ranges of device memory (ptrs[i], sizes[i] bytes; host memory on the host driver)
 * of `device` (-1: the instance's) to one file and back, through two pinned staging
 * buffers of up to `chunk_bytes` (rounded up to 64 KiB) copied on `stream`; both wait for
 * their copies before they return, and drop the file's page cache when done.  The file has
 * a header (the ranges' count and sizes), the bytes and a checksum64 per 64 KiB block
 * (Note [Disk spills] in allocator/core/files/spill.cpp). */
/* Writes a temporary file beside `path` (exclusive, 0600, its size reserved first),
 * fsyncs it, renames it to `path`, fsyncs the directory: `path` is the whole file or
 * absent (a full disk or an I/O error: IO, naming the file; `path` not written).  The
 * directory is made (0700) if missing and refused (IO) unless owned by this user and not
 * a symbolic link.  An existing `path` is replaced. */
DFA_C_API dfa_status dfa_spill_save(const char* path, int device, size_t n, void* const* ptrs, const size_t* sizes,
                                    size_t chunk_bytes, void* stream);
/* Reads `path` into the ranges, which must have the count and sizes it was saved with
 * (else INVALID_ARGUMENT naming the file); each block's checksum is verified before its
 * bytes reach the device.  A range whose ptrs[i] is NULL is verified and skipped.  A damaged or truncated file: CORRUPT naming the file (and the
 * offset of a bad block); missing, a symbolic link or another user's: IO.  On an error
 * the ranges' contents are undefined.  The file is left as it is. */
DFA_C_API dfa_status dfa_spill_load(const char* path, int device, size_t n, void* const* ptrs, const size_t* sizes,
                                    size_t chunk_bytes, void* stream);
/* Makes `dir` (0700) unless it exists, then refuses it (IO) unless it is a directory
 * owned by this user and not a symbolic link.  *in_memory (may be NULL) = 1 when it is
 * tmpfs or ramfs (spills there hold host memory). */
DFA_C_API dfa_status dfa_spill_check_dir(const char* dir, int* in_memory);

/* ---- PyTorch faces: the caching allocator, tags, statistics, DLPack ---------------
 * One caching allocator per device, created on first use on top of the instance
 * (device -1: the instance's device).  Streams are cudaStream_t (NULL: default stream). */

/* CUDAPluggableAllocator's alloc: a block of `size` bytes usable on `stream`, or NULL
 * with dfa_last_error() set.  Inside a tagged region (dfa_tag_begin) the block belongs
 * to the tag.  size 0 gives NULL without an error (PyTorch's empty tensors).
 * Cost: cached: one mutex, no driver call; see deferalloc/caching/caching_allocator.hpp. */
DFA_C_API void* dfa_malloc(size_t size, int device, void* stream);
/* Why the calling thread's last dfa_malloc returned NULL: "deferalloc refused <N> bytes
 * (<size>)[ in tag 'T']: <reason>. Fix: <what to do>." (also logged at warn), or the
 * error of a failure that is not a refusal; "" when that dfa_malloc returned a block (or
 * size 0), before any, and after dfa_clear_last_refusal().  Per thread: another thread's
 * refusal never shows here.  Valid until this thread's next dfa_malloc: unlike
 * dfa_last_error(), other calls (dfa_free, the hooks, which PyTorch makes between its
 * retries and its error) keep it. */
DFA_C_API const char* dfa_last_refusal(void);
DFA_C_API void dfa_clear_last_refusal(void);
/* CUDAPluggableAllocator's free (no status: a pointer we do not own sets
 * dfa_last_error() and is logged; nothing changes). */
DFA_C_API void dfa_free(void* ptr, size_t size, int device, void* stream);
/* The optional hooks of torch.cuda.memory.CUDAPluggableAllocator (PyTorch 2.11):
 * set_init_fn, set_reset_fn (= empty_cache), set_memory_fraction_fn,
 * set_base_alloc_fn, set_record_stream_fn.  Errors set dfa_last_error() and are logged. */
DFA_C_API void dfa_init_hook(int device_count);
DFA_C_API void dfa_empty_cache_hook(void);
DFA_C_API void dfa_memory_fraction_hook(double fraction, int device);
DFA_C_API void* dfa_base_alloc_hook(void* ptr, size_t* size);
DFA_C_API void dfa_record_stream_hook(void* ptr, void* stream);

/* Releases every cached granule of the device's caching allocator and trims the pool.
 * `released` (may be NULL): bytes given back to the driver. */
DFA_C_API dfa_status dfa_empty_cache(int device, size_t* released);
/* 0 < fraction <= 1 of the device's memory may stay backed. */
DFA_C_API dfa_status dfa_set_memory_fraction(double fraction, int device);
/* Marks the allocation containing `ptr` to stay backed when its tag pauses. */
DFA_C_API dfa_status dfa_set_resident(void* ptr, int resident);

/* Tagged regions of the calling thread (they nest; the innermost wins).  A tag is 1 to
 * 256 bytes of printable text: a control character (a newline, a tab, ...) is refused
 * with INVALID_ARGUMENT, here and in the calls below. */
DFA_C_API dfa_status dfa_tag_begin(const char* tag);
DFA_C_API dfa_status dfa_tag_end(void);
/* Releases the physical memory of every allocation of `tag` on every device, addresses
 * kept; DFA_KEEP_HOST keeps contents in pinned host memory.  Unknown tag:
 * INVALID_ARGUMENT; inside a tagged region or already paused: INVALID_STATE. */
DFA_C_API dfa_status dfa_tag_pause(const char* tag, dfa_keep keep, void* stream);
/* Backs the tag again at the same addresses (contents restored if kept). */
DFA_C_API dfa_status dfa_tag_resume(const char* tag, void* stream);
/* *out = 1 when the tag is paused. */
DFA_C_API dfa_status dfa_tag_is_paused(const char* tag, int* out);
/* The caching allocators' state and recorded events as text, one record a line (a
 * "D <device>" line before each device's; the format: Note [Memory snapshots] in
 * allocator/caching/caching_snapshot.cpp); `needed` and a too small buf as in
 * dfa_memory_stats.  deferalloc.memory_snapshot() turns it into PyTorch's format. */
DFA_C_API dfa_status dfa_memory_snapshot(char* buf, size_t cap, size_t* needed);
/* Records allocator events (alloc, free, segment map/unmap, oom) in a ring of the newest
 * `max_entries` on every device's caching allocator (and those created later); 0 stops
 * and drops them.  dfa_shutdown stops it. */
DFA_C_API dfa_status dfa_record_memory_history(size_t max_entries);
/* The known tags (of every device), one per line, into buf (NUL-terminated); `needed` and
 * a too small buf as in dfa_memory_stats.  Lets a caller pause or resume every tag. */
DFA_C_API dfa_status dfa_tag_names(char* buf, size_t cap, size_t* needed);

/* Statistics of the device's caching allocator, PyTorch's key names
 * ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_ooms", ...) and
 * deferalloc's ("deferalloc.*"), as "key value\n" lines into buf (NUL-terminated).
 * `needed` gets the size buf must have; a too small buf gives INVALID_ARGUMENT. */
DFA_C_API dfa_status dfa_memory_stats(int device, char* buf, size_t cap, size_t* needed);
DFA_C_API dfa_status dfa_memory_stat(int device, const char* key, int64_t* out);
DFA_C_API dfa_status dfa_reset_peak_stats(int device);

/* DLPack: a DLManagedTensor (DLPack's legacy, unversioned struct, as in dlpack.h) whose
 * data is the reservation's address: kDLCUDA on the CUDA driver, kDLCPU on the host
 * driver.  Its deleter frees the reservation.  dtype is DLPack's (code, bits, lanes);
 * the shape is contiguous (strides NULL) and must fit in the reservation.  Ownership of
 * the reservation passes to the tensor on success. */
struct DLManagedTensor;
DFA_C_API dfa_status dfa_export_dlpack(dfa_reservation r, const int64_t* shape, int ndim, uint8_t code, uint8_t bits,
                                       uint16_t lanes, struct DLManagedTensor** out);

#ifdef __cplusplus
}
#endif
#endif /* DEFERALLOC_H */
