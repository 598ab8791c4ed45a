"""Step a StreamedAdamW during backward, and let the next forward start before it ends.

Note [Overlap with backward]
Rationale: the host tier's step runs at the PCIe bound, ~12 B/param each way, as long as
a forward+backward of a billion-parameter model; after backward it doubles an iteration.
A parameter's step needs only its own final gradient, so it can run while backward
computes the others' (DeepSpeed ZenFlow / SuperOffload, Megatron's overlapped offload).
Approach
 - Buckets: the parameters in reverse registration order (backward's order, roughly),
   cut every ``bucket_mb`` of parameters (counted as FP32).  A post-accumulate-grad hook marks a parameter
   ready; when a bucket is complete, the hook records a CUDA event on the current stream,
   keeps references to the bucket's gradients and queues the bucket with a snapshot of
   the groups' hyper-parameters.  One worker thread steps the queued buckets through the
   engine (the ctypes call drops the GIL) on a side stream that waits for that event
   only (the engine's kernels run on a stream of the greatest priority, so the GPU
   schedules their blocks ahead of backward's waiting ones instead of starving them),
   passing null gradients for every other shard (a skipped shard keeps its state
   and step count): the arithmetic and each parameter's step count are the plain step's,
   so the result is bit-identical to ``opt.step()`` after backward.
 - ``step()`` (in place of ``opt.step()``) queues what is left (parameters whose gradient
   never came) and returns.  Forward pre-hooks on every module that owns parameters wait
   for the buckets holding them (host: the worker has issued them; device: the current
   stream waits for their event), so the next forward starts on the first layers while
   the last buckets still stream.  The worker takes, of the queued buckets whose
   gradients the GPU has finished (their event), the one the forward needs first, so the
   first layers' bucket, complete last in backward, jumps the backlog of the later
   layers' buckets; when none is finished yet it takes the one queued first (backward
   finishes it first).  The host queues backward far ahead of the GPU: taking the
   forward's first bucket regardless would block the worker on gradients that the GPU
   computes last, and leave the link idle through backward (measured: 3 of 17 buckets
   stepped during backward).  Give the optimizer ``settings="keep_window:1"``
   so that back-to-back bucket passes keep the window's slots backed and map nothing.
 - Clipping (``max_grad_norm``): each bucket is stepped speculatively with its gradients
   as they are, its previous state (main, moments, step count) kept.  Host tier: the
   engine's speculative step (Note [Speculative steps] in optimizer/streamed_adamw.cpp)
   writes the new state into a second pinned copy and keeps the current one, so keeping
   costs no copy; shards it cannot keep (resident shards, the device and file tiers, or
   ``engine_speculation=False``) are copied out through the state ranges first
   (``kept_copies`` counts them) and stepped plainly.  At ``step()`` the total norm is
   computed as ``torch.nn.utils.clip_grad_norm_`` does; when its coefficient is below 1
   (the gradients would change), the speculation is discarded and the copied-out shards
   written back, so every stepped shard is at its previous state; the gradients are
   clipped with torch's ``clip_grads_with_norm_`` and stepped again (``redos`` counts it;
   the redo rewrites the BF16 parameters the speculative step wrote): results equal
   ``clip_grad_norm_(...); opt.step()`` bit for bit.  When the coefficient is 1, torch's
   multiply by 1.0 is exact and the speculation is committed (pointer swaps).
Limits: the engine's second copy doubles the pinned host memory of the state (12 B/param
more with fp32 moments), allocated at the first clipped iteration; shards the engine
cannot keep still cost a host memcpy of 12 B/param per step (resident shards: a D2H
copy), and a redo costs a second step of the whole model.  A parameter used
outside its own module's forward is not waited for by that forward.  One backward per
step (a hook fires at each accumulation, so gradient accumulation over micro-batches
needs the plain step); the gradients must not be modified after backward until ``step()``.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Iterable

import torch

from .optim import StreamedAdamW, _check, _DTYPE, _load, _stream_ptr

__all__ = ["BackwardOverlap", "overlap_with_backward"]


class _Bucket:
    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.ready: set[int] = set()
        self.idle = threading.Event()
        self.idle.set()
        self.event = None  # CUDA event: the bucket's step is done on the side stream


class BackwardOverlap:
    """Steps ``opt``'s parameters during backward.  See Note [Overlap with backward].

    Call ``step()`` where ``opt.step()`` was; ``synchronize()`` waits for every step.
    ``stats()``: buckets stepped, speculative steps, redos, and ``kept_copies``: shards
    whose state was copied out to be kept (clipping, where the engine cannot speculate,
    or with ``engine_speculation=False``)."""

    def __init__(self, opt: StreamedAdamW, model: torch.nn.Module | None = None, *, bucket_mb: int = 256,
                 max_grad_norm: float | None = None, wait_in_forward: bool = True, engine_speculation: bool = True):
        self.opt = opt
        self.engine_speculation = engine_speculation
        self._speculable: list[bool] | None = None  # per shard: the engine keeps its state (after init)
        # (bucket index, start, end) in time.perf_counter() seconds of each bucket's step
        # while ``trace`` is True (benchmark timelines; the engine's streamed step returns
        # when its state is home, so the host clock brackets it).
        self.trace = False
        self.timeline: list[tuple[int, float, float]] = []
        self.max_grad_norm = max_grad_norm
        cuda = opt._device.type == "cuda"
        self._side = torch.cuda.Stream(opt._device) if cuda else None
        # Buckets in reverse registration order.
        self._buckets: list[_Bucket] = []
        cur, size = [], 0
        for p in reversed(opt._params):
            cur.append(p)
            size += p.numel() * 4
            if size >= bucket_mb << 20:
                self._buckets.append(_Bucket(len(self._buckets), cur))
                cur, size = [], 0
        if cur:
            self._buckets.append(_Bucket(len(self._buckets), cur))
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._lock = threading.Lock()
        # Queued buckets (seq, index, item); _take() picks the next one.
        self._cv = threading.Condition()
        self._pending: list[tuple[int, int, tuple]] = []
        self._stop = False
        self._seq = 0
        self._error: BaseException | None = None
        self._kept: dict[int, tuple] = {}  # shard -> (step, main, exp_avg, exp_avg_sq) before this iteration
        self._counts = {"buckets": 0, "speculative_steps": 0, "redos": 0, "kept_copies": 0}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in opt._params]
        if model is not None and wait_in_forward:
            for m in model.modules():
                own = [p for p in m.parameters(recurse=False) if p in self._bucket_of]
                if own:
                    bs = list({self._bucket_of[p].index: self._bucket_of[p] for p in own}.values())
                    self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, bs=bs: self._wait(bs)))
        self._wait_in_forward = model is not None and wait_in_forward
        self._worker = threading.Thread(target=self._run, name="deferalloc-overlap", daemon=True)
        self._worker.start()

    # ---- hooks ---------------------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[p]
        with self._lock:
            b.ready.add(id(p))
            full = len(b.ready) == len(b.params)
        if full:
            self._enqueue(b)

    def _enqueue(self, b: _Bucket) -> None:
        with self._lock:
            if not b.ready:
                return
            ready = [p for p in b.params if id(p) in b.ready and p.grad is not None]
            b.ready = set()
        self.opt._ensure_initialized()  # the state starts from the parameters' values at the first step
        if self._speculable is None:  # (initialize picks the resident shards)
            self._speculable = [self.engine_speculation and self.opt._can_speculate(i)
                                for i in range(len(self.opt._params))]
        b.idle.wait()  # the previous iteration's step of this bucket
        b.idle.clear()
        ev = None
        if self._side is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.opt._device))
        groups = self.opt._group_keys()
        grads = [(p, p.grad) for p in ready]
        with self._lock:
            self._seq += 1
            seq = self._seq
        with self._cv:
            self._pending.append((seq, b.index, (b, grads, ev, groups)))
            self._cv.notify()

    def _wait(self, buckets: list[_Bucket]) -> None:
        for b in buckets:
            b.idle.wait()
            if b.event is not None:
                torch.cuda.current_stream(self.opt._device).wait_event(b.event)
        self._raise()

    # ---- the worker ----------------------------------------------------------------------------

    def _take(self):
        """The next bucket: of those whose gradients are done on the GPU, the one the forward
        needs first (highest index); if none is done, the one queued first.  None: stop."""
        with self._cv:
            while not self._pending and not self._stop:
                self._cv.wait()
            if not self._pending:
                return None
            done = [x for x in self._pending if x[2][2] is None or x[2][2].query()]
            pick = max(done, key=lambda x: x[1]) if done else min(self._pending, key=lambda x: x[0])
            self._pending.remove(pick)
            return pick[2]

    def _run(self) -> None:
        while True:
            item = self._take()
            if item is None:
                return
            b, grads, ev, groups = item
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    self._step_bucket(grads, ev, groups, speculative=self.max_grad_norm is not None)
                    if self.trace:
                        if self._side is not None:
                            self._side.synchronize()
                        self.timeline.append((b.index, t0, time.perf_counter()))
                    if self._side is not None:
                        done = torch.cuda.Event()
                        done.record(self._side)
                        b.event = done
                    self._counts["buckets"] += 1
            except BaseException as e:  # reported by the next step() or forward
                self._error = e
            finally:
                del grads
                b.idle.set()

    def _step_bucket(self, grads, ev, groups, speculative: bool) -> None:
        """One bucket.  Speculative: the engine's speculative step for the shards it can
        keep (host tier, streamed), a plain step after copying the state out for the others."""
        opt, lib = self.opt, _load()
        n = len(opt._params)
        plain = (ctypes.c_void_p * n)()
        spec = (ctypes.c_void_p * n)()
        types = (ctypes.c_int * n)()
        keep, calls = [], set()
        for p, g in grads:
            i = opt._shard_of[p]
            if not g.is_contiguous():
                g = g.contiguous()
                keep.append(g)
            types[i] = _DTYPE[g.dtype]
            if speculative and self._speculable[i]:
                spec[i] = g.data_ptr()
                calls.add("spec")
                continue
            if speculative and i not in self._kept:
                self._kept[i] = (opt._shard_step(i), *(opt._read(i, a, p) for a in range(3)))
                self._counts["kept_copies"] += 1
            plain[i] = g.data_ptr()
            calls.add("plain")
        opt._push_groups(groups)
        stream = None
        if self._side is not None:
            self._side.wait_event(ev)
            stream = _stream_ptr(self._side, opt._device)
        if "spec" in calls:
            _check(lib.dfa_opt_step_speculative(opt._handle, spec, n, types, 1.0, stream), "dfa_opt_step_speculative")
        if "plain" in calls:
            _check(lib.dfa_opt_step(opt._handle, plain, n, types, 1.0, stream), "dfa_opt_step")
        if speculative:
            self._counts["speculative_steps"] += 1
        del keep

    # ---- the user's side -----------------------------------------------------------------------

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def synchronize(self) -> None:
        """Waits until every queued bucket is stepped (the current stream waits for them)."""
        for b in self._buckets:
            b.idle.wait()
            if b.event is not None:
                torch.cuda.current_stream(self.opt._device).wait_event(b.event)
        self._raise()

    @torch.no_grad()
    def step(self) -> None:
        """Ends the iteration: queues the buckets still incomplete (parameters without a
        gradient are skipped, as by ``opt.step()``), settles clipping, and returns; with a
        model and ``wait_in_forward`` the next forward waits per module, else this waits."""
        self.opt._ensure_initialized()
        for b in self._buckets:
            self._enqueue(b)
        if self.max_grad_norm is not None:
            self._settle_clipping()
        elif not self._wait_in_forward:
            self.synchronize()
        self._raise()

    def _restore(self) -> None:
        """Every shard stepped this iteration back to its state before it: the engine's
        speculation discarded, the kept copies written back."""
        opt, lib = self.opt, _load()
        _check(lib.dfa_opt_discard_speculation(opt._handle), "dfa_opt_discard_speculation")
        for i, (step, *arrays) in self._kept.items():
            for a, t in enumerate(arrays):
                opt._write(i, a, t)
            _check(lib.dfa_opt_set_shard_step(opt._handle, i, step), "dfa_opt_set_shard_step")
        self._kept.clear()

    def _settle_clipping(self) -> None:
        try:
            self.synchronize()
        except BaseException:
            self._restore()  # a failed bucket: the iteration's steps are undone (parameters excepted)
            raise
        params = [p for p in self.opt._params if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads)
        coef = self.max_grad_norm / (total + 1e-6)
        if bool(coef >= 1.0):  # torch multiplies by exactly 1.0: the speculative step stands
            self._kept.clear()
            _check(_load().dfa_opt_commit_speculation(self.opt._handle), "dfa_opt_commit_speculation")
            return
        # Redo: restore every stepped shard, clip as torch does, step again.
        opt = self.opt
        self._restore()
        torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
        groups = opt._group_keys()
        ev = None
        if self._side is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(opt._device))
        self._step_bucket([(p, p.grad) for p in params], ev, groups, speculative=False)
        if self._side is not None:
            torch.cuda.current_stream(opt._device).wait_stream(self._side)
        self._counts["redos"] += 1

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def remove(self) -> None:
        """Waits for the steps in flight, removes the hooks and stops the worker."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._worker.join()


def overlap_with_backward(model: torch.nn.Module, opt: StreamedAdamW, **kw) -> BackwardOverlap:
    """``BackwardOverlap(opt, model, **kw)``: steps during backward, and each module's
    forward waits only for its own parameters' step.  See Note [Overlap with backward]."""
    return BackwardOverlap(opt, model, **kw)
