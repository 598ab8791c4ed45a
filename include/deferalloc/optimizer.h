/* deferalloc optimizer C ABI: the streamed AdamW engine (deferalloc/optim/optimizer.hpp) for
 * callers in C, Python (ctypes) or any other language.  In libdeferalloc_optimizer.so.
 *
 * Conventions of deferalloc.h: every function returns a dfa_status; on failure
 * dfa_opt_last_error() gives a thread-local message naming the call and the cause
 * (the optimizer library keeps its own, beside the allocator's dfa_last_error()).
 * Nothing throws across this interface and nothing exits the process.  Streams are
 * cudaStream_t (NULL: the default stream); on the host driver they are ignored and the
 * pointers are host memory.  An optimizer may be used from one thread at a time per
 * call (calls are serialized inside). */
#ifndef DEFERALLOC_OPTIMIZER_H
#define DEFERALLOC_OPTIMIZER_H

#include <deferalloc/deferalloc.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dfa_optimizer dfa_optimizer;

typedef enum dfa_dtype { DFA_DTYPE_BF16 = 0, DFA_DTYPE_FP32 = 1, DFA_DTYPE_FP16 = 2 } dfa_dtype;
typedef enum dfa_state_array { DFA_STATE_MAIN = 0, DFA_STATE_EXP_AVG = 1, DFA_STATE_EXP_AVG_SQ = 2 } dfa_state_array;

/* PyTorch's AdamW hyper-parameters, in double as PyTorch passes them. */
typedef struct dfa_adamw_params {
  double lr, beta1, beta2, eps, weight_decay;
} dfa_adamw_params;

/* What the last initialize or step did, and the totals. */
typedef struct dfa_optimizer_stats {
  uint64_t steps;              /* step calls completed */
  size_t shards;
  size_t piece_elements;       /* streamed tiers: elements per piece */
  double seconds;              /* last pass */
  size_t params;               /* elements the last pass stepped */
  size_t pieces;
  size_t bytes_to_device;      /* last pass, H2D */
  size_t bytes_from_device;    /* last pass, D2H */
  size_t peak_backed_bytes;    /* last pass: physical memory behind the state, at most (<= window) */
  double map_seconds;          /* last pass: host time mapping pieces */
  double retire_seconds;       /* last pass: host time waiting for write-backs and unmapping */
  double io_wait_seconds;      /* last pass, file tier: host time waiting for I/O */
} dfa_optimizer_stats;

/* phase is "init", "step" or "sync"; called from the calling thread after each piece. */
typedef void (*dfa_progress_fn)(const char* phase, size_t done, size_t total, double seconds, void* user);

/* The engine's settings, typed: the optimizer's keys of docs/SETTINGS.md (same names, same
 * units, same ranges and messages: each field goes through its key's row) and the driver
 * it runs on.  Versioned by its size: set struct_size = sizeof(dfa_optimizer_config), then
 * dfa_opt_config_init fills the defaults; a struct of a size this library does not know
 * is refused (INVALID_ARGUMENT).  Enumerations are ints (the DFA_* constants below). */
typedef enum dfa_driver_kind { DFA_DRIVER_AUTO = 0, DFA_DRIVER_CUDA = 1, DFA_DRIVER_HOST = 2 } dfa_driver_kind;
typedef enum dfa_tier { DFA_TIER_DEVICE = 0, DFA_TIER_HOST = 1, DFA_TIER_FILE = 2 } dfa_tier;
typedef enum dfa_moments { DFA_MOMENTS_FP32 = 0, DFA_MOMENTS_BF16 = 1, DFA_MOMENTS_INT8 = 2 } dfa_moments;
typedef struct dfa_optimizer_config {
  size_t struct_size;        /* sizeof(dfa_optimizer_config): this struct's version */
  /* the driver */
  int driver;                /* dfa_driver_kind (DFA_DRIVER_AUTO: cuda when a device is present) */
  int device;                /* CUDA device ordinal */
  const char* allocator_settings; /* the allocator's other keys for the driver and logging
                                     (host_granularity_kb, host_capacity_mb, shareable_handles,
                                     log_level, ...) in DEFERALLOC_CONF's grammar; NULL: none.
                                     Naming driver, device or an optimizer key is refused. */
  /* the optimizer */
  int tier;                  /* dfa_tier */
  const char* directory;     /* file tier: the state file's directory (NULL: none) */
  uint64_t window_mb;        /* HBM budget of the streamed state */
  int depth;                 /* pieces in flight (0: 8 host, 3 file tier) */
  int resume;                /* file tier: continue from the state file's last step */
  int rank;                  /* names the state file */
  int io_threads;            /* file tier */
  uint64_t io_request_mb;    /* file tier: the size of one request */
  int keep_window;           /* keep the window's slots backed between passes */
  uint64_t resident_mb;      /* host tier: HBM for shards kept resident */
  int moments;               /* dfa_moments: storage of the Adam moments at home */
  int progress_line;         /* print a progress line during a long initialize() */
  int pass_taper;            /* cut each pass's first and last pieces smaller */
  int pass_chain;            /* host tier with keep_window: a pass leaves its last write-backs to the next */
  uint64_t writeback_queue_mb; /* streamed tiers: write-back bytes a pass keeps queued (0: no bound) */
} dfa_optimizer_config;

