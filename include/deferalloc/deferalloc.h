/* deferalloc C ABI.
 *
 * One process-wide instance, created by dfa_init() or, on first use, from the
 * DEFERALLOC_CONF environment variable (grammar of PYTORCH_CUDA_ALLOC_CONF:
 * "key:value,key:[v1,v2]").  Every function returns a dfa_status; on failure
 * dfa_last_error() gives a thread-local message naming the call and the cause.
 * No exception ever crosses this interface, and no function exits the process.
 * Offsets and lengths are multiples of dfa_granularity(), except that a range may
 * end at the reservation's size; DFA_WHOLE as length means "to the end". */
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
/* Frees every reservation and the instance.  Safe to call when none exists. */
DFA_C_API dfa_status dfa_shutdown(void);
/* The last error of this thread ("" after a success). */
DFA_C_API const char* dfa_last_error(void);
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
/* Releases waits for `stream` too. */
DFA_C_API dfa_status dfa_record_stream(dfa_reservation r, void* stream);
/* Releases everything and frees the address range.  Unknown or freed: INVALID_ARGUMENT. */
DFA_C_API dfa_status dfa_free(dfa_reservation r, void* stream);
DFA_C_API dfa_status dfa_is_backed(dfa_reservation r, size_t offset, size_t length, int* out);
/* The reservation containing `ptr`. */
DFA_C_API dfa_status dfa_find(const void* ptr, dfa_reservation* out);
/* Gives cached chunks back to the driver until at most `keep_bytes` stay cached. */
DFA_C_API dfa_status dfa_trim(size_t keep_bytes, size_t* released);
DFA_C_API dfa_status dfa_get_stats(dfa_stats* out);

#ifdef __cplusplus
}
#endif
#endif /* DEFERALLOC_H */
