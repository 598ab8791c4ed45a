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
 - One commit per step: after the iteration's last bucket the worker commits the
   engine's pending speculative state (a queued "commit" that it takes only when no
   bucket of that iteration is left, and before any bucket of the next).  Host tier:
   pointer swaps; file tier: every bucket pass is a speculative step into the state
   file's inactive slot, and the commit carries the shards not stepped and writes one
   commit record (Note [Speculative steps] in optimizer/speculation.cpp): a plain step
   per bucket would carry, and fsync, the whole state once per bucket (with 17 buckets,
   17 times the plain step's I/O).  On the file tier the worker also takes every queued
   bucket whose gradients are done into one pass (``coalesce``), so reads run ahead
   across buckets instead of each pass filling and draining the pipeline; the next
   forward then waits for that pass as a whole.  ``coalesce=k`` (an int) takes at most k
   of them, those the forward needs first: on the host tier, where the link is the
   bottleneck (forward+backward shorter than the state's transfer), passes of k buckets
   fill and drain k times less often, while the next forward waits for at most k
   buckets' pass before its first module runs (the host tier's default stays 1: one
   bucket a pass).
 - Clipping (``max_grad_norm``, the L2 norm of ``clip_grad_norm_``).  Each bucket's
   per-gradient norms are computed as its gradients become final (on the current stream,
   as ``get_total_norm`` computes them: ``torch._foreach_norm`` per device and dtype), so
   the total norm is known when backward ends; ``step()`` stacks them in the order
   ``get_total_norm`` does and takes the same vector norm of them, so the total, the
   coefficient and the clipped gradients (``clip_grads_with_norm_``) are torch's bit for
   bit.  Each iteration either speculates or not:
     * speculating: each bucket is stepped during backward with its gradients as they
       are, its previous state kept (host tier: the engine's speculative step writes the
       new state into a second pinned copy; file tier: the inactive slot; shards the
       engine cannot keep, resident ones, or all with ``engine_speculation=False``, are
       copied out first, counted by ``kept_copies``).  When the coefficient is 1 (torch's
       multiply by 1.0 is exact) the steps stand and the worker commits them.  When it is
       below 1 the buckets still queued are dropped, the one being stepped is waited for,
       the speculation is discarded (kept copies written back), the gradients clipped,
       and every bucket queued again (``redos``) as in the other mode.  Under "auto" a
       bucket holding a shard the engine cannot keep (a resident one) does not speculate:
       it waits for the coefficient as in the other mode, while the others speculate
       (copying a resident shard's state out each iteration cost more than the whole
       step: Megatron's 1.1 G model with resident_mb="auto", about half its state resident,
       took 1,574 ms an iteration inside backward against 299 ms plain on an H100);
     * not speculating: the buckets wait; at ``step()`` the gradients are clipped and
       every bucket is queued, in the forward's order, to be stepped plainly while the
       next forward runs (it waits per module).
   The choice (``clip_policy="auto"``) comes from the last ``clip_history`` iterations:
   speculate while clipping fired in fewer than a quarter of them (none at the start:
   the first iteration does not speculate).  A speculation that does not fire saves the
   step's time after backward; one that fires costs what not speculating costs (the
   redo is queued like the other mode's steps) plus the wait for the bucket in flight
   and the link and SM time the discarded passes took from backward.  A quarter, not a
   half: clipping that fires every other iteration would otherwise be mispredicted on
   every speculation (with a half, a window of odd length speculates after each
   iteration that did not fire), and it settles on not speculating.  ``stats()``
   counts ``speculations`` (iterations), ``redos`` and ``switches`` (changes of mode).
 - Gradient accumulation: inside ``with overlap.accumulating():`` the hooks do nothing,
   so the micro-batches whose backward only adds to ``.grad`` step nothing; the last
   micro-batch's backward, outside the block, completes the gradients and steps them
   (bit-identical to accumulate-then-step).
Limits: the engine's second copy doubles the pinned host memory of the state (12 B/param
more with fp32 moments), allocated at the first speculative iteration; shards the engine
cannot keep still cost a host memcpy of 12 B/param per speculative step (resident
shards: a D2H copy) under clip_policy "speculate" or ``engine_speculation=False``.  A parameter used outside its own module's forward is not waited
for by that forward.  The gradients must not be modified after their bucket is
complete until ``step()``; a backward outside ``accumulating()`` is taken as the last
of its step.  Clipping's norm is the L2 norm over the optimizer's parameters in its
order (``clip_grad_norm_(params)`` over the same list).  On the file tier the BF16
parameters of a pass are written before its commit: a failed commit is reported at the
next ``step()`` or forward, and the parameters then hold the uncommitted step
(``opt.sync_main_from_params`` is not the fix: reload or resume).  Until the next forward
reaches a module (or ``synchronize()``), its parameters may still be written: the
optimizer's state calls and the model's ``state_dict()`` wait for the steps, a direct
read or a replaced storage (``p.data = ...``) does not (Note [Overlap steps settle first]
in optim.py).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from .optim import StreamedAdamW