/* Fills *c with the defaults (those of docs/SETTINGS.md); c->struct_size must be set first. */
DFA_C_API dfa_status dfa_opt_config_init(dfa_optimizer_config* c);
/* Applies settings text in DEFERALLOC_CONF's grammar ("key:value,..."; NULL or "": nothing)
 * onto an initialized *c: the optimizer's keys and driver / device set their fields (each
 * through its key's row: the ranges and messages of dfa_opt_create; a directory so set is
 * an interned copy valid for the process's life); every other key must be one of the
 * allocator's (unknown: INVALID_ARGUMENT listing the valid keys) and is written to `rest`
 * as "key:value" joined by ',' (NUL-terminated), for allocator_settings.  *needed gets the
 * bytes rest needs, NUL included; rest NULL or cap < *needed: INVALID_ARGUMENT ("rest
 * buffer too small: N bytes needed").  On any error *c is unchanged.  Typed fields set
 * between two calls are never parsed (a directory may hold a comma). */
DFA_C_API dfa_status dfa_opt_config_apply_text(dfa_optimizer_config* c, const char* text, char* rest, size_t cap,
                                               size_t* needed);
/* Creates an optimizer from a filled config (dfa_opt_config_init, then the fields to change).
 * Bad values: INVALID_ARGUMENT naming the field's key and its range.  Cost: a driver and
 * three streams. */
DFA_C_API dfa_status dfa_opt_create_with_config(const dfa_optimizer_config* c, dfa_optimizer** out);
/* The same from settings in DEFERALLOC_CONF's grammar ("key:value,..."): the optimizer's
 * keys and the allocator's (driver, device, host_granularity_kb, log_level, ...), all
 * listed in docs/SETTINGS.md.  Unknown keys: INVALID_ARGUMENT listing the valid ones. */
DFA_C_API dfa_status dfa_opt_create(const char* settings, dfa_optimizer** out);
/* Waits for its streams and frees everything.  NULL is allowed. */
DFA_C_API dfa_status dfa_opt_destroy(dfa_optimizer* o);
/* The last error of this thread in the optimizer library ("" after a success). */
DFA_C_API const char* dfa_opt_last_error(void);

/* Registers `numel` parameters of type `dtype` at `param` (device memory; host memory on
 * the host driver) in hyper-parameter group `group` (>= 0); `name` may be NULL.  Before
 * dfa_opt_initialize.  *index gets the shard's index.  Cost: three address reservations. */
DFA_C_API dfa_status dfa_opt_add_shard(dfa_optimizer* o, void* param, size_t numel, dfa_dtype dtype, int group,
                                       const char* name, size_t* index);
/* Sets group `group`'s hyper-parameters (any time between steps).  PyTorch's checks: finite
 * lr >= 0, 0 <= betas < 1, eps >= 0, weight_decay >= 0, else INVALID_ARGUMENT. */
DFA_C_API dfa_status dfa_opt_set_group(dfa_optimizer* o, int group, const dfa_adamw_params* p);
/* main = float(param) for every BF16/FP16 shard, written to the home tier; moments zero.
 * An FP32 parameter is its own main (a step reads and updates it in place, so an edit
 * between steps is what the next step reads; the file tier keeps a durable copy that a
 * resume writes back); nothing is copied.  A BF16/FP16 parameter edited outside the
 * optimizer is taken into its main by its next step where it is not main's rounding (one
 * warning line).  Waits for `stream` first; synchronous. */
DFA_C_API dfa_status dfa_opt_initialize(dfa_optimizer* o, void* stream);
/* One AdamW step: grads[i] is shard i's gradient (NULL: skip shard i, its step count stays),
 * of type grad_dtypes[i] (grad_dtypes NULL: each shard's parameter type); each gradient is
 * multiplied by `scale` first.  n must equal the number of shards.  The parameters are
 * updated in place; `stream` waits for them.  Streamed tiers return when the state is home. */
DFA_C_API dfa_status dfa_opt_step(dfa_optimizer* o, const void* const* grads, size_t n, const int* grad_dtypes,
                                  float scale, void* stream);
