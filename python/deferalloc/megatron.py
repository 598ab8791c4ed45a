"""megatron-core's DistributedOptimizer with its FP32 main params and Adam moments in deferalloc.

``deferalloc.megatron.stream_optimizer_state(optimizer, tier="host", ...)`` is called once,
after ``get_megatron_optimizer`` (or a DistributedOptimizer built by hand).  From then on
the FP32 main params and both moments of every DistributedOptimizer in ``optimizer`` live in
the streamed engine (libdeferalloc_optimizer.so through ``deferalloc.optim``): pinned host
memory, a file, or HBM, streamed through a fixed HBM window at each step, and no HBM between
steps.  Tested on megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (``TESTED_VERSIONS``; another
version is refused at the call, see Note [megatron-core versions]).  With
``step_in_backward=True`` each DDP bucket group's shards are stepped inside Megatron's backward,
as soon as its reduce-scatter has finished (Note [The step inside Megatron's backward]);
``step_in_backward="auto"`` times both ways and keeps the faster (Note [Stepping aside]);
``step_overlap_forward=True`` (with DDP's ``overlap_param_gather``) lets those steps run on
into the next forward (Note [The step across the next forward]).

Note [megatron-core versions]
Rationale: the integration binds six DistributedOptimizer methods and reads its shard lists
(``shard_fp32_from_float16_groups``, ``model_param_group_index_map``, ``opt_group_ranges``'
``orig_group``), internals megatron-core may change in any release; a version nobody ran
would fail silently or far from the cause, so a version outside ``TESTED_VERSIONS`` is
refused with the list.
Approach: one code path.  Read side by side (optimizer/distrib_optimizer.py,
optimizer/__init__.py, optimizer/optimizer.py, distributed/) 0.16.1 to 0.19.2 keep every
internal used here: the construction of a main param (``shard_model_param.clone().float()``
in ``_build_model_and_main_param_groups``), the group layout, the six methods' signatures
and the inner torch Adam/AdamW.  What differs is a small ``_Adapter`` per version:
``quantized`` (0.19 adds grouped quantized and NVFP4 params to FP8 ones; all refused).
Whether OptimizerConfig carries ``defer_main_param_initialization`` is looked up on the
config, not the version (no release up to 0.19.2 does; patched Megatrons do).  The tests
run on every tested version (one ctest test each, CPU emulation).
Limits: a new megatron-core needs its row in ``_ADAPTERS`` after its tests pass;
``DEFERALLOC_MEGATRON_UNTESTED=1`` lets an untested version through with a warning (for
trying one, never for production).

Note [Megatron's step with a streamed inner optimizer]
Rationale: DistributedOptimizer.step is prepare_grads (copy the reduce-scattered grad shards
to ``main_param.grad``, unscale and check for inf with the grad scaler), clip_grad_norm
(scales those ``.grad`` tensors in place by Megatron's clip coefficient), the inner
``optimizer.step()``, ``_copy_main_params_to_model_params`` (BF16(main) into the param
buffer) and the param all-gather.  Everything but the inner step and the two main-param
copies stays Megatron's, so gradient reduction, loss scaling, clipping, the all-gather and
their communicators are untouched; the engine reads the very ``.grad`` tensors Megatron's
own Adam would read (already unscaled and clipped, so it is called with scale 1) and the
arithmetic is torch._fused_adamw_'s.
Approach: the inner torch Adam/AdamW is replaced by ``StreamedMegatronAdamW``, a
StreamedAdamW whose torch-side parameters are Megatron's main-param objects and whose engine
side is the BF16 (or FP16) model shard in the param buffer: the engine writes BF16(main)
straight into the param buffer, so ``_copy_main_params_to_model_params`` has nothing left to
do and is bypassed.  Megatron's FP32 main tensors are replaced by handles: deferalloc
reservations (``deferred_empty``; views of one, or one each when made at construction) with the shard's shape, dtype, device and tensor-
parallel attributes, a stable address and no memory.  They carry ``.grad`` for Megatron;
their values are the engine's (reading one faults: ``optimizer.main_param_shard`` reads
through the engine instead).  FP32 model params keep Megatron's layout: their main copy is
the param itself and the engine streams only their moments.
Construction, two routes (Note [Megatron's deferred main params]).  Released megatron-core
makes the FP32 main copies in DistributedOptimizer.__init__ (``shard.clone().float()``) and
has no ``defer_main_param_initialization`` option.  Built inside ``deferred_main_params()``,
those become handles from the start (Megatron's own builder runs, with ``Tensor.clone`` of
16-bit tensors answering a handle for ``.float()``), so no FP32 copy ever exists and the
main-param objects keep their construction addresses; built outside, this call frees the
copies (resident only between construction and the call).
Limits: refused: Megatron FSDP, precision-aware optimizer, FP8 params,
CPU offload (HybridDeviceOptimizer), SGD, Adam with L2 weight decay (torch.optim.Adam with
weight_decay > 0), amsgrad.  Code outside megatron-core that reads ``param.main_param``
values (Megatron-LM's --log-params-norm) must not be used.

Note [Megatron's deferred main params]
Rationale: a Megatron whose OptimizerConfig has ``defer_main_param_initialization`` (patched
Megatrons of RL stacks; no megatron-core release up to 0.19.2) makes each FP32 main param
as a handle itself: an FP32 CUDA tensor with the shard's shape, its storage released
(``untyped_storage().nbytes() == 0``), the same object in ``model_param.main_param`` and the
inner optimizer's groups, its initialisation left to an external state backend.  Code
around such a Megatron (its checkpoint hooks, its own backend's tests) holds those objects,
so they must stay the main params: identity kept.
Approach: with the option set, ``stream_optimizer_state`` takes Megatron's handles as the
engine's torch-side parameters unchanged (no reservation is made, nothing replaced; the
engine initialises main = float(model shard) as on the other route) and checks that each
one's storage is released; ``deferred_main_params()`` then changes nothing (Megatron
defers by itself).  Without the option, ``deferred_main_params()`` makes deferalloc
handles at construction.  Both routes hand the engine the same shards in the same order
and give the same bits (test_megatron_handles.py).
Limits: with the option, a main param whose storage is not released is refused (a
Megatron that deferred only part of them is not one this was written against).

Note [The window and torch's cache]
Rationale: the step's window (``window_mb``) is mapped by the engine, outside torch's caching
allocator, while torch keeps the blocks the finished forward and backward freed cached:
the window then stacks on top of them, so peak HBM is Megatron's without its 12 B/param plus
the whole window.  With ``release_torch_cache=True`` each streamed step first calls
torch.cuda.empty_cache(): the window takes HBM the activations gave back, and the peak is
max(forward/backward, model + grads + window).  Cost: torch's empty_cache (a device
synchronisation and a cudaFree per free segment) in the step, and cudaMalloc again in the
next forward; off by default.

Note [The step inside Megatron's backward]
Rationale: with DDP's ``overlap_grad_reduce`` Megatron reduce-scatters each bucket group's
grads as soon as backward has produced them, but the optimizer step, the host tier's 12 B/param
each way over PCIe, starts only after backward: it adds its whole length to every iteration.
A shard's step needs only its own reduced grad, so it can run while backward computes the
others' (deferalloc.overlap does this for plain torch models).
Approach: ``stream_optimizer_state(..., step_in_backward=True)`` drives deferalloc.overlap's
BackwardOverlap (its worker, engine calls, speculation, clip policy and per-bucket waits; Note
[Overlap with backward]) with one bucket per DDP bucket group (the shards this rank's
DistributedOptimizer holds of the group's params) instead of its own gradient hooks:
 - each ``_ParamAndGradBucketGroup.start_grad_sync`` of the model chunks is wrapped: after
   Megatron dispatched the group's reduce-scatter, the bucket is queued with that
   collective's handle.  The worker waits for the handle (its side stream waits for the
   NCCL work, the host does not block; another backend's is waited when the bucket is
   queued: Note [A reduce-scatter waited twice]) and makes the shards' main grads exactly as
   ``_copy_model_grads_to_main_grads`` does (``main_grad`` shard ``.float()``), then steps
   them (null grads for every other shard: the plain step's arithmetic and step counts).
   No communication of its own: Megatron's reduce-scatter, on Megatron's communicator.
   (0.19's promoted FP32 main grads are read from the reduced comm buffer, the values
   Megatron's finish_grad_sync copies back.)
 - Megatron's step: the worker goes on stepping the queued buckets while Megatron prepares,
   norms and clips the grads before the inner step (the last bucket group's pass starts when
   its grads are done, not after Megatron's norm).  Beside the passes Megatron's step only
   reads the grads (``prepare_grads`` takes views or FP32 copies; a grad scaler, which would
   unscale them in place, is refused) or multiplies them in place by min(coefficient, 1)
   (0.17 on, where the norm is a GPU tensor: every iteration), which is by exactly 1.0 unless
   clipping fires; then every pass of that iteration is speculative and discarded (below),
   so a pass that read them mid-scale is redone from the clipped grads.  (A worker paused
   through Megatron's step leaves the link idle for as long as Megatron's norm takes.)
 - clipping: Megatron computes the norm (over the DP and model-parallel groups) after
   backward.  ``clip_grad_norm`` (a DistributedOptimizer's) or ``get_grad_norm`` (a
   ChainedOptimizer's) is wrapped to record the norm; the inner step (called by Megatron's
   ``step_with_ready_grads`` after it clipped) applies Megatron's own rule, clip_coeff =
   clip_grad / (norm + 1e-6) < 1.0 (and 0.19's separate grad-norm groups).  Not fired: the
   speculative steps are committed (Megatron left the grads' values unchanged).  Fired: the
   speculation is discarded and every bucket stepped again from Megatron's clipped grads.
   Whether to speculate is deferalloc.overlap's policy (``clip_policy``, "auto" by default:
   speculate while clipping fired in fewer than a quarter of the recent iterations; held
   buckets are stepped after Megatron's clip).  Without clipping (clip_grad 0) every
   bucket is stepped plainly during backward.
 - each bucket group's ``start_param_sync`` (the param all-gather: in the step without
   ``overlap_param_gather``, in the next forward's pre-hook with it) first waits for that
   group's own bucket only.  Each DDP chunk's ``zero_grad_buffer`` first waits for every
   step (they read the grad buffer it zeroes).  Reading or writing the state
   (checkpoints, ``read_shard``) waits for them too.
Limits: Megatron's ``zero_grad_buffer`` zeroes the whole grad buffer before the next forward,
so with ``overlap_param_gather`` the next forward starts only after every bucket's step:
the step overlaps backward and the grad sync, not the next forward, unless
``step_overlap_forward=True`` (Note [The step across the next forward]).  The first iteration
(Megatron's first batch dispatches every reduce-scatter at ``finish_grad_sync``) and any
iteration where clipping fires while speculating step after backward.  Refused: a grad
scaler (FP16 / loss scale: a skipped step), ``grad_norm_skip_threshold``, more than one
distributed-optimizer instance, ``reduce_scatter_with_fp32_accumulation``.  Bucket groups whose
grads ``finalize_model_grads`` changes after the reduce-scatters (a tied embedding at pipeline
parallelism > 1, sequence-parallel or qk-layernorm grads at tensor parallelism > 1, every group
under per-token loss) are stepped after finalize (Note [Grads finalize changes]).  Speculation on the host tier holds a second pinned copy of
the state (12 B/param more pinned host memory).  Without ``overlap_grad_reduce`` the reduce-
scatters (and so the steps) start at ``finish_grad_sync``, after backward.

Note [Stepping aside]
Rationale: whether stepping inside backward pays depends on the model, the buckets, the tier
and the machine: bucket by bucket, each engine pass fills and drains its own pipeline and
competes with backward for the GPU, and where that costs more than the overlap saves the
plain step after backward is faster.  The user cannot know which beforehand, and both give
the same bits, so the choice can be made per iteration from measurements.
Approach: ``step_in_backward="auto"`` attaches everything ``True`` does, but each iteration is
either inside backward (the hooks above queue the buckets) or plain (the wrapped Megatron
methods pass straight through, the inner step is the plain streamed step); a ``_StepAside``
shared by the chain's DistributedOptimizers picks it, at the end of Megatron's
``optimizer.step()`` (wrapped), for the next iteration:
 - warm-up: the first ``warmup`` (2) iterations plain (Megatron's first batch reduce-
   scatters everything at ``finish_grad_sync``);
 - a probe: ``run`` (3) iterations of the current mode, then ``run`` of the other; each is
   timed from the previous optimizer step's end to its own, by the host clock
   (``time.perf_counter``, the ``clock`` attribute) read after every step in flight and the
   device are done (``synchronize()``, ``torch.cuda.synchronize()``: in probe iterations
   only; an iteration outside a probe adds no synchronisation).  The first iteration of each
   run is not timed (it carries the switch); the run of a mode never run before gets
   ``settle`` (2) more untimed iterations first, as its first iterations carry one-off costs
   that can span more than one of them (on an H100, the 0.54 G model's first inside
   iterations across the next forward took 451, 1826 and 375 ms, then 190: the second pinned
   copy allocated at the first speculation, the first speculation's redo); each mode's time
   is the minimum of its timed ones (noise only lengthens an iteration).  The faster mode is
   kept (a tie keeps the plain step);
 - a probe again every ``recheck`` (1000) iterations (0: never): the costs move with what
   else shares the link and with how often clipping fires (a fired speculation is redone),
   and a probe costs at most ``run`` iterations of the slower mode (``run`` + ``settle`` at
   the first) plus 2 * ``run`` + ``settle`` + 1 synchronised step ends, a fraction of a
   percent of 1000 iterations.
A switch (between two iterations) first waits for every bucket step and commit in flight
and clears the recorded norm; the engine's state, step counts and the speculation are the
same either way, so a run that switches gives the bits of either mode
(test_megatron_step_aside).  ``backward_step.stats()["step_aside"]``: the mode, the last
choice, the last probe's seconds per mode, iterations per mode, probes and switches; each
new choice is logged once at INFO on the ``deferalloc`` logger.
Limits: the choice is as good as the probe's iterations are typical (an iteration with a
checkpoint save or evaluation inside a probe skews it); a mode whose advantage is under the
noise of a few iterations may be chosen either way.  The timed interval ends with every
step done, which is where the inside mode's iteration ends (``zero_grad_buffer`` waits for
every step); with ``step_overlap_forward`` the step ends inside the next forward, so the
probe times whole iterations instead (Note [The step across the next forward]).  The
refusals of ``step_in_backward=True`` apply ("auto" may step inside backward).

Note [The step across the next forward]
Rationale: on the host tier the state's transfer (12 B/param each way) can be several times
longer than backward; stepped inside backward, most of it still runs after backward, and
with the note above the next forward waits for all of it (Megatron's ``zero_grad_buffer``
zeroes every grad the steps still read).  A bucket group's step and its grads' zeroing are
needed only by that group's param all-gather in the next forward (``overlap_param_gather``)
and by that group's grad accumulation in the next backward, which comes after it.
Approach: ``stream_optimizer_state(..., step_in_backward=True or "auto",
step_overlap_forward=True)``:
 - ``optimizer.step()`` returns once every bucket is queued with its clip coefficient known
   (the inner step settles the speculation as above: committed, or discarded and every
   bucket queued again from Megatron's clipped grads; held buckets queued), without waiting
   for the passes.  Once backward has ended the worker takes the queued buckets in the
   order the next forward needs them (each bucket's ``order``: the first model chunk first,
   within a chunk its last bucket group first, the reverse of Megatron's build order).
 - each DDP chunk's ``zero_grad_buffer`` does not wait for the steps: Megatron's own method
   runs at once with each grad buffer's ``reset`` a no-op (its bookkeeping:
   ``grad_added_to_main_grad``, each bucket group's ``reset``), then each bucket group's grads
   (its buckets' ``grad_data``) are zeroed on the worker right after that group's queued step
   (``run_after``: on the side stream, after the compute stream's work queued before the call,
   such as finalize_model_grads' in-place all-reduces, and before the bucket's done event), or
   at once when none is queued; a group with no shard on this rank and the buffer's parts
   outside every bucket are zeroed at once.  It does wait in three cases: the boundary of an
   "auto" probe iteration (a device synchronisation), a mode switch of "auto" (every step in
   flight), and a chunk with 0.19's separate FP32 main grads (the waiting path, below).
 - each bucket group's ``start_param_sync`` (called by the forward pre-hook's
   ``finish_param_sync``) waits for that group's bucket, which now covers its step and its
   zeroing: the next backward accumulates into zeroed grads that no step reads any more.
   Megatron's ``finish_param_sync`` also dispatches the next bucket group's all-gather, so a
   module's forward waits for its own group's step and for the next group's.
 - DDP's ``offload_grad_buffers`` / ``restore_grad_buffers`` (0.19's colocation API: they
   free and reallocate the grad buffers) wait for every step first;
   ``deferalloc.megatron.synchronize(optimizer)`` waits for them in any other code that reads
   the params or the grad buffers directly.
 - the engine keeps its window backed between passes (``keep_window:1`` is added to the
   settings unless they name keep_window): an iteration's bucket passes run back to back (with
   ``pass_chain:1`` on the host tier each returns with its last write-backs in flight, the next
   one filling while it drains: Note [Chained passes] in optimizer/window_pipeline.cpp; with
   ``writeback_queue_mb:N`` a pass keeps at most N MiB of write-backs queued on the copy engine,
   so that the training thread's reads of the norm and the loss wait behind less: Note [The
   write-back queue], same file; both off by default: timed on an H100 without a gain,
   docs/BENCHMARKS.md).
 - ``coalesce`` (BackwardOverlap's, Note [Overlap with backward]; also with
   ``step_in_backward`` alone): the worker puts up to k queued bucket groups whose grads are
   done into one engine pass (True or 0: all of them), the k with the smallest ``order`` (the
   ones the next forward needs first), so that an iteration's passes fill and drain the
   engine's pipeline fewer times.  The cost: a bucket group's param all-gather, and so its
   module's forward, waits for the end of the whole pass it is in.  The host tier's default
   stays one bucket group a pass.
 - ``step_in_backward="auto"`` times whole iterations: a boundary is the first
   ``zero_grad_buffer`` after an optimizer step (the next iteration's start), read after
   the device's work is done but without waiting for the steps; the probe's plan, choice
   rule and switches are those of Note [Stepping aside], taken at that boundary.
 - ``dopt.zero_grad(set_to_none=False)`` (zeroes the ``.grad`` tensors queued steps read)
   and ``state_dict`` / ``load_state_dict`` of any module of the model chunks (the params
   the steps write) wait for every step; reading or writing the optimizer state waits as
   before.
Limits: needs DDP's ``overlap_param_gather`` (without it Megatron all-gathers the params
inside ``optimizer.step()``, which would have to wait for every step: refused, as is a chain
of several DistributedOptimizers, whose bucket groups' zeroing would follow several workers).
A chunk whose grad buffers carry 0.19's separate FP32 main grads (``extra_main_grads``)
zeroes through the waiting path.  Megatron's ``finish_param_sync`` dispatches the next
bucket group's all-gather, so a module's forward also waits for the step of the group after
its own (above).  The window stays backed between iterations too (``window_mb`` of HBM held through
forward and backward; ``settings="keep_window:0"`` gives it back after each pass).  "auto"
needs the training loop to call ``zero_grad_buffer`` each iteration (Megatron's does).  A
direct read of the params or grads (not through ``state_dict``) before the next forward
reaches them may see a step in progress: call ``deferalloc.megatron.synchronize(optimizer)``
first.

Note [Megatron checkpoints through the engine]
DistributedOptimizer reaches its parameter state through two methods,
``_get_main_param_and_optimizer_states`` and ``_set_main_param_and_optimizer_states``; every
checkpoint format (dp_reshardable; fully_reshardable; dp_zero via save/load_parameter_state;
fully_sharded_model_space, ``sharded_state_dict``'s default, which 0.16.1's own
dist-checkpointing rejects: "flattened_range is not supported") is built on them.  They are
bound here to read the shard's three FP32 arrays from the tier into CPU tensors and to write
them back (FP32 whatever ``moment_dtype``: the engine decodes and encodes compressed moments,
so a checkpoint loads into another format), so Megatron's dist-checkpointing saves and loads
real state, also at another data-parallel size (dp_reshardable and fully_reshardable, tested DP 1 -> 2 -> 1).  While a sharded state dict
is being built for loading, the read returns uninitialised CPU tensors of the right size
instead (they are only load targets).  The inner optimizer's own ``state_dict`` carries the
hyper-parameters and ``step`` (all Megatron keeps from it).  ``save_engine_checkpoint`` /
``load_engine_checkpoint`` (module functions) are the engine's raw fast path, for the same
layout only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
import types
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from . import deferred_empty
from . import _native
from ._logging import logger
from .optim import InvalidArgumentError, InvalidStateError, StreamedAdamW, resident_budgets
from .overlap import BackwardOverlap, clip_fired

__all__ = ["stream_optimizer_state", "deferred_main_params", "StreamedMegatronAdamW", "TESTED_VERSIONS",
           "megatron_core_version",
           "streamed_optimizers", "save_engine_checkpoint", "load_engine_checkpoint", "megatron_defers_main_params",
           "synchronize"]


@dataclasses.dataclass(frozen=True)
class _Adapter:
    """What differs between the tested megatron-core versions (Note [megatron-core versions])."""
    version: str
    quantized: Callable[[Any, torch.Tensor], bool]  # (DistributedOptimizer, model param) -> refused


def _fp8(dopt, p) -> bool:
    from megatron.core.fp8_utils import is_float8tensor
    return is_float8tensor(p)


def _fp8_grouped_or_nvfp4(dopt, p) -> bool:
    # 0.19: DistributedOptimizer._is_distopt_quantized_param (FP8 or grouped quantized
    # storage) and NVFP4 params take their own construction path.
    from megatron.core.fp4_utils import is_nvfp4tensor
    return type(dopt)._is_distopt_quantized_param(p) or is_nvfp4tensor(p)


_ADAPTERS = {a.version: a for a in (
    _Adapter("0.16.1", _fp8),
    _Adapter("0.17.1", _fp8),
    _Adapter("0.18.2", _fp8),
    _Adapter("0.19.2", _fp8_grouped_or_nvfp4),
)}
TESTED_VERSIONS = tuple(_ADAPTERS)
_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # Megatron's names of the state arrays
_ENGINE_KEYS = {"param": "main_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


class StreamedMegatronAdamW(StreamedAdamW):
    """The inner optimizer of a streamed DistributedOptimizer (see Note [Megatron's step with
    a streamed inner optimizer]): torch-side parameters are main-param handles, the engine
    updates ``targets[handle]`` (the model shard) in place.

    ``state_dict()`` holds the hyper-parameters and each parameter's ``step`` only;
    ``load_state_dict`` takes those (tensors in the given state are ignored: Megatron loads
    them through the DistributedOptimizer, see Note [Megatron checkpoints through the
    engine]).  ``state`` keeps one ``{"step": tensor}`` per parameter, so Megatron sees an
    initialised optimizer and allocates no placeholder state on the GPU when it loads.
    """

    state_view = False  # self.state holds each handle's step, for Megatron (see state_dict)
    backward_step = None  # the _BackwardStep stepping this optimizer inside Megatron's backward

    def __init__(self, params: Iterable, targets: dict[torch.Tensor, torch.Tensor], *,
                 release_torch_cache: bool = False, **kwargs):
        self._targets = targets
        self.release_torch_cache = release_torch_cache
        super().__init__(params, **kwargs)
        self._refresh_steps()

    @torch.no_grad()
    def step(self, closure=None):
        if self.backward_step is not None and self.backward_step.active:  # Note [The step inside Megatron's backward]
            return self.backward_step.end_iteration()
        # See Note [The window and torch's cache].
        if self.release_torch_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return super().step(closure)

    def engine_tensor(self, p: torch.Tensor) -> torch.Tensor:
        return self._targets.get(p, p)

    def _refresh_steps(self) -> None:
        for p in self.held_params:
            self.state[p] = {"step": torch.tensor(float(self.shard_step(p)))}

    def _settled(self) -> None:
        """Waits for the steps inside backward still in flight (the state is read or written)."""
        if self.backward_step is not None:
            self.backward_step.synchronize()

    def state_dict(self) -> dict[str, Any]:
        self._settled()
        self._refresh_steps()
        return torch.optim.Optimizer.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(o["params"]) for g, o in zip(groups, self.param_groups)):
            raise InvalidArgumentError("StreamedMegatronAdamW.load_state_dict: the parameter groups do not match")
        # The steps are checked before anything changes: a bad one (2.5, -1, NaN) is refused
        # with the optimizer as it was, never truncated.
        saved = state_dict.get("state", {})
        steps = [(p, _native.checked_step(saved[pid]["step"], f"StreamedMegatronAdamW.load_state_dict: state {pid}"))
                 for g, o in zip(groups, self.param_groups) for pid, p in zip(g["params"], o["params"])
                 if "step" in (saved.get(pid) or {})]
        self._settled()
        torch.optim.Optimizer.load_state_dict(self, {"state": {}, "param_groups": groups})
        self.initialize_state()
        for p, step in steps:
            self.set_shard_step(p, step)
        self.sync_hyperparameters()
        self._refresh_steps()

    def read_shard(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Main param, exp_avg and exp_avg_sq of handle ``p`` as FP32 CPU tensors (read now)."""
        self._settled()
        st = self.read_shard_state(p)
        return {k: st[_ENGINE_KEYS[k]] for k in _STATE_KEYS}

    def write_shard(self, p: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Writes those of main param / exp_avg / exp_avg_sq that ``tensors`` holds."""
        self._settled()
        self.write_shard_state(p, {_ENGINE_KEYS[k]: t for k, t in tensors.items() if k in _STATE_KEYS})


# ---- the call ------------------------------------------------------------------------------

def streamed_optimizers(optimizer) -> list:
    """The DistributedOptimizers of ``optimizer`` (itself, or those of a ChainedOptimizer)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def synchronize(optimizer) -> None:
    """Waits until every bucket step queued inside backward (``step_in_backward``) of each
    streamed DistributedOptimizer of ``optimizer`` is done, with the grads they read zeroed
    where ``zero_grad_buffer`` queued that (the current stream waits for them): for code that
    reads or frees the params or the grad buffers directly, outside the paths that already
    wait (Note [The step across the next forward]).  Without steps inside backward: nothing."""
    for dopt in streamed_optimizers(optimizer):
        st = getattr(getattr(dopt, "optimizer", None), "backward_step", None)
        if isinstance(st, _BackwardStep):
            st.synchronize()


def megatron_core_version() -> str:
    """The installed megatron-core's release, without the local part: from 0.18 on its
    ``__version__`` appends ``+<commit>`` of whatever git repository its files sit in (its
    package_info runs ``git rev-parse`` in its own directory), also for an installed wheel."""
    import megatron.core
    return str(getattr(megatron.core, "__version__", "?")).split("+")[0]


def _adapter() -> _Adapter:
    """The installed megatron-core's adapter; refuses an untested version (Note
    [megatron-core versions])."""
    version = megatron_core_version()
    adapter = _ADAPTERS.get(version)
    if adapter is not None:
        return adapter
    tested = ", ".join(TESTED_VERSIONS)
    if os.environ.get("DEFERALLOC_MEGATRON_UNTESTED") == "1":
        warnings.warn(f"deferalloc.megatron: megatron-core {version} is untested (tested: {tested}); "
                      f"DEFERALLOC_MEGATRON_UNTESTED=1 lets it through with {TESTED_VERSIONS[-1]}'s adapter")
        return dataclasses.replace(_ADAPTERS[TESTED_VERSIONS[-1]], version=version)
    raise InvalidStateError(f"deferalloc.megatron: megatron-core {version} found; the tested versions are {tested} "
                               f"(DEFERALLOC_MEGATRON_UNTESTED=1 tries another, unsupported)")


def megatron_defers_main_params(config) -> bool:
    """Whether ``config`` (an OptimizerConfig) asks Megatron for its own main-param handles
    (``defer_main_param_initialization``, Note [Megatron's deferred main params])."""
    return bool(getattr(config, "defer_main_param_initialization", False))


def _refuse_if_unsupported(dopt, inner, adapter: _Adapter) -> None:
    cfg = dopt.config
    why = None
    if getattr(dopt, "is_stub_optimizer", False):
        why = "a stub optimizer (no parameters on this rank)"
    elif dopt.ddp_config.use_megatron_fsdp:
        why = "Megatron FSDP"
    elif cfg.use_precision_aware_optimizer or getattr(cfg, "optimizer_cpu_offload", False):
        why = "the precision-aware optimizer / CPU offload"
    elif getattr(cfg, "fp8_recipe", None) and getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        why = "MXFP8 params"
    elif not isinstance(inner, (torch.optim.AdamW, torch.optim.Adam)) or type(inner) not in (
            torch.optim.AdamW, torch.optim.Adam):
        why = f"inner optimizer {type(inner).__name__} (torch Adam / AdamW expected)"
    elif type(inner) is torch.optim.Adam and any(g["weight_decay"] != 0 for g in inner.param_groups):
        why = "torch.optim.Adam with L2 weight decay (decoupled_weight_decay=False); the engine is AdamW"
    elif any(g.get("amsgrad") or g.get("maximize") for g in inner.param_groups):
        why = "amsgrad / maximize"
    if why is None and any(adapter.quantized(dopt, p) for g in dopt.model_float16_groups for p in g):
        why = "FP8 / quantized params"
    if why:
        raise InvalidArgumentError(f"deferalloc.megatron.stream_optimizer_state: {why} is not supported")


_HANDLE_ATTR = "_deferalloc_main_handle"


def _is_handle(t: torch.Tensor) -> bool:
    return getattr(t, _HANDLE_ATTR, False)


class _DeferredClone:
    """What ``Tensor.clone`` returns for a 16-bit tensor inside deferred_main_params: its
    ``float()`` is a main-param handle (a reservation of the shard's size, no memory)."""

    def __init__(self, source: torch.Tensor):
        self.source = source

    def float(self) -> torch.Tensor:
        h = deferred_empty(self.source.shape, torch.float32, self.source.device)
        setattr(h, _HANDLE_ATTR, True)
        return h

    def __getattr__(self, name):
        raise InvalidStateError(f"deferalloc.megatron.deferred_main_params: Megatron used a 16-bit shard's clone "
                                   f"for .{name} (only .float() is expected, megatron-core {', '.join(TESTED_VERSIONS)})")


@contextlib.contextmanager
def deferred_main_params() -> Iterator[None]:
    """Within the block, a DistributedOptimizer built for BF16/FP16 params makes its FP32
    main params as deferalloc handles (one address reservation each, no memory) instead of
    FP32 copies of the model shards, so neither a shard's FP32 copy nor its BF16 clone ever
    exists in HBM; ``stream_optimizer_state`` must then be called before anything reads
    the main params (it keeps these handles: the main-param objects and their addresses are
    those of construction).  Megatron's own ``_build_model_and_main_param_groups`` runs; only
    ``Tensor.clone`` of a 16-bit CUDA tensor is changed, on this thread, during that call.
    For a config with ``defer_main_param_initialization`` set, nothing changes: Megatron
    makes its own handles (Note [Megatron's deferred main params]).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    tensor_clone = torch.Tensor.clone
    owner = threading.get_ident()

    def clone(self, *args, **kwargs):
        if (threading.get_ident() == owner and not args and not kwargs
                and self.dtype in (torch.bfloat16, torch.float16)):
            return _DeferredClone(self)
        return tensor_clone(self, *args, **kwargs)

    own_clone = "clone" in torch.Tensor.__dict__  # else inherited from TensorBase

    def build(cls, *args, **kwargs):
        config = kwargs.get("config", args[-1] if args else None)
        if megatron_defers_main_params(config):
            return original.__func__(cls, *args, **kwargs)
        torch.Tensor.clone = clone
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            if own_clone:
                torch.Tensor.clone = tensor_clone
            else:
                del torch.Tensor.clone

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)
    try:
        yield
    finally:
        DistributedOptimizer._build_model_and_main_param_groups = original


def _copy_tensor_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    # Megatron keeps tensor-parallel attributes and `shared` in a tensor's __dict__.
    for k, v in vars(src).items():
        setattr(dst, k, v)


def _megatron_handles(dopt) -> bool:
    """Whether Megatron made the main params as handles itself; checks that it did for each."""
    if not megatron_defers_main_params(dopt.config):
        return False
    kept = [m for g in dopt.shard_fp32_from_float16_groups for m in g if not _is_handle(m)]
    if any(m.untyped_storage().nbytes() != 0 for m in kept):
        raise InvalidStateError("deferalloc.megatron.stream_optimizer_state: defer_main_param_initialization is set "
                                   "but a main param holds storage (Note [Megatron's deferred main params])")
    return True


def _stream_one(dopt, engine: dict, release_torch_cache, adapter):
    """``dopt``'s inner optimizer replaced by a StreamedMegatronAdamW with the options
    ``engine`` (StreamedAdamW's keywords)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(dopt, DistributedOptimizer):
        raise InvalidArgumentError(f"deferalloc.megatron.stream_optimizer_state: {type(dopt).__name__} is not a "
                                      f"DistributedOptimizer (set use_distributed_optimizer=True)")
    inner = dopt.optimizer
    if isinstance(inner, StreamedMegatronAdamW):
        raise InvalidStateError("deferalloc.megatron.stream_optimizer_state: already streamed")
    _refuse_if_unsupported(dopt, inner, adapter)
    megatron_handles = _megatron_handles(dopt)

    def kept(main: torch.Tensor) -> bool:  # a handle already: ours from construction, or Megatron's
        return megatron_handles or _is_handle(main)

    n_main = sum(p.numel() for g in dopt.shard_fp32_from_float16_groups for p in g if not kept(p))
    some = next((p for g in dopt.shard_float16_groups + dopt.shard_fp32_groups for p in g), None)
    if some is None:
        raise InvalidArgumentError("deferalloc.megatron.stream_optimizer_state: no parameter shards")
    base = deferred_empty((n_main,), torch.float32, some.device) if n_main else None

    # Build everything beside Megatron's objects first; they change only once it all worked.
    targets: dict[torch.Tensor, torch.Tensor] = {}
    replaced: dict[torch.Tensor, torch.Tensor] = {}   # Megatron's FP32 main -> its handle
    new_groups = []
    offset = 0
    for gi, group in enumerate(inner.param_groups):
        fp32_shards = dopt.shard_fp32_groups[gi]
        mains = dopt.shard_fp32_from_float16_groups[gi]
        if list(map(id, group["params"])) != list(map(id, [*fp32_shards, *mains])):
            raise InvalidStateError("deferalloc.megatron.stream_optimizer_state: the inner optimizer's group "
                                       f"{gi} is not [shard_fp32, shard_fp32_from_float16] (a megatron-core layout "
                                       f"other than {adapter.version}'s)")
        handles = []
        for main, shard in zip(mains, dopt.shard_float16_groups[gi]):
            if kept(main):  # made at construction (deferred_main_params or Megatron's option): kept
                handle = main
            else:
                handle = base[offset:offset + main.numel()].view(main.shape)
                offset += main.numel()
                _copy_tensor_attributes(main, handle)
            targets[handle] = shard
            replaced[main] = handle
            handles.append(handle)
        new_groups.append({**group, "params": [*fp32_shards, *handles]})

    defaults = {k: inner.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    if type(inner) is torch.optim.Adam:
        defaults["weight_decay"] = 0.0
        for g in new_groups:
            g["weight_decay"] = 0.0
    streamed = StreamedMegatronAdamW(new_groups, targets, **defaults, **engine,
                                     release_torch_cache=release_torch_cache)
    # main = float(model shard), window by window; the moments start at zero.  An optimizer
    # that already stepped (or loaded) hands over its state.
    streamed.initialize_state()
    for old, st in inner.state.items():
        if not st:
            continue
        p = replaced.get(old, old)
        streamed.write_shard(p, {"param": old if old in replaced and not kept(old) else None,
                                 "exp_avg": st.get("exp_avg"), "exp_avg_sq": st.get("exp_avg_sq")})
        if "step" in st:
            streamed.set_shard_step(p, _native.checked_step(st["step"], "stream_optimizer_state"))
    streamed._refresh_steps()

    # Commit: Megatron's main-param objects become the handles, the old FP32 copies go.
    for gi, g in enumerate(streamed.param_groups):
        mains = dopt.shard_fp32_from_float16_groups[gi]
        n_fp32 = len(dopt.shard_fp32_groups[gi])
        for k, model_param in enumerate(dopt.model_float16_groups[gi]):
            mains[k] = g["params"][n_fp32 + k]
            model_param.main_param = mains[k]
        # Megatron keeps the group dict it handed to the inner optimizer under two keys; the
        # old dicts list the FP32 copies, which must not stay referenced.
        for key in ("orig_group", "orig_group_idx"):
            if key in dopt.opt_group_ranges[gi]:
                dopt.opt_group_ranges[gi][key] = g
    dopt.optimizer = streamed
    _bind(dopt)
    return streamed


# ---- the DistributedOptimizer methods bound to the engine ----------------------------------

def _handle_of(self, model_param):
    gi, go = self.model_param_group_index_map[model_param]
    return self.optimizer.param_groups[gi]["params"][go]


def _get_main_param_and_optimizer_states(self, model_param):
    h = _handle_of(self, model_param)
    if getattr(self, "_dfa_loading", False):
        return {k: torch.empty(h.shape, dtype=torch.float32) for k in _STATE_KEYS}
    return self.optimizer.read_shard(h)


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    self.optimizer.write_shard(_handle_of(self, model_param), tensors)


def _sharded_state_dict(self, *args, **kwargs):
    is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
    self._dfa_loading = bool(is_loading)
    try:
        return type(self).sharded_state_dict(self, *args, **kwargs)
    finally:
        self._dfa_loading = False


def _copy_main_params_to_model_params(self):
    # The engine wrote BF16(main) into the param buffer during the step.
    return None


def _copy_model_params_to_main_params(self, state_dict=None):
    """main = float(model param shard) (or of the state_dict's tensor for it), per shard through
    host memory: no HBM beyond the BF16 shard being read."""
    source = self._build_model_param_to_state_dict_param_map(state_dict) if state_dict is not None else {}
    for model_groups in (self.model_float16_groups, self.model_fp32_groups):
        for group in model_groups:
            for model_param in group:
                rng = self._get_model_param_range_map(model_param)["param"]
                src = source.get(model_param, model_param)
                shard = src.detach().reshape(-1)[rng.start:rng.end]
                h = _handle_of(self, model_param)
                if h.dtype == shard.dtype and h.data_ptr() == shard.data_ptr():
                    continue  # an FP32 param: its main copy is the param itself
                self.optimizer.write_shard(h, {"param": shard.cpu()})


def _init_optimizer_states_with_dummy_values(self):
    # The engine's state exists from stream_optimizer_state on; nothing to allocate.
    self.optimizer.initialize_state()


def _bind(dopt) -> None:
    for fn in (_get_main_param_and_optimizer_states, _set_main_param_and_optimizer_states,
               _copy_main_params_to_model_params, _copy_model_params_to_main_params,
               _init_optimizer_states_with_dummy_values):
        setattr(dopt, fn.__name__, types.MethodType(fn, dopt))
    dopt.sharded_state_dict = types.MethodType(_sharded_state_dict, dopt)
    dopt.main_param_shard = types.MethodType(lambda self, mp: self.optimizer.read_shard(_handle_of(self, mp))["param"],
                                             dopt)


def stream_optimizer_state(optimizer, tier: str = "host", directory: str | None = None, window_mb: int = 512,
                           *, depth: int | None = None, settings: str | None = None,
                           release_torch_cache: bool = False, step_in_backward: bool | str = False,
                           clip_policy: str = "auto", moment_dtype: str = "fp32",
                           resident_mb: int | str | None = None, resume: bool = False,
                           step_overlap_forward: bool = False,
                           coalesce: bool | int | None = None) -> list[StreamedMegatronAdamW]:
    """Moves the FP32 main params and Adam moments of ``optimizer`` (a megatron-core
    DistributedOptimizer, or a ChainedOptimizer of them, as ``get_megatron_optimizer``
    returns) into deferalloc's streamed engine.

    After the call ``optimizer.step()`` is Megatron's (grad reduce-scatter, loss scaling,
    clipping, param all-gather) with the inner Adam step streamed (Note [Megatron's step with
    a streamed inner optimizer]); ``sharded_state_dict`` / ``state_dict`` / ``load_state_dict``
    / ``reload_model_params`` work through the engine (Note [Megatron checkpoints through the
    engine]).  Existing Adam state (an optimizer that already stepped or loaded) is moved.

    Args:
        tier: "host" (pinned host memory), "file" (``directory``; one sub-directory per
            DistributedOptimizer of a chain), or "device".
        window_mb: HBM budget of the streamed state (each DistributedOptimizer's own window).
        depth, settings, moment_dtype: as ``deferalloc.optim.StreamedAdamW`` ("fp32", "bf16"
            or "int8" moments on the host and file tiers; checkpoints hold FP32 values whatever
            the format, so one saved with a format loads into another).
        resident_mb: host and file tiers (file: fp32 moments only): HBM (MiB, or "auto") for
            shards whose FP32 state stays in HBM, as StreamedAdamW's (on the file tier still
            committed to the state file at every step, so resume=True is exact); for a ChainedOptimizer the budget is shared by its
            DistributedOptimizers in proportion to their shards' elements (Note
            [resident_mb="auto"] in deferalloc/optim.py).
        release_torch_cache: torch.cuda.empty_cache() before each streamed step, so that the
            window takes HBM torch keeps cached but free (Note [The window and torch's cache]).
        step_in_backward: step each DDP bucket group's shards as soon as its grad
            reduce-scatter has finished, during backward (needs
            ``DistributedDataParallelConfig(overlap_grad_reduce=True)`` to overlap; Note [The
            step inside Megatron's backward]).  True: always; False: never (the plain step);
            "auto": times a few iterations in each mode after warm-up and keeps the faster,
            timed again every ``recheck`` iterations (the policy's ``stats()`` under
            ``backward_step.stats()["step_aside"]``; Note [Stepping aside]).  ``clip_policy``:
            "auto", "speculate" or "after", as ``deferalloc.overlap.BackwardOverlap`` (when
            Megatron clips).
        step_overlap_forward: with ``step_in_backward`` (True or "auto") and DDP's
            ``overlap_param_gather``: the step also overlaps the next forward.
            ``zero_grad_buffer`` no longer waits for every step (each bucket group's grads
            are zeroed by the step's worker once its step has read them) and each bucket
            group's param all-gather waits for that group's step and zeroing only; the
            engine keeps its window backed between passes (``keep_window:1`` unless
            ``settings`` names keep_window); "auto" times whole iterations (Note [The step
            across the next forward]).  Off by default.
        coalesce: with ``step_in_backward`` (True or "auto"; refused without it): bucket groups
            per engine pass, as ``deferalloc.overlap.BackwardOverlap``'s.  True or 0: every
            queued bucket group whose grads are done in one pass; an int k >= 1: at most k of
            them, those the next forward needs first; False or 1: one a pass.  None (default):
            BackwardOverlap's per-tier default (one a pass on the host and device tiers, all on
            the file tier).  Fewer passes fill and drain the engine's pipeline less often; a
            bucket group's param all-gather waits for the whole pass it is in (Note [The step
            across the next forward]).
        resume: file tier: continue from the state files in ``directory`` (their last committed
            step: main params, moments, step counts; the model params are written as
            BF16(main)) instead of starting from the model; a missing state file starts fresh,
            as StreamedAdamW(resume=True).  The model must be the one that wrote them.

    Returns the inner optimizers (one per DistributedOptimizer), for ``stats()``.
    Cost: one address reservation per DistributedOptimizer (none when it was built inside
    ``deferred_main_params()``), the engine's initialisation (main = float(model shard),
    window by window on the GPU), and freeing Megatron's FP32 main copies if it made them
    (``gc.collect`` and ``torch.cuda.empty_cache`` give them back).
    Main params that Megatron made as handles itself (``defer_main_param_initialization``)
    are kept as they are (Note [Megatron's deferred main params]).
    @throws InvalidArgumentError for an unsupported configuration (nothing changed),
    InvalidStateError for an untested megatron-core version or a second call, the engine's
    errors (OutOfMemoryError, IOFailure, ...) otherwise.
    """
    adapter = _adapter()
    chain = streamed_optimizers(optimizer)
    _check_step_options(step_in_backward, step_overlap_forward, coalesce)
    if step_in_backward:
        _refuse_backward_step(chain, clip_policy, step_overlap_forward)
    if step_overlap_forward and "keep_window" not in (settings or ""):
        # Note [The step across the next forward]: the passes of one iteration back to back.
        settings = "keep_window:1" + ("," + settings if settings else "")
    residents = _resident_budgets(chain, resident_mb, tier, window_mb, moment_dtype)
    out = []
    for i, dopt in enumerate(chain):
        d = directory
        if directory and len(chain) > 1:
            d = os.path.join(directory, f"optimizer{i}")
            os.makedirs(d, exist_ok=True)
        engine = dict(tier=tier, directory=d, window_mb=window_mb, depth=depth, settings=settings,
                      moment_dtype=moment_dtype, resident_mb=residents[i], resume=resume)
        out.append(_stream_one(dopt, engine, release_torch_cache, adapter))
    gc.collect()  # the replaced torch optimizers and FP32 copies, should a cycle hold them
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if step_in_backward:
        _BackwardStep.attach_all(optimizer, chain, clip_policy, auto=step_in_backward == "auto",
                                 overlap_forward=step_overlap_forward, coalesce=coalesce)
    return out


def _check_step_options(step_in_backward, step_overlap_forward, coalesce) -> None:
    """stream_optimizer_state's options of the step inside backward, each a value it takes and
    one that goes with the others (checked before anything changes)."""
    where = "deferalloc.megatron.stream_optimizer_state"
    if step_in_backward not in (True, False, "auto"):
        raise InvalidArgumentError(f"{where}: step_in_backward {step_in_backward!r} (True, False or \"auto\")")
    if step_overlap_forward not in (True, False):
        raise InvalidArgumentError(f"{where}: step_overlap_forward {step_overlap_forward!r} (True or False)")
    if step_overlap_forward and not step_in_backward:
        raise InvalidArgumentError(f"{where}: step_overlap_forward=True needs step_in_backward (True or \"auto\")")
    if coalesce is not None and (not isinstance(coalesce, int) or coalesce < 0):
        raise InvalidArgumentError(f"{where}: coalesce {coalesce!r} (None, True, False or a number of bucket "
                                   "groups >= 0; 0: all)")
    if coalesce is not None and not step_in_backward:
        raise InvalidArgumentError(f"{where}: coalesce={coalesce!r} needs step_in_backward (True or \"auto\"): "
                                   "the plain step is one engine pass")


def _resident_budgets(chain, resident_mb, tier: str, window_mb: int, moment_dtype: str) -> list:
    """Each DistributedOptimizer's resident_mb: the chain shares one budget (Note
    [resident_mb="auto"] in deferalloc/optim.py), by its shards' elements."""
    shards = [[p for g in [*getattr(dopt, "shard_float16_groups", ()), *getattr(dopt, "shard_fp32_groups", ())]
               for p in g] for dopt in chain]  # (what is no DistributedOptimizer is refused after)
    some = next((p for s in shards for p in s), None)
    device = some.device if some is not None else torch.device("cpu")
    return resident_budgets(resident_mb, tier, window_mb, device, [sum(p.numel() for p in s) for s in shards],
                            moment_dtype=moment_dtype)


# ---- the step inside Megatron's backward ---------------------------------------------------

def _refuse_backward_step(chain, clip_policy: str, overlap_forward: bool = False) -> None:
    """What step_in_backward (and step_overlap_forward) cannot make exact (nothing changed yet)."""
    why = None
    if clip_policy not in ("auto", "speculate", "after"):
        why = f"clip_policy {clip_policy!r} (auto, speculate or after)"
    elif overlap_forward and len(chain) > 1:
        why = ("step_overlap_forward with a chain of several DistributedOptimizers (a bucket group's grads "
               "would be zeroed after the steps of several workers)")
    elif overlap_forward and not all(getattr(d.ddp_config, "overlap_param_gather", False) for d in chain):
        why = ("step_overlap_forward without DDP's overlap_param_gather: Megatron then all-gathers the params "
               "inside optimizer.step(), which would have to wait for every bucket's step (use "
               "overlap_param_gather=True, or step_in_backward alone)")
    for dopt in chain:
        if why is not None:
            break
        if getattr(dopt, "grad_scaler", None) is not None:
            why = "a grad scaler (FP16 or a loss scale): a skipped step would have to undo every bucket's"
        elif getattr(dopt.ddp_config, "num_distributed_optimizer_instances", 1) != 1:
            why = "num_distributed_optimizer_instances > 1 (the reduction is not one handle per bucket group)"
        elif getattr(dopt.ddp_config, "reduce_scatter_with_fp32_accumulation", False):
            why = ("reduce_scatter_with_fp32_accumulation (its reduced grads reach main_grad only at "
                   "finish_grad_sync; not checked against finalize_model_grads' in-place changes)")
        elif getattr(dopt.config, "grad_norm_skip_threshold", float("inf")) != float("inf"):
            why = "grad_norm_skip_threshold (a skipped update would have to undo every bucket's)"
    if why is not None:
        what = "step_overlap_forward=True" if overlap_forward else "step_in_backward=True"
        raise InvalidArgumentError(f"deferalloc.megatron.stream_optimizer_state({what}): {why}")


def _no_reset() -> None:
    return None


def _zero_all(views) -> None:
    for v in views:
        v.zero_()


def _zero_after(ready, views) -> None:
    """Zeroes ``views`` on the current stream once it has waited for event ``ready`` (None: at once)."""
    if ready is not None:
        torch.cuda.current_stream().wait_event(ready)
    _zero_all(views)


def _outside_buckets(buf) -> list:
    """The parts of a grad buffer's ``grad_data`` that none of its buckets' views covers."""
    base, n = buf.grad_data.storage_offset(), buf.grad_data.numel()
    spans = sorted((bk.grad_data.storage_offset() - base, bk.grad_data.storage_offset() - base + bk.grad_data.numel())
                   for bk in buf.buckets)
    out, at = [], 0
    for start, end in spans:
        if start > at:
            out.append(buf.grad_data[at:start])
        at = max(at, end)
    if at < n:
        out.append(buf.grad_data[at:n])
    return out


def _finalized_params(dopt) -> set | None:
    """The model params (ids) whose main grads Megatron's finalize_model_grads changes in place
    after their bucket group's reduce-scatter (Note [Grads finalize changes]); None: all."""
    chunks = list(dopt.model_chunks)
    cfg = getattr(chunks[0], "config", None) if chunks else None
    if cfg is None:
        return None
    if getattr(cfg, "calculate_per_token_loss", False) or getattr(cfg, "flextron", False) or \
            getattr(cfg, "gtp_weight_remat_size", 1) > 1 or getattr(cfg, "expert_gtp_weight_remat_size", 1) > 1:
        return None
    tp = getattr(cfg, "tensor_model_parallel_size", 1)
    pp = getattr(cfg, "pipeline_model_parallel_size", 1)
    out = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if (tp > 1 and (getattr(p, "average_gradients_across_tp_domain", False)
                            or (getattr(cfg, "sequence_parallel", False) and getattr(p, "sequence_parallel", False))
                            or (getattr(cfg, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)))
                    or (pp > 1 and (getattr(p, "shared_embedding", False) or "position_embeddings" in name
                                    or (getattr(cfg, "has_cond_embedder", False)
                                        and getattr(p, "pipeline_parallel", False))))
                    or (getattr(cfg, "mtp_num_layers", None) and getattr(p, "shared_embedding", False))):
                out.add(id(p))
    return out


# Note [A reduce-scatter waited twice]
# Rationale: the worker waits for a bucket group's reduce-scatter, and so does Megatron's
# finish_grad_sync; the worker's wait may come after Megatron clipped the grads in place.
# A NCCL work's wait() only makes the calling stream wait; a gloo work's wait() copies the
# reduced result into the output tensor at every call (torch 2.11: wait, scale the output,
# wait again, and the output holds the unscaled result), so a late second wait put the
# unclipped grads back under Megatron's clipped ones, and a redo stepped them (CPU runs
# differed from the plain step when the worker lagged).
# Approach: the worker waits only for a NCCL group's handle (its side stream then waits on
# the device); another backend's handle is waited on the main thread when the bucket is
# queued (before Megatron's step can touch the grads), and the worker gets none.
# Limits: the backend is read once per bucket group, from the group Megatron reduces over
# (its backend for the grads' device type).


def _wait_orders_streams(bg) -> bool:
    """Whether a wait() on bucket group ``bg``'s grad-reduce handle only orders the calling
    stream (NCCL for the grads' device), so that the worker may wait for it (Note [A
    reduce-scatter waited twice])."""
    group = getattr(bg, "intra_distributed_optimizer_instance_group", None) or \
        getattr(bg, "data_parallel_group", None)
    try:  # "cpu:gloo,cuda:nccl": a backend per device type
        config = str(torch.distributed.get_backend_config(group))
    except (RuntimeError, ValueError, TypeError):  # (no process group: no collective, no handle)
        return False
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_device.get(bg.buckets[0].grad_data.device.type) == "nccl"


def _reduced_grad(mp) -> torch.Tensor:
    copy = getattr(mp, "main_grad_copy_in_grad_buffer", None)
    return mp.main_grad if copy is None else copy


class _BackwardStep(BackwardOverlap):
    """deferalloc.overlap's bucket stepping driven by Megatron's bucket groups (Note [The
    step inside Megatron's backward]).  One per DistributedOptimizer; ``stats()`` as
    BackwardOverlap's."""

    own_norms = False  # Megatron computes the norm and clips; clip_grad_norm reports whether it fired
    active = True  # this iteration steps inside backward (False: Megatron's hooks pass through, the plain step)
    aside = None  # the _StepAside choosing ``active`` (step_in_backward="auto")

    def __init__(self, dopt, clip_policy: str, overlap_forward: bool = False, coalesce: bool | int | None = None):
        self.dopt = dopt
        self.overlap_forward = overlap_forward  # Note [The step across the next forward]
        self._groups = []  # (bucket group, [(handle, model param, range)])
        orders = []  # per group: smaller is needed sooner by the next forward
        for ci, chunk in enumerate(dopt.model_chunks):
            groups = chunk.bucket_groups + chunk.expert_parallel_bucket_groups
            for j, bg in enumerate(groups):
                mine = [mp for b in bg.buckets for mp in b.params_list if mp in dopt.model_param_group_index_map]
                if mine:
                    self._groups.append((bg, [(_handle_of(dopt, mp), mp, dopt._get_model_param_range_map(mp)["param"])
                                              for mp in mine]))
                    # Megatron builds a chunk's buckets from its last parameters on: the
                    # forward needs a chunk's last bucket group first, the first chunk first.
                    orders.append((ci, len(groups) - 1 - j))
        clip = dopt.config.clip_grad if dopt.config.clip_grad > 0.0 else None
        super().__init__(dopt.optimizer, None, max_grad_norm=clip, clip_policy=clip_policy, coalesce=coalesce,
                         buckets=[[h for h, _, _ in pairs] for _, pairs in self._groups])
        if overlap_forward:  # (else BackwardOverlap's order: the same for one model chunk)
            rank = {k: r for r, k in enumerate(sorted(range(len(orders)), key=orders.__getitem__))}
            for b in self.buckets:
                b.order = rank[b.index]
        # Note [Grads finalize changes]
        # Rationale: Megatron's finalize_model_grads changes some main grads in place after
        # their bucket group's reduce-scatter has ended (the layer norms' all-reduce over TP
        # under sequence parallelism, qk-layernorm and average_gradients_across_tp_domain
        # params, the tied word embedding's and the position embedding's sum over the
        # pipeline stages, the per-token-loss scale of every grad).  A step taken when the
        # reduce-scatter ends reads them before that; when clipping does not fire (or there
        # is no clipping) nothing redoes it, so the update would miss finalize's part.
        # Approach: a bucket group holding such a param is not queued by its reduce-scatter:
        # it is stepped from the inner step, with the main grads Megatron prepared after
        # finalize (as a bucket whose grad sync started outside the hooks); with the per-token
        # loss (or GTP remat, flextron routers) every bucket.  Tested at PP 2 with the tied
        # embedding, finalize's all-reduces slowed (test_megatron_parallel).
        # Limits: the params are found by Megatron's attributes and names as of 0.19 (a later
        # release adding another in-place change to finalize needs it added here); held
        # buckets overlap nothing of backward.
        fin = _finalized_params(dopt)
        self.after_finalize = {i for i, (bg, pairs) in enumerate(self._groups)
                               if fin is None or any(id(mp) in fin for _, mp, _ in pairs)}
        self.zeroed_behind_steps = 0  # bucket groups whose grads the worker zeroed behind their step
        self._bucket_of_group = {id(bg): b for (bg, _), b in zip(self._groups, self.buckets)}
        self.wait_in_forward = True  # each bucket group's param all-gather waits for its own bucket
        self.norm = None  # this iteration's total grad norm as Megatron computed it (None: not seen)
        self.norm_owner = dopt  # the object whose grad_norms_by_group (0.19) goes with it
        self._queued: dict[int, int] = {}  # bucket -> the iteration it was queued in

    @classmethod
    def attach_all(cls, optimizer, chain, clip_policy: str, auto: bool = False,
                   overlap_forward: bool = False, coalesce: bool | int | None = None) -> None:
        steps = [cls.attach(dopt, clip_policy, overlap_forward, coalesce) for dopt in chain]
        if auto:
            aside = _StepAside(steps, whole_iterations=overlap_forward)
            for st in steps:
                st.aside = aside

            def step(opt, *a, **k):
                out = type(opt).step(opt, *a, **k)
                aside.step_ended()
                return out
            optimizer.step = types.MethodType(step, optimizer)
        if optimizer is not chain[0]:  # a ChainedOptimizer: its step clips with get_grad_norm's norm
            def get_grad_norm(opt, *a, **k):
                norm = type(opt).get_grad_norm(opt, *a, **k)
                for st in steps:
                    st.norm, st.norm_owner = norm, opt
                return norm
            optimizer.get_grad_norm = types.MethodType(get_grad_norm, optimizer)

    @classmethod
    def attach(cls, dopt, clip_policy: str, overlap_forward: bool = False,
               coalesce: bool | int | None = None) -> "_BackwardStep":
        self = cls(dopt, clip_policy, overlap_forward, coalesce)
        for (bg, pairs), b in zip(self._groups, self.buckets):
            self._wrap_bucket_group(bg, pairs, b)
        chunks_done = set()
        for chunk in dopt.model_chunks:
            if id(chunk) in chunks_done:
                continue
            chunks_done.add(id(chunk))
            zero = chunk.zero_grad_buffer

            def zero_grad_buffer(*a, _zero=zero, _chunk=chunk, **k):
                if self.aside is not None:
                    self.aside.iteration_started()
                if self.overlap_forward and self._zero_per_bucket(_chunk, lambda: _zero(*a, **k)):
                    return None
                self.synchronize()  # the steps read the grad buffer this zeroes
                return _zero(*a, **k)
            chunk.zero_grad_buffer = zero_grad_buffer
            # 0.19's colocation API frees and reallocates the grad buffers the steps read
            # (and the queued zeroing writes): the steps first.
            for name in ("offload_grad_buffers", "restore_grad_buffers"):
                if hasattr(chunk, name):
                    def waiting(*a, _f=getattr(chunk, name), **k):
                        self.synchronize()
                        return _f(*a, **k)
                    setattr(chunk, name, waiting)

        if overlap_forward:
            # The model's state (a checkpoint's model part) holds the params the steps write.
            for chunk in dopt.model_chunks:
                for m in chunk.modules():
                    m.register_state_dict_pre_hook(lambda *_a, **_k: self.synchronize())
                    m.register_load_state_dict_pre_hook(lambda *_a, **_k: self.synchronize())

            def zero_grad(opt, set_to_none: bool = True, *a, **k):
                if not set_to_none:  # zeroed in place: the .grad tensors queued steps read
                    self.synchronize()
                return type(opt).zero_grad(opt, set_to_none, *a, **k)
            dopt.zero_grad = types.MethodType(zero_grad, dopt)

        def clip_grad_norm(opt, clip_grad, *a, **k):
            self.norm = type(opt).clip_grad_norm(opt, clip_grad, *a, **k)
            self.norm_owner = opt
            return self.norm
        dopt.clip_grad_norm = types.MethodType(clip_grad_norm, dopt)
        dopt.optimizer.backward_step = self
        return self

    def _wrap_bucket_group(self, bg, pairs, b) -> None:
        start_grad_sync, start_param_sync = bg.start_grad_sync, bg.start_param_sync

        def prepare(handle):
            # The worker: the reduce-scatter's end (GPU: the side stream waits for it), then
            # the shards' main grads as Megatron's _copy_model_grads_to_main_grads makes them.
            ctx = torch.cuda.stream(self.side_stream) if self.side_stream is not None else contextlib.nullcontext()
            with ctx, torch.no_grad():
                if handle is not None:
                    handle.wait()
                # (0.19's promoted main grads: the reduced values are in the comm buffer
                # until Megatron's finish_grad_sync copies them back, value for value.)
                return [(h, _reduced_grad(mp).view(-1)[r.start:r.end].float()) for h, mp, r in pairs]

        on_worker = _wait_orders_streams(bg)

        def grads_reduced(*a, **k):
            start_grad_sync(*a, **k)
            if not self.active or self._queued.get(b.index) == self.iteration:
                return  # (Megatron's first batch calls it again)
            if b.index in self.after_finalize:
                return  # stepped from the inner step (Note [Grads finalize changes])
            self._queued[b.index] = self.iteration
            handle = bg.grad_reduce_handle
            if handle is not None and not on_worker:  # Note [A reduce-scatter waited twice]
                handle.wait()
                handle = None
            self.bucket_ready(b, b.params, lambda: prepare(handle))

        def params_gathered(*a, **k):
            self.wait_buckets([b])
            return start_param_sync(*a, **k)

        bg.start_grad_sync = grads_reduced
        bg.start_param_sync = params_gathered

    def _zero_per_bucket(self, chunk, megatron_zero) -> bool:
        """``chunk.zero_grad_buffer()`` without waiting for the steps (Note [The step across
        the next forward]): Megatron's own bookkeeping at once (its method runs with each
        buffer's ``reset`` a no-op), each bucket group's grads zeroed behind its step on the
        worker, the rest of each buffer (padding outside the buckets) now.  False (nothing
        done): a buffer with 0.19's separate FP32 main grads (``extra_main_grads``, zeroed by
        its ``reset``), left to the waiting path."""
        buffers = list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []))
        if any(getattr(buf, "extra_main_grads", None) for buf in buffers):
            return False
        # The zeroing follows the compute stream's work queued so far as well as the step:
        # Megatron's finalize_model_grads changes main_grad in place after a bucket's
        # reduce-scatter (its all-reduces over TP and pipeline stages, the per-token scale),
        # after the bucket's event the step waited on.
        ready = None
        if self.side_stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.opt.device))
        for buf in buffers:
            buf.reset = _no_reset  # (an instance attribute over the method, for this call)
        try:
            megatron_zero()
        finally:
            for buf in buffers:
                del buf.reset
        for bg in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            views = [bk.grad_data for bk in bg.buckets]
            b = self._bucket_of_group.get(id(bg))
            if b is None:  # no shard of this rank: no step reads it
                _zero_all(views)
            else:
                if self.run_after(b, lambda views=views: _zero_after(ready, views)):
                    self.zeroed_behind_steps += 1
        for buf in buffers:
            _zero_all(_outside_buckets(buf))
        return True

    def complete_bucket(self, b) -> None:
        # A bucket group whose grad sync was not started through Megatron's hook: stepped
        # with the main grads Megatron prepared.
        if self._queued.get(b.index) == self.iteration:
            return
        self._queued[b.index] = self.iteration
        params = [p for p in b.params if p.grad is not None]
        if params:
            self.bucket_ready(b, params)

    def _megatron_clipped(self) -> bool:
        """Whether Megatron clipped this iteration's grads: its rule (clip_grad_by_total_norm_fp32:
        clip_coeff = clip_grad / (norm + 1e-6) < 1.0 clips), for the total norm and 0.19's
        separate grad-norm groups; a norm not seen, or NaN, counts as fired (redone from the
        grads Megatron left: exact; with a NaN norm 0.17's tensor path multiplies every grad
        by NaN)."""
        norm, self.norm = self.norm, None
        if norm is None:
            return True
        clip = self.max_grad_norm
        norms = [norm, *(getattr(self.norm_owner, "grad_norms_by_group", None) or {}).values()]
        return any(clip_fired(clip, n) for n in norms if n is not None)

    def end_iteration(self) -> None:
        """The inner optimizer's step: Megatron has prepared (and clipped) the main grads."""
        if self.max_grad_norm is None:
            self.finish_iteration(None)
            return
        fired = self._megatron_clipped()
        self.finish_iteration(lambda: self.settle(fired, None))

    def stats(self) -> dict:
        out = super().stats()
        out["after_finalize"] = len(self.after_finalize)
        if self.overlap_forward:
            out["zeroed_behind_steps"] = self.zeroed_behind_steps
        if self.aside is not None:
            out["step_aside"] = self.aside.stats()
        return out



