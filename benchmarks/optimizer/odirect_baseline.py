"""The baseline a Megatron RL user has today for optimizer state on NVMe: a synchronous
per-bucket AdamW step with direct I/O, on the calling thread.

Note [The synchronous O_DIRECT baseline]
Rationale: the file tier's step is measured against what that stack does when its FP32 main
params and Adam moments live on a disk: for each bucket of parameters, read the bucket's main
+ exp_avg + exp_avg_sq with O_DIRECT into one pinned staging buffer, copy it to the GPU, run
torch's fused AdamW there, copy the result back, write it with O_DIRECT; the next bucket only
after that.  Nothing overlaps: the disk reads, the PCIe copies, the kernel and the disk
writes take turns.
Approach: one file; the parameters' elements are concatenated (in the order given) and cut
into buckets of at most `staging_bytes / 12` elements (a multiple of 1024, so that each of a
bucket's three FP32 arrays is whole 4 KiB pages).  A bucket occupies [main | exp_avg |
exp_avg_sq] of its padded size in the file, one preadv / pwritev each way through the staging
buffer (page-aligned: O_DIRECT needs the buffer, the offset and the length aligned).  On the
device the bucket's arrays are cut into the views of the parameters it covers and stepped by
`torch._fused_adamw_` (torch.optim.AdamW(fused=True)'s kernel; FP32 gradients, as Megatron's
main_grad), then the model parameters take the new main (a 16-bit parameter rounded).  One
fsync per step, so that the step is as durable as the file tier's commit.  The state is
created (main from the parameters, zero moments) by the constructor, not by a step.
The gradient is the attribute `grad_attr` of each parameter (`grad`, or Megatron's FP32
`main_grad`).
Limits: where the file system refuses O_DIRECT (tmpfs) the file is opened for buffered I/O
and `reason` says why (a figure then measures the page cache, not the disk).  Parameters must
be contiguous; amsgrad / maximize are not offered.
"""
from __future__ import annotations

import ctypes
import errno
import os

import torch

ALIGN = 4096
ELEMENT_ALIGN = ALIGN // 4  # FP32 elements per page