/* A speculative step (host and file tiers; optim/optimizer.hpp step_speculative): as dfa_opt_step,
 * but the stepped shards' new state goes into a second pinned copy (allocated at a shard's
 * first speculative step: 2x its pinned host memory; file tier: the inactive slot, and the
 * commit carries the shards not stepped and writes one commit record) and becomes their state only at
 * dfa_opt_commit_speculation (which advances their step counts); dfa_opt_discard_speculation
 * drops it, state and step counts unchanged (BF16/FP16 model parameters keep the speculative
 * values: step again or dfa_opt_sync_model_params; FP32 parameters are put back to their
 * values before the speculative step, which kept them: 4 B/param of pinned memory).  INVALID_STATE: the device tier, a
 * shard with a gradient that is resident or already pending.  While one is pending,
 * dfa_opt_write_state, dfa_opt_set_shard_step, dfa_opt_load_checkpoint and a dfa_opt_step
 * of a pending shard are refused (INVALID_STATE); reads and saves see the committed state. */
DFA_C_API dfa_status dfa_opt_step_speculative(dfa_optimizer* o, const void* const* grads, size_t n,
                                              const int* grad_dtypes, float scale, void* stream);
DFA_C_API dfa_status dfa_opt_commit_speculation(dfa_optimizer* o);
DFA_C_API dfa_status dfa_opt_discard_speculation(dfa_optimizer* o);
/* *out: the shards stepped speculatively and not committed or discarded. */
DFA_C_API dfa_status dfa_opt_speculation_pending(dfa_optimizer* o, size_t* out);
/* *out: 1 when shard `shard` can be stepped speculatively (a streamed host- or file-tier shard;
 * after dfa_opt_initialize, which picks the resident ones), else 0. */
DFA_C_API dfa_status dfa_opt_can_speculate(dfa_optimizer* o, size_t shard, int* out);
/* Writes main into the model parameters of every BF16/FP16 shard; `stream` waits.  FP32
 * parameters are their own main: unchanged, except on the file tier, which writes its
 * durable copy (the last committed step's values) into them (after a resume). */
DFA_C_API dfa_status dfa_opt_sync_model_params(dfa_optimizer* o, void* stream);
/* Copies elements [offset, offset + n) of a shard's state array to/from host memory
 * (synchronous).  The file tier takes whole arrays (offset 0, n = numel).  DFA_STATE_MAIN
 * of an FP32 parameter is the parameter: a read returns its current values (while a
 * speculative step is pending: the values before it), a write writes the parameter at once
 * (file tier: and its durable copy, published with the write). */
DFA_C_API dfa_status dfa_opt_read_state(dfa_optimizer* o, size_t shard, dfa_state_array a, size_t offset, size_t n,
                                        float* out);
DFA_C_API dfa_status dfa_opt_write_state(dfa_optimizer* o, size_t shard, dfa_state_array a, size_t offset, size_t n,
                                         const float* in);
/* PyTorch's per-parameter `step` of a shard.  Setting it needs the state (INVALID_STATE
 * before dfa_opt_initialize, unless a file tier resumed). */
DFA_C_API dfa_status dfa_opt_get_shard_step(dfa_optimizer* o, size_t shard, uint64_t* out);
DFA_C_API dfa_status dfa_opt_set_shard_step(dfa_optimizer* o, size_t shard, uint64_t step);
/* Groups dfa_opt_write_state / dfa_opt_set_shard_step calls into one publish (the file
 * tier commits them at once: a kill leaves the old state or the new); publish 0 drops
 * them (file tier; the host and device tiers keep what was written).  See
 * streamed_adamw::begin_state_write. */
DFA_C_API dfa_status dfa_opt_begin_state_write(dfa_optimizer* o);
DFA_C_API dfa_status dfa_opt_end_state_write(dfa_optimizer* o, int publish);
/* Points a shard at new parameter memory of the same size and type (the model's storage
 * was replaced); the state is unchanged. */
DFA_C_API dfa_status dfa_opt_set_shard_param(dfa_optimizer* o, size_t shard, void* param);
/* The engine's own checkpoint (a directory; see optim/optimizer.hpp). */
DFA_C_API dfa_status dfa_opt_save_checkpoint(dfa_optimizer* o, const char* dir);
DFA_C_API dfa_status dfa_opt_load_checkpoint(dfa_optimizer* o, const char* dir);
/* fn NULL removes the callback. */
DFA_C_API dfa_status dfa_opt_set_progress(dfa_optimizer* o, dfa_progress_fn fn, void* user);
DFA_C_API dfa_status dfa_opt_get_stats(dfa_optimizer* o, dfa_optimizer_stats* out);

#ifdef __cplusplus
}
#endif
#endif /* DEFERALLOC_OPTIMIZER_H */