__all__ = ["BackwardOverlap", "overlap_with_backward"]


class _Bucket:
    def __init__(self, index: int, params: list[torch.Tensor]):
        self.index = index
        self.params = params
        self.ready: set[int] = set()
        self.idle = threading.Event()
        self.idle.set()
        self.event = None  # CUDA event: the bucket's step is done on the side stream
        self.order = -index  # smaller: the next forward needs it sooner (default: the reverse of backward's)
        self.after: list = []  # actions the worker runs once the bucket's queued step is done (run_after)


@dataclass
class _Item:
    """A queued bucket step (``bucket`` set) or an iteration's commit."""
    gen: int  # the iteration
    seq: int  # queue order
    bucket: _Bucket | None = None
    grads: list = field(default_factory=list)  # (param, grad)
    event: object = None  # CUDA: the gradients are done on the current stream
    groups: list = field(default_factory=list)
    speculative: bool = False  # a clipping speculation: keep the previous state
    prepare: object = None  # called by the worker first; returns ``grads`` (gradients made final there)


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm as ``torch.nn.utils.get_total_norm`` computes it."""
    out: list = [None] * len(grads)
    if not grads:
        return out
    for (device, _), ([ts], idx) in _group_tensors_by_device_and_dtype([grads], with_indices=True).items():
        ns = torch._foreach_norm(ts, 2.0) if _has_foreach_support(ts, device) else [
            torch.linalg.vector_norm(g, 2.0) for g in ts]
        for i, n in zip(idx, ns):
            out[i] = n
    return out


def clip_fired(max_norm: float, norm) -> bool:
    """Whether clipping to ``max_norm`` changes grads of total norm ``norm`` (a float or a
    tensor): torch's and Megatron's rule, coefficient max_norm / (norm + 1e-6) below 1.0
    (else they multiply by exactly 1.0, or not at all: no change).  A NaN norm counts as
    fired: the coefficient is NaN, and only a step from the grads left after the clip is
    exact."""
    return not bool(max_norm / (norm + 1e-6) >= 1.0)


class BackwardOverlap:
    """Steps ``opt``'s parameters during backward.  See Note [Overlap with backward].

    Call ``step()`` where ``opt.step()`` was; ``synchronize()`` waits for every step and
    commit; wrap the backward of every micro-batch but the last in ``accumulating()``.
    ``clip_policy``: "auto" (choose per iteration), "speculate" (always) or "after"
    (never speculate).  ``stats()``: buckets stepped, engine passes, speculative bucket
    steps, speculations (iterations), redos, switches, commits, and ``kept_copies``:
    shards whose state was copied out to be kept."""

    # Clipping's norm is computed here from the gradients as they become final
    # (deferalloc.megatron's subclass takes Megatron's own instead).
    own_norms = True

    def __init__(self, opt: StreamedAdamW, model: torch.nn.Module | None = None, *, bucket_mb: int = 256,
                 max_grad_norm: float | None = None, wait_in_forward: bool = True, engine_speculation: bool = True,
                 clip_policy: str = "auto", clip_history: int = 8, coalesce: bool | int | None = None,
                 buckets: list[list[torch.Tensor]] | None = None):
        if clip_policy not in ("auto", "speculate", "after"):
            raise ValueError(f"BackwardOverlap: clip_policy {clip_policy!r} (auto, speculate or after)")
        self.opt = opt
        self.engine_speculation = engine_speculation
        # File tier: bucket passes are speculative steps, committed once per iteration.
        self._commit_tier = engine_speculation and getattr(opt, "tier", "host") == "file"
        if coalesce is None:
            coalesce = self._commit_tier
        # Buckets per engine pass at most (0: no limit).
        self._coalesce = 0 if coalesce is True else 1 if coalesce is False else int(coalesce)
        if self._coalesce < 0:
            raise ValueError(f"BackwardOverlap: coalesce {coalesce!r} (a bool or a number of buckets)")
        self.coalesce = coalesce
        self._speculable: dict | None = None  # per held parameter: the engine keeps its state (after init)
        # (bucket index, start, end) in time.perf_counter() seconds of each bucket's step
        # (-1: a commit) while ``trace`` is True (benchmark timelines; the engine's streamed
        # step returns when its state is home, so the host clock brackets it).
        self.trace = False
        self.timeline: list[tuple[int, float, float]] = []
        self.max_grad_norm = max_grad_norm
        self.clip_policy = clip_policy
        self._fired = collections.deque(maxlen=max(1, clip_history))  # recent iterations: clipping fired
        self._speculate = clip_policy == "speculate"  # this iteration's mode (clipping)
        cuda = opt.device.type == "cuda"
        self._side = torch.cuda.Stream(opt.device) if cuda else None
        # Buckets in reverse registration order, or the caller's (then no gradient hooks:
        # the caller queues a bucket through _ready when its gradients are final).
        self._buckets: list[_Bucket] = []
        cur, size = [], 0
        for p in (reversed(opt.held_params) if buckets is None else ()):
            cur.append(p)
            size += p.numel() * 4
            if size >= bucket_mb << 20:
                self._buckets.append(_Bucket(len(self._buckets), cur))
                cur, size = [], 0
        if cur:
            self._buckets.append(_Bucket(len(self._buckets), cur))
        for ps in buckets or ():
            self._buckets.append(_Bucket(len(self._buckets), list(ps)))
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._lock = threading.Lock()
        # Queued items; _take() picks the next ones.  _busy: items taken, not finished.
        self._cv = threading.Condition()
        self._pending: list[_Item] = []
        self._busy = 0
        self._stop = False
        self._paused = False  # the worker takes nothing new (pause_worker / resume_worker)
        self._seq = 0
        self._gen = 0
        self._accumulating = False
        self._error: BaseException | None = None
        self._failed: set[int] = set()  # iterations with a failed bucket step (their commit discards)
        self._kept: dict = {}  # parameter -> its read_shard_state() before this iteration
        self._norm: dict[torch.Tensor, torch.Tensor] = {}  # this iteration's gradient norms (clipping)
        self._held: list[tuple[_Bucket, list]] = []  # complete buckets waiting for the clip coefficient
        self._stepped: list[tuple[_Bucket, list]] = []  # buckets queued this iteration (a redo queues them again)
        self._counts = {"buckets": 0, "passes": 0, "speculative_steps": 0, "speculations": 0, "redos": 0,
                        "switches": 0, "commits": 0, "kept_copies": 0}
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad) for p in opt.held_params]
                       if buckets is None else [])
        if model is not None and wait_in_forward:
            for m in model.modules():
                own = [p for p in m.parameters(recurse=False) if p in self._bucket_of]
                if own:
                    bs = list({self._bucket_of[p].index: self._bucket_of[p] for p in own}.values())
                    self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, bs=bs: self.wait_buckets(bs)))
        self.wait_in_forward = model is not None and wait_in_forward
        if model is not None:  # Note [Overlap steps settle first] in optim.py
            self._hooks.append(model.register_state_dict_pre_hook(lambda *_a, **_k: self.synchronize()))
        opt.attach_overlap(self)
        self._worker = threading.Thread(target=self._run, name="deferalloc-overlap", daemon=True)
        self._worker.start()

    # ---- for drivers of the buckets other than torch's gradient hooks ------------------------
    # Note [Driving a BackwardOverlap]
    # Rationale: deferalloc.megatron steps Megatron's bucket groups as its reduce-scatters end;
    # it drives this class through these documented members, not its private state.
    # Approach: ``buckets`` (each with ``index`` and ``params``), ``side_stream`` and
    # ``iteration`` are read-only; ``bucket_ready`` queues a bucket, ``wait_buckets`` waits
    # for buckets' steps, ``run_after`` queues an action behind a bucket's step (on the
    # worker, before the bucket counts as done), ``pause_worker`` / ``resume_worker`` hold
    # the worker between items (a driver ordering its own work against the passes; tests
    # use them), ``finish_iteration(settle)`` ends an iteration and
    # ``settle(fired, clip)`` keeps or redoes a clipping speculation.  A subclass may override ``complete_bucket`` (a bucket
    # whose gradients are final at step()) and set ``own_norms = False`` (the driver clips);
    # a driver may set each bucket's ``order`` (smaller: the next forward needs it sooner;
    # the worker and a redo take done buckets in that order, ``-index`` by default).
    # Limits: one driver per overlap; the gradient hooks are off when ``buckets`` is given.

    @property
    def buckets(self) -> tuple:
        return tuple(self._buckets)

    @property
    def side_stream(self):
        """The CUDA stream the bucket steps run on (None on the CPU)."""
        return self._side

    @property
    def iteration(self) -> int:
        """The iteration being stepped (counts ``step()`` calls)."""
        return self._gen

    # ---- hooks ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def accumulating(self):
        """Backward inside this block only accumulates into ``.grad``: nothing is stepped.
        The micro-batch whose backward completes the gradients runs outside it."""
        self._accumulating = True
        try:
            yield self
        finally:
            self._accumulating = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._accumulating:
            return
        b = self._bucket_of[p]
        with self._lock:
            b.ready.add(id(p))
            full = len(b.ready) == len(b.params)
        if full:
            self.complete_bucket(b)

    def complete_bucket(self, b: _Bucket) -> None:
        """Bucket ``b``'s gradients are final: its norms (clipping), then queued, or held
        for the clip coefficient."""
        with self._lock:
            if not b.ready:
                return
            ready = [p for p in b.params if id(p) in b.ready and p.grad is not None]
            b.ready = set()
        if not ready:
            return
        if self.max_grad_norm is not None and self.own_norms:
            with torch.no_grad():
                for p, n in zip(ready, _norms([p.grad for p in ready])):
                    self._norm[p] = n
        self.bucket_ready(b, ready)

    def bucket_ready(self, b: _Bucket, params: list, prepare=None) -> None:
        """Bucket ``b``'s ``params`` have final gradients (``prepare``: the worker makes them
        final, and returns them as (param, grad), before stepping): queued, or held for the
        clip coefficient (they are then read from ``.grad`` when it is known)."""
        self.opt.initialize_state()  # the state starts from the parameters' values at the first step
        if self._speculable is None:  # (initialize picks the resident shards)
            self._speculable = {p: self.engine_speculation and self.opt.can_speculate(p) for p in self.opt.held_params}
        if self.max_grad_norm is not None and (not self._speculate or self._would_copy(params)):
            self._held.append((b, params))
            return
        self._queue(b, params, speculative=self.max_grad_norm is not None, prepare=prepare)

    def _would_copy(self, params: list) -> bool:
        """Under clip_policy "auto", whether speculating on ``params`` would copy a shard's
        state out first (a resident shard, which the engine cannot keep): such a bucket is
        held for the clip coefficient instead (Note [Overlap with backward], clipping)."""
        return self.clip_policy == "auto" and self.engine_speculation and not all(
            self._speculable[p] for p in params)

    def _queue(self, b: _Bucket, params: list, speculative: bool, prepare=None) -> None:
        b.idle.wait()  # the previous iteration's step of this bucket
        b.idle.clear()
        ev = None
        if self._side is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.opt.device))
        self._stepped.append((b, params))
        grads = [] if prepare is not None else [(p, p.grad) for p in params]
        self._put(_Item(self._gen, 0, b, grads, ev, self.opt.hyperparameters(), speculative, prepare))

    def _put(self, item: _Item) -> None:
        with self._cv:
            self._seq += 1
            item.seq = self._seq
            self._pending.append(item)
            self._cv.notify_all()

    def pause_worker(self) -> None:
        """The worker finishes the item it is on and takes nothing new until resume_worker()."""
        with self._cv:
            self._paused = True
            while self._busy:
                self._cv.wait()

    def resume_worker(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def wait_buckets(self, buckets: list[_Bucket]) -> None:
        for b in buckets:
            b.idle.wait()
            if b.event is not None:
                torch.cuda.current_stream(self.opt.device).wait_event(b.event)
        self._raise()

    # ---- the worker ----------------------------------------------------------------------------

    def _take(self) -> list[_Item] | None:
        """The next items, all of the oldest iteration queued: its commit once no bucket
        of it is left; else, of its buckets whose gradients are done on the GPU, the one
        the forward needs first (highest index; ``coalesce``: the first k of them in that
        order, or all), and if none is done, the one queued first.  None: stop."""
        with self._cv:
            while (not self._pending or self._paused) and not self._stop:
                self._cv.wait()
            if not self._pending:
                return None
            gen = min(x.gen for x in self._pending)
            cur = [x for x in self._pending if x.gen == gen]
            buckets = [x for x in cur if x.bucket is not None]
            if not buckets:
                picks = cur[:1]
            else:
                done = [x for x in buckets if x.event is None or x.event.query()]
                if not done:
                    picks = [min(buckets, key=lambda x: x.seq)]
                else:
                    done.sort(key=lambda x: x.bucket.order)  # the forward's order
                    picks = [x for x in done if x.speculative == done[0].speculative]
                    if self._coalesce:
                        picks = picks[:self._coalesce]
            for x in picks:
                self._pending.remove(x)
            self._busy += 1
            return picks

    def _run(self) -> None:
        while True:
            items = self._take()
            if items is None:
                return
            try:
                if self._error is not None and items[0].bucket is not None:
                    # Not stepped after an earlier failure: its iteration's commit discards.
                    self._failed.add(items[0].gen)
                else:  # commits always run: a failed iteration's commit restores the state
                    t0 = time.perf_counter()
                    if items[0].bucket is None:
                        self._commit(items[0].gen)
                    else:
                        self._step_bucket(items)
                    if self.trace:
                        if self._side is not None:
                            self._side.synchronize()
                        t1 = time.perf_counter()
                        self.timeline += [(x.bucket.index if x.bucket else -1, t0, t1) for x in items]
                    if items[0].bucket is not None:
                        for x in items:
                            self._run_after(x.bucket)
                        if self._side is not None:
                            done = torch.cuda.Event()
                            done.record(self._side)
                            for x in items:
                                x.bucket.event = done
            except BaseException as e:  # reported by the next step() or forward
                self._error = e
                self._failed.add(items[0].gen)
            finally:
                for x in items:
                    x.grads = None
                    if x.bucket is not None:
                        self._release(x.bucket)
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _run_after(self, b: _Bucket) -> bool:
        """Runs the actions queued behind bucket ``b``'s step (side stream); whether any ran."""
        with self._cv:
            fns, b.after = b.after, []
        if not fns:
            return False
        ctx = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            for fn in fns:
                fn()
        return True

    def _release(self, b: _Bucket) -> None:
        """Bucket ``b`` idle, with every action queued behind it run (one queued while the
        step finished runs here, and the bucket's event then covers it)."""
        while True:
            with self._cv:
                if not b.after:
                    b.idle.set()
                    return
            try:
                self._run_after(b)
            except BaseException as e:  # reported by the next step() or forward
                self._error = e
            if self._side is not None:
                done = torch.cuda.Event()
                done.record(self._side)
                b.event = done

    def run_after(self, b: _Bucket, fn) -> bool:
        """``fn()`` once bucket ``b``'s queued or running step is done: on the worker, on the
        side stream, before the bucket's event and before the bucket counts as done (so
        ``wait_buckets`` waits for it too); at once, on the current stream after the
        bucket's event, when no step of it is queued or running.  Whether it was queued."""
        with self._cv:
            if not b.idle.is_set():
                b.after.append(fn)
                return True
        self.wait_buckets([b])
        with torch.no_grad():
            fn()
        return False

    def _commit(self, gen: int) -> None:
        """Iteration ``gen``'s commit; one whose bucket step failed is discarded instead (its
        kept copies written back): the state stays the previous step's."""
        if gen in self._failed:
            self._failed.discard(gen)
            self._restore()
            return
        if self.opt.speculation_pending():
            self.opt.commit_speculation()
            self._counts["commits"] += 1
        self._kept.clear()

    def _step_bucket(self, items: list[_Item]) -> None:
        """One engine pass over the items' gradients.  The engine's speculative step for the
        shards it can keep when the items speculate (clipping) or on the file tier; the
        others plainly, their state copied out first when the items speculate."""
        opt = self.opt
        for x in items:
            if x.prepare is not None:
                x.grads = x.prepare()
        speculative = items[0].speculative
        use_engine = speculative or self._commit_tier
        grads, spec = [], set()
        for x in items:
            for p, g in x.grads:
                grads.append((p, g))
                if use_engine and self._speculable[p]:
                    spec.add(p)
                elif speculative and p not in self._kept:
                    self._kept[p] = opt.read_shard_state(p)
                    self._counts["kept_copies"] += 1
        if self._side is not None:
            for x in items:
                self._side.wait_event(x.event)
            # Note [Grads freed behind a queued pass]
            # Rationale: a grad handed here may be a temporary made on the compute stream
            # (Megatron's ``.float()`` of a BF16 grad buffer, read through ``p.grad`` for a
            # held or redone bucket); step_grads only queues the pass on the side stream for
            # resident shards, and the references here end when it returns.
            # Approach: each CUDA grad is marked as used by the side stream, so the caching
            # allocator reuses its block only after the side stream's work queued so far.
            # Limits: none beyond record_stream's (the block's reuse waits for the whole pass).
            for _, g in grads:
                if g.is_cuda:
                    g.record_stream(self._side)
        opt.step_grads(grads, speculative=spec, hyperparameters=items[-1].groups, stream=self._side)
        self._counts["passes"] += 1
        self._counts["buckets"] += len(items)
        if speculative:
            self._counts["speculative_steps"] += len(items)

    # ---- the user's side -----------------------------------------------------------------------

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def synchronize(self) -> None:
        """Waits until every queued bucket is stepped and committed (the current stream
        waits for them); on the overlap's own worker (a state access from a bucket step)
        it returns at once."""
        if threading.current_thread() is getattr(self, "_worker", None):
            return
        with self._cv:
            while self._pending or self._busy:
                self._cv.wait()
        self.wait_buckets(self._buckets)

    @torch.no_grad()
    def step(self) -> None:
        """Ends the iteration: completes the buckets still incomplete (parameters without a
        gradient are skipped, as by ``opt.step()``), settles clipping, queues the commit
        and returns; with a model and ``wait_in_forward`` the next forward waits per
        module, else this waits."""
        self.finish_iteration(self._settle_clipping if self.max_grad_norm is not None else None)

    def finish_iteration(self, settle) -> None:
        """step() with ``settle`` (or None: no clipping) deciding the clip coefficient."""
        if self._accumulating:
            raise RuntimeError("BackwardOverlap.step() inside accumulating()")
        self._raise()
        self.opt.initialize_state()
        for b in self._buckets:
            self.complete_bucket(b)
        try:
            if settle is not None:
                settle()
        finally:
            self._held, self._stepped = [], []
            self._norm.clear()
            self._put(_Item(self._gen, 0))  # the commit
            self._gen += 1
        if not self.wait_in_forward:
            self.synchronize()
        self._raise()

    def _restore(self) -> None:
        """Every shard stepped this iteration back to its state before it: the engine's
        speculation discarded, the kept copies written back."""
        self.opt.discard_speculation()
        for p, st in self._kept.items():
            self.opt.write_shard_state(p, st)
        self._kept.clear()

    def _total_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """``get_total_norm`` of the parameters' gradients from the norms computed as they
        became final: the same per-gradient norms, stacked in its order."""
        grads = [p.grad for p in params]
        missing = [p for p in params if p not in self._norm]
        for p, n in zip(missing, _norms([p.grad for p in missing])):
            self._norm[p] = n
        first = grads[0].device
        order = [i for _, (_, idx) in _group_tensors_by_device_and_dtype([grads], with_indices=True).items()
                 for i in idx]
        return torch.linalg.vector_norm(torch.stack([self._norm[params[i]].to(first) for i in order]), 2.0)

    def _settle_clipping(self) -> None:
        params = [p for p in self.opt.held_params if p.grad is not None]
        if not params:
            return
        total = self._total_norm(params)
        self.settle(clip_fired(self.max_grad_norm, total),
                    lambda: torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total))

    def settle(self, fired: bool, clip) -> None:
        """Speculation kept (commit) or discarded and redone, once whether clipping
        ``fired`` is known; ``clip()`` clips the gradients in place (None: already clipped
        by the caller, which must not have changed any gradient when it did not fire)."""
        todo = self._held
        if self._speculate:
            self._counts["speculations"] += 1
            if fired:
                # Drop this iteration's buckets still queued, wait for the one in flight,
                # put every stepped shard back, and queue them all again below.
                with self._cv:
                    drop = [x for x in self._pending if x.gen == self._gen and x.bucket is not None]
                    for x in drop:
                        self._pending.remove(x)
                        x.bucket.idle.set()
                try:  # (the previous iteration's commit too: a discard drops all that is pending)
                    self.synchronize()  # (raises a failed step's error)
                finally:
                    self._restore()
                todo = self._stepped + self._held
                self._counts["redos"] += 1
        if fired and clip is not None:
            clip()
        if todo:
            self._stepped = []
            for b, ps in sorted(todo, key=lambda t: t[0].order):  # the forward's order
                self._queue(b, ps, speculative=False)
        self._choose(fired)

    def _choose(self, fired: bool) -> None:
        """The next iteration's mode (clip_policy "auto"): speculate while clipping fired
        in fewer than a quarter of the recent iterations."""
        self._fired.append(fired)
        if self.clip_policy != "auto":
            return
        nxt = 4 * sum(self._fired) < len(self._fired)
        if nxt != self._speculate:
            self._counts["switches"] += 1
        self._speculate = nxt

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def remove(self) -> None:
        """Waits for the steps in flight, removes the hooks and stops the worker."""
        try:
            self.synchronize()
        finally:
            for h in self._hooks:
                h.remove()
            self.opt.detach_overlap(self)
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._worker.join()


def overlap_with_backward(model: torch.nn.Module, opt: StreamedAdamW, **kw) -> BackwardOverlap:
    """``BackwardOverlap(opt, model, **kw)``: steps during backward, and each module's
    forward waits only for its own parameters' step.  See Note [Overlap with backward]."""
    return BackwardOverlap(opt, model, **kw)