def aligned_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, view): ``nbytes`` of host memory whose address is a multiple of ALIGN
    (pinned where ``pin``).  A page-aligned allocation is used as it is; otherwise one
    page more is allocated and the view starts at its first aligned byte."""
    owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if owner.data_ptr() % ALIGN:
        owner = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-owner.data_ptr()) % ALIGN
    return owner, owner[off:off + nbytes]


def _mem(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview of the first ``nbytes`` of host tensor ``t`` (for preadv)."""
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class ODirectAdamW:
    """AdamW over ``params`` (tensors with a gradient in ``grad_attr``; any floating dtype,
    on one device) whose FP32 main params and moments live in the file ``path``.  ``step()``
    runs the synchronous per-bucket loop of Note [The synchronous O_DIRECT baseline]."""

    def __init__(self, params, path: str, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, staging_bytes: int = 256 << 20, direct: bool = True,
                 fsync: bool = True, grad_attr: str = "grad"):
        self.params = list(params)
        if not self.params:
            raise ValueError("ODirectAdamW: no parameters")
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError("ODirectAdamW: parameters must be contiguous")
        missing = [i for i, p in enumerate(self.params) if not hasattr(p, grad_attr)]
        if missing:  # a parameter with the attribute set to None is one without a gradient this step
            raise ValueError(f"ODirectAdamW: grad_attr={grad_attr!r}, but {len(missing)} of {len(self.params)} "
                             f"parameters (the first at index {missing[0]}) have no such attribute; with "
                             "'main_grad', build the optimizer after Megatron's DDP has wrapped the model")
        self.device = self.params[0].device
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.grad_attr = grad_attr
        self.fsync = fsync
        self.param_steps = [0] * len(self.params)
        cap = staging_bytes // 12 // ELEMENT_ALIGN * ELEMENT_ALIGN
        if cap == 0:
            raise ValueError(f"ODirectAdamW: staging_bytes {staging_bytes} holds no bucket of {ELEMENT_ALIGN} elements")
        self.staging_bytes = 12 * cap
        # Buckets: (file offset, padded elements, [(param index, first element, count, bucket element)]).
        self.buckets = []
        pieces, used, offset = [], 0, 0
        for i, p in enumerate(self.params):
            e, n = 0, p.numel()
            while e < n:
                k = min(n - e, cap - used)
                pieces.append((i, e, k, used))
                e, used = e + k, used + k
                if used == cap:
                    self.buckets.append((offset, cap, pieces))
                    offset += 12 * cap
                    pieces, used = [], 0
        if used:
            pad = -(-used // ELEMENT_ALIGN) * ELEMENT_ALIGN
            self.buckets.append((offset, pad, pieces))
            offset += 12 * pad
        self.file_bytes = offset
        cuda = self.device.type == "cuda"
        self._owner, self.staging = aligned_buffer(self.staging_bytes, pin=cuda)
        self._staging32 = self.staging.view(torch.float32)
        self._dev = torch.empty(3 * cap, dtype=torch.float32, device=self.device) if cuda else None
        self.path = path
        self.direct, self.reason = direct, None
        self.fd = self._open(os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self._initialize()

    # ---- I/O ------------------------------------------------------------------------------
    def _open(self, flags: int) -> int:
        if self.direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._buffered(f"open with O_DIRECT refused ({e.strerror})")
        return os.open(self.path, flags, 0o600)

    def _buffered(self, why: str) -> None:
        self.direct = False
        self.reason = f"{os.path.dirname(os.path.abspath(self.path))}: {why}; buffered I/O instead"
        print(f"ODirectAdamW: {self.reason}", flush=True)

    def _io(self, write: bool, offset: int, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            view = _mem(self.staging[done:], nbytes - done)
            k = (os.pwritev if write else os.preadv)(self.fd, [view], offset + done)
            if k <= 0:
                raise OSError(errno.EIO, f"ODirectAdamW: short {'write' if write else 'read'} at {offset + done} "
                              f"of {self.path}")
            done += k

    def _initialize(self) -> None:
        """main = the parameters in FP32, zero moments, bucket by bucket."""
        for index, (offset, pad, pieces) in enumerate(self.buckets):
            st = self._staging32[:3 * pad]
            st.zero_()
            for i, e, k, b in pieces:
                st[b:b + k].copy_(self.params[i].detach().view(-1)[e:e + k])
            try:
                self._io(True, offset, 12 * pad)
            except OSError as err:  # a file system that opens with O_DIRECT but refuses its writes
                if index or not self.direct or err.errno != errno.EINVAL:
                    raise
                os.close(self.fd)
                self._buffered(f"O_DIRECT write refused ({err.strerror})")
                self.fd = self._open(os.O_RDWR | os.O_CREAT | os.O_TRUNC)
                self._io(True, offset, 12 * pad)
        os.fsync(self.fd)

    # ---- the step -------------------------------------------------------------------------
    def _views(self, flat: torch.Tensor, pad: int, pieces):
        main, m, v = flat[:pad], flat[pad:2 * pad], flat[2 * pad:3 * pad]
        return ([main[b:b + k] for _, _, k, b in pieces], [m[b:b + k] for _, _, k, b in pieces],
                [v[b:b + k] for _, _, k, b in pieces])

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        # Step counts per parameter, as torch's AdamW keeps them (one without a gradient is
        # not stepped); one device scalar per count (the kernel reads them only).
        grads_of = [getattr(p, self.grad_attr) for p in self.params]
        for i, g in enumerate(grads_of):
            self.param_steps[i] += g is not None
        counts = {c: torch.tensor(float(c), dtype=torch.float32, device=self.device) for c in set(self.param_steps)}
        for offset, pad, pieces in self.buckets:
            pieces = [q for q in pieces if grads_of[q[0]] is not None]
            if not pieces:
                continue
            nbytes = 12 * pad
            self._io(False, offset, nbytes)
            st = self._staging32[:3 * pad]
            if self._dev is not None:
                flat = self._dev[:3 * pad]
                flat.copy_(st)  # pinned -> device, blocking
            else:
                flat = st
            mains, ms, vs = self._views(flat, pad, pieces)
            grads = [grads_of[i].view(-1)[e:e + k].float() for i, e, k, _ in pieces]
            steps = [counts[self.param_steps[i]] for i, _, _, _ in pieces]
            torch._fused_adamw_(mains, grads, ms, vs, [], steps, lr=self.lr, beta1=beta1, beta2=beta2,
                                weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)
            for (i, e, k, _), main in zip(pieces, mains):
                self.params[i].view(-1)[e:e + k].copy_(main)
            if self._dev is not None:
                st.copy_(flat)  # device -> pinned, blocking
            self._io(True, offset, nbytes)
        if self.fsync:
            os.fsync(self.fd)

    def bytes_per_step(self) -> tuple[int, int]:
        """(bytes read, bytes written) by a step in which every parameter has a gradient."""
        return self.file_bytes, self.file_bytes

    @torch.no_grad()
    def read_state(self) -> list[dict[str, torch.Tensor]]:
        """Each parameter's main_param, exp_avg and exp_avg_sq, read from the file (FP32
        CPU tensors of the parameter's shape)."""
        out = [{k: torch.empty(p.numel(), dtype=torch.float32) for k in ("main_param", "exp_avg", "exp_avg_sq")}
               for p in self.params]
        for offset, pad, pieces in self.buckets:
            self._io(False, offset, 12 * pad)
            st = self._staging32[:3 * pad]
            for key, arrays in zip(("main_param", "exp_avg", "exp_avg_sq"), self._views(st, pad, pieces)):
                for (i, e, k, _), a in zip(pieces, arrays):
                    out[i][key][e:e + k].copy_(a)
        return [{k: t.view(p.shape) for k, t in d.items()} for d, p in zip(out, self.params)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._owner = self.staging = self._staging32 = self._dev = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