class _StepAside:
    """step_in_backward="auto": each iteration plain or inside backward, whichever the last
    probe timed faster (Note [Stepping aside]).  One for all DistributedOptimizers of a
    chain (they switch together).  ``clock``, ``warmup``, ``run``, ``settle`` and ``recheck``
    may be set before the first step."""

    warmup = 2  # plain iterations before the first probe (Megatron's first batch differs)
    run = 3  # iterations of each mode per probe; the first of a run (the switch) is not timed
    settle = 2  # more untimed iterations before the run of a mode never run before
    recheck = 1000  # iterations in the chosen mode between probes (0: never probe again)

    def __init__(self, steps: list, clock: Callable[[], float] = time.perf_counter, whole_iterations: bool = False):
        self.steps = steps
        # Time from one iteration's start (the first zero_grad_buffer after a step) to the
        # next, without waiting for the steps (Note [The step across the next forward]).
        self.whole_iterations = whole_iterations
        self._due = False  # whole_iterations: a step ended, the next iteration start is a boundary
        self.clock = clock  # seconds; read after a device synchronisation, in probes only
        self.mode = "plain"  # the mode of the iteration in progress
        self.chosen = None  # the last probe's choice (None: no probe finished yet)
        self.measured: dict[str, float] = {}  # the last probe's iteration seconds per mode
        self.iterations = {"plain": 0, "inside": 0}
        self.probes = 0
        self.switches = 0
        self._ended = 0  # optimizer steps ended
        self._plan: list[str] | None = None  # the probe's modes, one per iteration
        self._pos = 0
        self._untimed: list[bool] = []  # per probe iteration: not timed
        self._timed: dict[str, list[float]] = {}
        self._mark = 0.0
        self._next_probe: int | None = -1  # the step count whose end starts a probe (-1: warmup's; None: never)
        for st in steps:
            st.active = False

    def _synced_clock(self) -> float:
        """The clock once every step in flight and the device's work are done."""
        for st in self.steps:
            st.synchronize()
        if any(st.opt.device.type == "cuda" for st in self.steps):
            torch.cuda.synchronize()
        return self.clock()

    def _device_clock(self) -> float:
        """The clock once the device's work is done (the steps' worker may still queue more)."""
        if any(st.opt.device.type == "cuda" for st in self.steps):
            torch.cuda.synchronize()
        return self.clock()

    def _set(self, mode: str) -> None:
        """The next iteration's mode; a switch first waits for every step in flight."""
        if mode != self.mode:
            for st in self.steps:
                st.synchronize()
                st.norm = None
                st.active = mode == "inside"
            self.switches += 1
        self.mode = mode

    def step_ended(self) -> None:
        """Megatron's optimizer step returned: times the iteration in a probe, picks the next mode."""
        self.iterations[self.mode] += 1
        self._ended += 1
        if self.whole_iterations:
            self._due = True  # timed and decided at the next iteration's start
            return
        self._boundary(self._synced_clock)

    def iteration_started(self) -> None:
        """An iteration starts (zero_grad_buffer): with ``whole_iterations`` the boundary
        step_ended times and decides at otherwise."""
        if self.whole_iterations and self._due:
            self._due = False
            self._boundary(self._device_clock)

    def _boundary(self, clock: Callable[[], float]) -> None:
        """Between two iterations: times the last in a probe, picks the next mode."""
        if self._plan is None:
            due = max(1, self.warmup) if self._next_probe == -1 else self._next_probe
            if self._ended != due:
                return
            # A probe: ``run`` iterations of the current mode, then ``run`` of the other,
            # each run after ``settle`` more untimed ones where its mode never ran.
            other = "plain" if self.mode == "inside" else "inside"
            n = max(2, self.run)  # (one untimed iteration per run, at least one timed)
            self._plan, self._untimed = [], []
            for m in (self.mode, other):
                u = 1 + (max(0, self.settle) if self.iterations[m] == 0 else 0)
                self._plan += [m] * (u + n - 1)
                self._untimed += [True] * u + [False] * (n - 1)
            self._pos = 0
            self._timed = {"plain": [], "inside": []}
            self._mark = clock()
            self._set(self._plan[0])
            return
        now = clock()
        if not self._untimed[self._pos]:
            self._timed[self._plan[self._pos]].append(now - self._mark)
        self._mark = now
        self._pos += 1
        if self._pos < len(self._plan):
            self._set(self._plan[self._pos])
            return
        self._plan = None
        self.measured = {m: min(ts) for m, ts in self._timed.items() if ts}
        best = "inside" if self.measured.get("inside", float("inf")) < self.measured.get("plain", float("inf")) \
            else "plain"
        self.probes += 1
        self._next_probe = self._ended + self.recheck if self.recheck else None
        if best != self.chosen:
            logger.info("deferalloc.megatron: step_in_backward=\"auto\" steps %s (iteration %.4f s inside "
                      "backward, %.4f s plain; probe %d, after step %d)",
                      "inside backward" if best == "inside" else "plainly after backward",
                      self.measured.get("inside", float("nan")), self.measured.get("plain", float("nan")),
                      self.probes, self._ended)
        self.chosen = best
        self._set(best)

    def stats(self) -> dict:
        return {"mode": self.mode, "chosen": self.chosen, "measured_seconds": dict(self.measured),
                "iterations": dict(self.iterations), "probes": self.probes, "switches": self.switches}


def save_engine_checkpoint(optimizer, directory: str) -> None:
    """The engine's own checkpoint of every streamed DistributedOptimizer in ``optimizer``
    (``directory``/optimizer<i>): raw FP32 arrays and a checksummed manifest, the fast path
    when the same layout (model, data-parallel size) loads it.  Hyper-parameters, the grad
    scaler and the model stay with Megatron's own checkpoint.  Cost: the state read once
    from its tier and written with fsync.  @throws the engine's errors (IOFailure, ...)."""
    for i, dopt in enumerate(streamed_optimizers(optimizer)):
        d = os.path.join(directory, f"optimizer{i}")
        os.makedirs(d, exist_ok=True)
        dopt.optimizer.save_checkpoint(d)


def load_engine_checkpoint(optimizer, directory: str) -> None:
    """Loads save_engine_checkpoint's directory and writes BF16(main) into the model
    params.  @throws CorruptDataError (a check failed; nothing loaded), IOFailure."""
    for i, dopt in enumerate(streamed_optimizers(optimizer)):
        dopt.optimizer.load_checkpoint(os.path.join(directory, f"optimizer{i}"))
