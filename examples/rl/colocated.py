"""The colocated RL cycle: a megatron-core trainer and a rollout engine on one GPU, each
giving its memory back while the other works.

    python examples/rl/colocated.py --device cuda --steps 5 --saver deferalloc --directory /tmp/rl --json rl.json
    python examples/rl/colocated.py --device cuda --steps 5 --saver torch_memory_saver ...   # the real package
    python examples/rl/colocated.py --device cuda --steps 5 --saver none ...    # nobody sleeps: the reference
    # no GPU: megatron-core's CPU emulation, deferalloc's host driver, a tiny model
    DEFERALLOC_CONF=driver:host python examples/rl/colocated.py --device cpu --steps 3 --directory /tmp/rl

Three processes: this launcher, the trainer and the inference side (torch.multiprocessing
spawn, one pipe each).  The trainer is examples/megatron/train_gpt.py's model (local spec,
BF16; ``--model``: HybridModel of "*-" per GPT layer from megatron-core 0.19 on, else GPTModel)
under DistributedDataParallel with megatron-core's DistributedOptimizer, its main params
deferred and its FP32 state on deferalloc's file tier (``--directory``); its
model, DDP buffers (params, grads) in the region "train" (kept: pinned host backup), its
forward and backward in "train_act" (discarded).  The inference side is a Hugging Face GPT-2
given the trainer's weights (rollout.py, Note [Megatron's GPT as a Hugging Face GPT-2]):
weights in the region "weights" (discarded: every step loads new ones), its static KV cache
and the CUDA graph of its decode step in "kv" (discarded).  Each RL step:
  1. inference: wake (resume), load the published weights, generate (greedy), sleep (pause);
  2. trainer: wake, one Megatron step on the rollouts (a reward-weighted log-likelihood),
     publish its weights into shared host memory, sleep.
The weights travel through one file in /dev/shm (the temporary directory when /dev/shm is too
small) mapped by both processes (each parameter's bytes at an aligned offset; the trainer
writes, the inference side copies them to the device in one transfer and converts there).  The trainer publishes once after it is built, so step
1's rollouts come from the initial weights.

``--saver`` picks the memory saver: "deferalloc" (deferalloc.memory_saver, torch_memory_saver's
API), "torch_memory_saver" (the real package, imported by its own name) or "none" (nobody
sleeps: the reference run).  Only torch_memory_saver's API is used, so the two savers differ by
the import.  ``--hook-mode`` is the savers' (default "preload" on CUDA, their default and the
one under which torch_memory_saver pauses CUDA graphs; "torch" on the CPU).

``--nccl-cumem-off`` runs the trainer's NCCL with NCCL_CUMEM_ENABLE=0, ``--nccl-small`` with
1 MiB buffers and one channel (both off by default: Note [The trainer's NCCL setting]).

``--trainer-backend single`` runs the trainer's process groups on the single-rank backend
(examples/megatron/single_rank.py: Note [A single-rank process group]): its collectives done
in place, no NCCL communicator (default "nccl": NCCL on CUDA, gloo on the CPU).

``--pool-cache-mb N`` appends ``pool_cache_mb:N`` to the DEFERALLOC_CONF both sides start with
(the caller's DEFERALLOC_CONF reaches both either way; the last value of a key wins): 0 gives
deferalloc's chunk pool cache back at each pause.  The report records the DEFERALLOC_CONF
the sides started with.

``--kill-after-step N`` kills both processes (SIGKILL) once step N has been committed;
``--resume`` starts from the file tier's last committed step (the trainer's main params,
moments and step counts; the model's BF16 weights are written from the main params).

The report (``--json``, and a table on stdout) has per step: each side's sleep and wake
seconds, its work (load, generate; train, publish), the step's wall seconds and the share
spent in sleep + wake, the loss (as a float hex) and a digest of the rollouts; device memory
(CUDA: cuMemGetInfo from the launcher) at each hand-off, when both sides sleep: each side's
CUDA context measured as it started, what they hold beyond it together, and at the end what
each holds asleep alone (the inference side exits first), itemised by owner (``held_items``:
Sleeper.held, itemise).  A child that fails is reported with its traceback and the last
phase it reached (exit_story).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MEGATRON_EXAMPLE = os.path.join(ROOT, "examples", "megatron")
ALIGN = 256  # byte alignment of each published parameter
PROBE_ROWS, PROBE_POSITIONS = 2, 8  # the trainer's logits the converted model is checked against


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="the last RL step")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--saver", choices=["deferalloc", "torch_memory_saver", "none"], default="deferalloc")
    ap.add_argument("--hook-mode", choices=["preload", "torch"], help="default: preload on cuda, torch on cpu")
    ap.add_argument("--directory", required=True, help="the trainer's file tier (its state file)")
    ap.add_argument("--overwrite", action="store_true", help="remove a state file left in --directory first")
    ap.add_argument("--resume", action="store_true", help="continue from --directory's last committed step")
    ap.add_argument("--kill-after-step", type=int, default=0, help="SIGKILL both sides after this step")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--message-timeout", type=float, default=600.0,
                    help="seconds a side may stay silent (building, a turn) before the run fails")
    ap.add_argument("--model", choices=["auto", "gpt", "hybrid"], default="auto",
                    help="the trainer's class (train_gpt.py's --model; auto: HybridModel from megatron-core 0.19 on)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="rollouts per step (the training batch)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--window-mb", type=int, default=64, help="the optimizer engine's window")
    ap.add_argument("--nccl-cumem-off", action="store_true",
                    help="the trainer's NCCL with NCCL_CUMEM_ENABLE=0: its buffers from cudaMalloc, not cuMem "
                         "(vLLM's default; SGLang and slime run so)")
    ap.add_argument("--nccl-small", action="store_true",
                    help="the trainer's NCCL with NCCL_BUFFSIZE=1 MiB and one channel (NCCL_MIN/MAX_NCHANNELS=1): "
                         "its single-rank communicators' buffers shrink to almost nothing")
    ap.add_argument("--pool-cache-mb", type=int,
                    help="deferalloc's pool_cache_mb in both sides (appended to their DEFERALLOC_CONF; default: "
                         "the caller's, else 64): 0 gives the chunk pool's cache back at each pause")
    ap.add_argument("--trainer-backend", choices=["nccl", "single"], default="nccl",
                    help="the trainer's process groups: NCCL (gloo on the CPU), or single: one rank, its collectives "
                         "done in place without NCCL (Note [A single-rank process group])")
    args = ap.parse_args(argv)
    if args.hook_mode is None:
        args.hook_mode = "preload" if args.device == "cuda" else "torch"
    if args.gen_len < 3:
        ap.error("--gen-len must be at least 3")
    if args.device == "cpu" and args.saver == "torch_memory_saver":
        ap.error("--saver torch_memory_saver needs CUDA")
    return args


# ---- the memory saver, by its import ----------------------------------------------------------

def saver_module(kind: str):
    """The torch_memory_saver module of ``kind``: deferalloc's drop-in, or the real package."""
    if kind == "deferalloc":
        import deferalloc.memory_saver as m
        return m
    if kind == "torch_memory_saver":
        import torch_memory_saver as m
        if getattr(m, "__deferalloc__", False):
            raise RuntimeError("--saver torch_memory_saver imported deferalloc's drop-in (its shim is on "
                               "PYTHONPATH): the comparison needs the real package")
        return m
    return None


class Sleeper:
    """One side's regions and its sleep / wake through a torch_memory_saver API (or none)."""

    def __init__(self, kind: str, hook_mode: str):
        self.kind, self.hook_mode = kind, hook_mode
        self.saver = None
        if kind != "none":
            self.saver = saver_module(kind).torch_memory_saver
            self.saver.hook_mode = hook_mode
        self.asleep = False

    def region(self, tag: str, keep: bool = False):
        if self.saver is None:
            return contextlib.nullcontext()
        return self.saver.region(tag, enable_cpu_backup=keep)

    def graph(self, tag: str):
        """A context maker for the decode step's capture: the graph's memory in ``tag``.
        torch_memory_saver pauses a graph in its preload mode only (its cuda_graph asserts
        it): in its torch mode the graph is captured plainly and its memory stays."""
        import torch
        if self.saver is None or (self.kind == "torch_memory_saver" and self.hook_mode == "torch"):
            return torch.cuda.graph
        return lambda g: self.saver.cuda_graph(g, tag=tag)

    def exit(self, conn) -> None:
        """Note [Leaving with a saver]: the end of a side, awake (every region resumed).
        torch_memory_saver's torch hook mode aborts the process (exit code 1, "only support
        interesting region ... tms_torch_free") when its pluggable allocator frees a block
        outside a region, which the interpreter's teardown does when it drops the region's
        memory pool and the tensors still in it; its preload mode frees outside a region
        through the real cudaFree, on addresses it mapped itself.  So with
        torch_memory_saver the side announces its exit and leaves by os._exit(0) once its
        work is reported (streams flushed): the driver takes the process's memory back.
        deferalloc's saver frees a region's blocks wherever they are dropped, and its side
        runs the ordinary teardown (which the tests exercise)."""
        self.wake()
        conn.send(("phase", "exit"))
        if self.kind == "torch_memory_saver":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def _timed(self, fn) -> float:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def sleep(self) -> float:
        """Note [What a sleep gives back]: the side's free blocks first, then its regions.
        Megatron's grad sync and optimizer step run outside the regions (train_on says why):
        the blocks they freed (FP32 grad copies, the norm's temporaries) stayed in torch's
        cache, held through every sleep (about 1.3 GiB more than after building on the
        68 M-parameter model).  torch.cuda.empty_cache() before the pause gives back every
        free cached block of torch's default pool, while the side is awake (a block is freed
        before its region is paused, never after: torch_memory_saver's preload mode cannot
        free a paused allocation).  A live region's MemPool (the torch hook modes) keeps its
        blocks; its pause gives them back.  Cost, in the timed sleep: a synchronisation and
        a cudaFree per free segment, and cudaMalloc again in the next turn (in preload mode
        the regions' free blocks too)."""
        if self.saver is None or self.asleep:
            return 0.0
        self.asleep = True

        def sleep():
            release_cached()
            self.saver.pause()
        return self._timed(sleep)

    def held(self) -> dict:
        """What this process holds, by owner, for the report (Note [What a sleep gives
        back]): torch's allocated and reserved bytes in all pools and in its default pool
        (outside the regions in the torch hook modes; in preload mode the regions' segments
        are in the default pool too, their memory given back while paused), and
        deferalloc's backed and cached bytes (its saver only).  Empty on the CPU."""
        import torch
        if not torch.cuda.is_available():
            return {}
        out = {"torch_allocated": torch.cuda.memory_allocated(), "torch_reserved": torch.cuda.memory_reserved()}
        default = [g for g in torch.cuda.memory_snapshot() if tuple(g.get("segment_pool_id", (0, 0))) == (0, 0)]
        out["torch_default_pool_allocated"] = sum(g.get("allocated_size", 0) for g in default)
        out["torch_default_pool_reserved"] = sum(g.get("total_size", 0) for g in default)
        if self.kind == "deferalloc":
            import deferalloc
            st = deferalloc.memory_stats()
            out["deferalloc_backed"] = st.get("deferalloc.backed_bytes", 0)
            out["deferalloc_pool_cached"] = st.get("deferalloc.pool.cached_bytes", 0)
        return out

    def wake(self) -> float:
        if self.saver is None or not self.asleep:
            return 0.0
        self.asleep = False
        return self._timed(self.saver.resume)


def prompts_of(args, step: int):
    import torch
    g = torch.Generator().manual_seed(args.seed * 7919 + step)
    return torch.randint(0, args.vocab, (args.batch, args.prompt_len), generator=g)


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def _init_device(args) -> None:
    import torch
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("colocated.py --device cuda: no CUDA device visible")
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # the context, measured by the launcher


def release_cached() -> None:
    """After building and before each sleep: the blocks freed outside the regions (the
    model's first copy of each parameter before DDP's buffers took them, initialisation
    temporaries, the step's) given back, so that no sleep backs up or keeps them."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def weights_file(name: str, nbytes: int) -> str:
    """Where the weights are published: /dev/shm when it has room for them (a container's
    is often 64 MiB, and a shared mapping past a full tmpfs faults), else the temporary
    directory (a file in the page cache, mapped the same way)."""
    import tempfile
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= nbytes + (64 << 20):
            return os.path.join("/dev/shm", name)
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), name)


def _map_weights(path: str, nbytes: int):
    """The published weights: ``path`` mapped shared, as uint8 (pinned where CUDA can)."""
    import torch
    flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        try:  # page-locked: the copies run at the link's speed (best effort)
            torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), nbytes, 0)
        except Exception:  # noqa: BLE001 - a pageable copy still works
            pass
    return flat


# ---- the trainer ------------------------------------------------------------------------------

NCCL_SMALL = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1"}
NCCL_VARIABLES = ("NCCL_CUMEM_ENABLE", *NCCL_SMALL)  # what the trainer's report records


def trainer_environment(args) -> dict:
    """Note [The trainer's NCCL setting]: the variables the trainer sets before NCCL starts.
    Rationale: NCCL's communicators are most of what the trainer holds asleep: Megatron's
    process groups each make one at their first collective, and even with a single rank each
    allocates its channels' buffers (benchmarks/pause_resume/nccl_footprint.py measures them).
    This trainer has one rank, so every communicator is a single rank: no peer traffic, its
    buffers carry nothing, and their size and number of channels cost no bandwidth here.
    Approach: in the trainer only (the inference side runs no NCCL), before torch.distributed
    and Megatron initialise, so before the first communicator; the report records what NCCL
    saw.  --nccl-small sets NCCL_BUFFSIZE=1 MiB and NCCL_MIN/MAX_NCHANNELS=1: each further
    communicator then holds about 10 MiB instead of about 390 (nccl_footprint.py's "small",
    its collectives checked).  --nccl-cumem-off sets NCCL_CUMEM_ENABLE=0 (buffers from
    cudaMalloc, not cuMem: vLLM's default, SGLang and slime run so); on single-rank
    communicators that holds more, not less (nccl_footprint.py's "cumem0").  Both may be given.
    Limits: with several ranks, --nccl-small would cap NCCL's bandwidth (one channel, 1 MiB
    steps); for a multi-GPU trainer the lever is NCCL's own suspend and resume (ncclCommSuspend,
    NCCL 2.29.7 on, which releases the allocations of its cuMem memory manager only; torch's
    NCCL 2.28 lacks it).  Either way what NCCL keeps stays outside both savers (NCCL's wheel
    links the CUDA runtime statically: no preload hook sees its allocations; the collectives
    run outside the regions), and what NCCL loads once used stays even when every group is
    destroyed (nccl_footprint.py's "destroyed" rows).  --trainer-backend single makes no
    communicator at all (Note [A single-rank process group]); these variables are then unused."""
    env = {"NCCL_CUMEM_ENABLE": "0"} if args.nccl_cumem_off else {}
    return {**env, **NCCL_SMALL} if args.nccl_small else env


def trainer_main(conn, args) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.update(trainer_environment(args))  # before NCCL's first communicator
    import torch
    sys.path.insert(0, MEGATRON_EXAMPLE)
    _init_device(args)
    conn.send(("ready", os.getpid()))
    msg = conn.recv()
    assert msg[0] == "build", msg
    sleeper = Sleeper(args.saver, args.hook_mode)
    import train_gpt
    seq = args.prompt_len + args.gen_len - 1  # the training sequence: a rollout less its last token
    targs = train_gpt.parse_args(["--deferalloc", "file", "--directory", args.directory, "--window-mb",
                                  str(args.window_mb), "--model", args.model, "--layers", str(args.layers), "--hidden",
                                  str(args.hidden), "--heads", str(args.heads), "--vocab", str(args.vocab),
                                  "--seq", str(seq + 1), "--batch", str(args.batch), "--lr", str(args.lr),
                                  "--seed", str(args.seed), "--process-group",
                                  "single" if args.trainer_backend == "single" else "auto"]
                                 + (["--cpu-emulation"] if args.device == "cpu" else []))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    train_gpt.setup(targs)
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", 0)
    with sleeper.region("train", keep=True):
        gpt, ddp = train_gpt.build_model_and_ddp(targs)
    # The optimizer outside the regions: its state is the engine's (file tier), and its
    # main params are deferalloc handles holding no memory.
    optimizer, streamed = build_optimizer(targs, ddp, resume=args.resume)
    first = streamed[0].shard_step(streamed[0].held_params[0]) + 1 if args.resume else 1
    params = [(n, p) for n, p in gpt.named_parameters()]
    layout, offset = [], 0
    for n, p in params:
        nbytes = p.numel() * p.element_size()
        layout.append((n, list(p.shape), str(p.dtype), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    path = weights_file(args.weights_name, offset)
    with open(path, "wb") as f:
        f.truncate(offset)
    flat = _map_weights(path, offset)

    @torch.no_grad()
    def publish() -> float:
        t0 = time.perf_counter()
        for (_, p), (_, _, _, off, nb) in zip(params, layout):
            flat[off:off + nb].view(p.dtype).copy_(p.detach().reshape(-1))
        return time.perf_counter() - t0

    published = publish()
    release_cached()
    # The trainer's logits for step 1's prompts, which the inference side's converted model
    # is checked against (rollout.conversion_check).
    with torch.no_grad(), sleeper.region("train_act"):
        probe = prompts_of(args, 1)[:PROBE_ROWS]
        pos = torch.arange(probe.shape[1]).unsqueeze(0).expand(probe.shape[0], -1)
        logits = ddp(probe.to(device), pos.to(device), None)[:, -PROBE_POSITIONS:].float().cpu()
    slept = sleeper.sleep()
    conn.send(("built", {"first_step": first, "layout": layout, "path": path, "bytes": offset,
                         "params": sum(p.numel() for _, p in params), "model_class": type(gpt).__name__,
                         "publish_s": published, "sleep_s": slept, "probe_logits": logits.tolist(),
                         "held": sleeper.held(),
                         "nccl_environment": {k: os.environ[k] for k in NCCL_VARIABLES if k in os.environ},
                         "process_groups": process_group_backends(),
                         "deferalloc_conf": os.environ.get("DEFERALLOC_CONF")}))
    while True:
        msg = conn.recv()
        if msg[0] == "train":
            _, step, rollouts = msg
            t = {"wake_s": sleeper.wake(), "t_wake_end": time.time()}
            t0 = time.perf_counter()
            loss = train_on(targs, ddp, optimizer, step, torch.tensor(rollouts), args, device, sleeper)
            t["train_s"] = time.perf_counter() - t0
            t["t_train_end"] = time.time()
            t["publish_s"] = publish()
            t["t_publish_end"] = time.time()
            t["sleep_s"] = sleeper.sleep()
            t["t_sleep_end"] = time.time()
            t["loss"] = float(loss).hex()
            conn.send(("trained", t))
        elif msg[0] == "finish":
            held = sleeper.held()  # asleep, as the launcher measured it
            sleeper.wake()
            conn.send(("finished", {"final_digest": train_gpt.state_digest(optimizer), "held": held}))
            conn.recv()  # the launcher's go
            conn.send(("phase", "teardown"))
            del gpt, ddp, optimizer, streamed
            train_gpt.teardown()
            sleeper.exit(conn)
            return


def process_group_backends() -> list:
    """The backends of the trainer's process groups (the default one and Megatron's), each once,
    for the report: with --trainer-backend single none of them is NCCL."""
    import torch
    from megatron.core import parallel_state
    groups = [torch.distributed.group.WORLD] + [g for g in vars(parallel_state).values()
                                                 if isinstance(g, torch.distributed.ProcessGroup)]
    return sorted({torch.distributed.get_backend(g) for g in groups})


def build_optimizer(targs, ddp, resume: bool):
    """Megatron's DistributedOptimizer built inside deferred_main_params, its state streamed
    from the file tier (resumed from the state file with ``resume``)."""
    import train_gpt
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    import deferalloc.megatron as dm
    train_gpt.use_torch_adamw()
    ocfg = OptimizerConfig(optimizer="adam", lr=targs.lr, **train_gpt.ADAM, bf16=True, use_distributed_optimizer=True,
                           clip_grad=targs.clip_grad)
    with dm.deferred_main_params():
        optimizer = get_megatron_optimizer(ocfg, [ddp])
    streamed = dm.stream_optimizer_state(optimizer, tier="file", directory=targs.directory,
                                         window_mb=targs.window_mb, resume=resume)
    return optimizer, streamed


def train_on(targs, ddp, optimizer, step: int, rollouts, args, device, sleeper) -> float:
    """One Megatron step on the rollouts (batch, prompt + gen): the log-likelihood of the
    generated tokens, each rollout weighted by 1 + its reward's difference from the batch
    mean (reward: the share of its generated tokens in the lower half of the vocabulary).
    The forward and backward in the region "train_act"; Megatron's grad sync and step."""
    import torch
    import train_gpt
    p = args.prompt_len
    gen = rollouts[:, p:]
    reward = (gen < args.vocab // 2).float().mean(1)
    weight = 1.0 + reward - reward.mean()
    mask = torch.zeros(rollouts.shape[0], rollouts.shape[1] - 1)
    mask[:, p - 1:] = 1.0  # the labels that are generated tokens
    for g in optimizer.param_groups:
        g["lr"] = train_gpt.lr_at(targs, step)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with sleeper.region("train_act"):
        tokens, labels = rollouts[:, :-1].to(device), rollouts[:, 1:].to(device)
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1).to(device)
        per_token = ddp(tokens, pos, None, labels=labels).float()
        w = (mask * weight[:, None]).to(device)
        loss = (per_token * w).sum() / mask.sum()
        loss.backward()
        value = loss.item()
        del per_token, loss, tokens, labels, pos, w
    # Megatron's grad sync and step outside the regions: their collectives create NCCL's
    # communicators, whose own cudaMalloc a preload-mode region would take (and a pause drop).
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError(f"step {step}: Megatron skipped the update")
    return value


# ---- the inference side -----------------------------------------------------------------------

def inference_main(conn, args) -> None:
    import torch
    sys.path.insert(0, HERE)
    import rollout
    _init_device(args)
    conn.send(("ready", os.getpid()))
    sleeper = Sleeper(args.saver, args.hook_mode)
    msg = conn.recv()
    assert msg[0] == "build", msg
    _, layout, path, nbytes, probe_logits = msg
    flat = _map_weights(path, nbytes)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    cfg = rollout.hf_config(args.layers, args.hidden, args.heads, args.vocab, args.prompt_len + args.gen_len)
    with sleeper.region("weights"):
        model = rollout.build_model(cfg, device)
    hybrid = any(name.startswith("decoder.final_norm.") for name, *_ in layout)  # HybridModel's names
    mapping = rollout.megatron_to_hf(model, args.heads, hybrid=hybrid)
    with sleeper.region("kv"):
        gen = rollout.Generator(model, args.batch, args.prompt_len, args.gen_len)
        rollout.load_weights(mapping, layout, flat, device)
    with sleeper.region("kv"):
        check = rollout.conversion_check(model, gen, prompts_of(args, 1), torch.tensor(probe_logits))
    if args.device == "cuda":  # the warm-up in "kv", the capture outside any region (torch_memory_saver asserts it)
        gen.capture(lambda: sleeper.region("kv"), sleeper.graph("kv"))
    release_cached()
    slept = sleeper.sleep()
    conn.send(("built", {"sleep_s": slept, "graph": gen.graph is not None, "conversion": check,
                         "deferalloc_conf": os.environ.get("DEFERALLOC_CONF")}))
    while True:
        msg = conn.recv()
        if msg[0] == "generate":
            step = msg[1]
            t = {"wake_s": sleeper.wake(), "t_wake_end": time.time()}
            t0 = time.perf_counter()
            with sleeper.region("kv"):
                rollout.load_weights(mapping, layout, flat, device)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t["load_s"] = time.perf_counter() - t0
                t["t_load_end"] = time.time()
                t0 = time.perf_counter()
                seqs = gen.generate(prompts_of(args, step))
            t["generate_s"] = time.perf_counter() - t0
            t["t_generate_end"] = time.time()
            t["sleep_s"] = sleeper.sleep()
            t["t_sleep_end"] = time.time()
            t["digest"] = digest(seqs)
            conn.send(("generated", t, seqs.tolist()))
        elif msg[0] == "exit":
            conn.send(("held", sleeper.held()))  # asleep, as the launcher measured it
            sleeper.wake()  # nothing of a region freed while it is paused
            sleeper.exit(conn)
            return


def child(role: str, conn, args) -> None:
    """The spawned process's entry: one role; an exception is sent to the launcher."""
    import faulthandler
    faulthandler.enable()  # a crash in native code prints the Python stacks on stderr
    try:
        (trainer_main if role == "trainer" else inference_main)(conn, args)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, then re-raised
        import traceback
        conn.send(("error", f"{role}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


# ---- the launcher -----------------------------------------------------------------------------

class DeviceMemory:
    """Device memory in use (total - free, cuMemGetInfo) seen from the launcher; 0 on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            import torch
            torch.cuda.init()
            torch.cuda.set_device(0)

    def used(self) -> int:
        if not self.cuda:
            return 0
        import torch
        free, total = torch.cuda.mem_get_info(0)
        return total - free


def expect(conn, kind: str, proc, timeout_s: float):
    """The next message of a child, which must be ``kind`` (an error raised with its text, or
    when the child exits or stays silent ``timeout_s``)."""
    t0 = time.monotonic()
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the {kind!r} message never came: {exit_story(proc.name, proc, conn)}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the {kind!r} message never came: the {proc.name} process was silent {timeout_s:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(msg[1])
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg[0]!r}")
    return msg


def child_environment(args):
    """A fresh context manager for starting one child: the saver's configure_subprocess()
    (its LD_PRELOAD) in hook_mode "preload" on CUDA, as an RL stack's launcher starts its
    engine, else nothing.  configure_subprocess() is a one-shot @contextmanager: each child
    needs its own (entering one twice raises AttributeError), hence a function, not a value."""
    if args.device == "cuda" and args.hook_mode == "preload" and args.saver != "none":
        return saver_module(args.saver).configure_subprocess()
    return contextlib.nullcontext()


def children_conf(args):
    """The DEFERALLOC_CONF both sides start with: the caller's, with ``pool_cache_mb:N`` appended
    under --pool-cache-mb (the last value of a key wins)."""
    conf = os.environ.get("DEFERALLOC_CONF")
    if args.pool_cache_mb is None:
        return conf
    return f"{conf},pool_cache_mb:{args.pool_cache_mb}" if conf else f"pool_cache_mb:{args.pool_cache_mb}"


@contextlib.contextmanager
def environ_with(name: str, value):
    """os.environ[name] = value inside (unchanged where value is None), as it was after."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and before is None:
            os.environ.pop(name, None)
        elif value is not None:
            os.environ[name] = before


def start_child(ctx, role: str, conn, args):
    """The ``role`` process started (spawn) inside its own child_environment(), with
    children_conf()'s DEFERALLOC_CONF (spawn copies the environment)."""
    conf = children_conf(args)
    with child_environment(args), environ_with("DEFERALLOC_CONF", conf):
        proc = ctx.Process(target=child, args=(role, conn, args), name=f"rl-{role}")
        proc.start()
    return proc


def exit_story(role: str, proc, conn) -> str:
    """Why a child exited as it did: its exit code, the last phase it announced and any
    traceback it sent (the messages left in its pipe)."""
    phase, errors = None, []
    with contextlib.suppress(EOFError, OSError):
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "phase":
                phase = msg[1]
            elif msg[0] == "error":
                errors.append(msg[1])
    text = f"{role}: exit code {proc.exitcode}, last phase {phase or '?'}"
    return text + "".join(f"\n{e}" for e in errors)


def itemise(memory: dict, items: dict) -> dict:
    """Each side's held bytes asleep by owner (Sleeper.held), with "rest": what the launcher
    measured beyond the side's context less torch's default pool and deferalloc's backed and
    cached bytes (CUDA's own: cuBLAS workspaces, NCCL's buffers, module loads; in preload mode the
    regions' segments are counted in both, so the rest may be negative)."""
    out = {}
    for side, held in items.items():
        if not held:
            continue
        measured = memory.get(f"{side}_held_asleep" if side != "trainer_built" else "trainer_held_asleep_built")
        row = dict(held)
        if measured is not None:
            row["rest"] = (measured - held["torch_default_pool_reserved"] - held.get("deferalloc_backed", 0)
                           - held.get("deferalloc_pool_cached", 0))
        out[side] = row
    return out


def launch(args) -> dict:
    import multiprocessing as mp
    os.makedirs(args.directory, exist_ok=True)
    state = os.path.join(args.directory, "deferalloc-rank0.state")
    if os.path.exists(state) and not args.resume:
        if not args.overwrite:
            raise SystemExit(f"colocated.py: {state} exists: pass --resume to continue from it, or --overwrite")
        os.remove(state)
    args.weights_name = f"dfa_rl_weights_{os.getpid()}"
    ctx = mp.get_context("spawn")
    mem = DeviceMemory(args.device == "cuda")
    report = {"args": dict(vars(args)), "steps": [], "memory": {}, "children_deferalloc_conf": children_conf(args)}
    procs, conns = {}, {}
    wait = args.message_timeout
    t_start = time.time()
    try:
        u0 = mem.used()
        for role in ("trainer", "inference"):
            parent, there = ctx.Pipe()
            procs[role] = start_child(ctx, role, there, args)
            conns[role] = parent
            expect(parent, "ready", procs[role], wait)
            report["memory"][f"{role}_context"] = mem.used() - u0
            u0 = mem.used()
            if role == "trainer":
                base_trainer = u0  # the launcher's and the trainer's contexts
        base = u0  # both contexts
        tr, inf = conns["trainer"], conns["inference"]
        tr.send(("build",))
        built = expect(tr, "built", procs["trainer"], wait)[1]
        report["trainer_built"] = {k: v for k, v in built.items() if k not in ("layout", "probe_logits")}
        report["memory"]["trainer_held_asleep_built"] = mem.used() - base  # the inference side: its context only
        inf.send(("build", built["layout"], built["path"], built["bytes"], built["probe_logits"]))
        report["inference_built"] = expect(inf, "built", procs["inference"], wait)[1]
        for step in range(built["first_step"], args.steps + 1):
            row = {"step": step}
            t0 = time.perf_counter()
            inf.send(("generate", step))
            _, ti, seqs = expect(inf, "generated", procs["inference"], wait)
            row["held_both_asleep_after_inference"] = mem.used() - base
            tr.send(("train", step, seqs))
            tt = expect(tr, "trained", procs["trainer"], wait)[1]
            row["wall_s"] = time.perf_counter() - t0
            row["held_both_asleep_after_trainer"] = mem.used() - base
            row["inference"], row["trainer"] = ti, tt
            row["loss"], row["rollout_digest"] = tt.pop("loss"), ti.pop("digest")
            sw = ti["sleep_s"] + ti["wake_s"] + tt["sleep_s"] + tt["wake_s"]
            row["sleep_wake_s"], row["share"] = sw, sw / row["wall_s"]
            report["steps"].append(row)
            print(f"step {step:3d} loss {row['loss']} rollouts {row['rollout_digest']} wall {row['wall_s'] * 1e3:.0f} ms "
                  f"sleep+wake {sw * 1e3:.1f} ms ({100 * row['share']:.1f}%)", flush=True)
            if step == args.kill_after_step:
                for p in procs.values():
                    p.kill()
                for p in procs.values():
                    p.join()
                report["killed_after_step"] = step
                return report
        # The end: each side's footprint asleep, alone (both asleep since the last step; the
        # inference side exits first), then the trainer's state digest.
        before = mem.used()
        inf.send(("exit",))
        items = {"trainer_built": built["held"], "inference": expect(inf, "held", procs["inference"], wait)[1]}
        procs["inference"].join()
        after = mem.used()
        report["memory"]["inference_held_asleep"] = before - after - report["memory"]["inference_context"]
        report["memory"]["trainer_held_asleep"] = after - base_trainer
        tr.send(("finish",))
        finished = expect(tr, "finished", procs["trainer"], wait)[1]
        report["final_digest"], items["trainer"] = finished["final_digest"], finished["held"]
        report["held_items"] = itemise(report["memory"], items)
        tr.send(("go",))
        procs["trainer"].join()
        if procs["trainer"].exitcode != 0 or procs["inference"].exitcode != 0:
            raise RuntimeError("; ".join(exit_story(role, procs[role], conns[role]) for role in procs))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()
        import tempfile
        for d in ("/dev/shm", tempfile.gettempdir()):  # wherever the trainer put it (weights_file)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(d, args.weights_name))
        report["t_start"] = t_start
    return report


def summarize(report: dict) -> dict:
    """Means over the steps after the first (CUDA graphs and caches settled)."""
    rows = report["steps"][1:] or report["steps"]
    if not rows:
        return {}

    def mean(f):
        return sum(f(r) for r in rows) / len(rows)
    return {"trainer_sleep_wake_s": mean(lambda r: r["trainer"]["sleep_s"] + r["trainer"]["wake_s"]),
            "inference_sleep_wake_s": mean(lambda r: r["inference"]["sleep_s"] + r["inference"]["wake_s"]),
            "sleep_wake_s": mean(lambda r: r["sleep_wake_s"]), "wall_s": mean(lambda r: r["wall_s"]),
            "share": mean(lambda r: r["share"]),
            "held_both_asleep_max": max(max(r["held_both_asleep_after_inference"],
                                            r["held_both_asleep_after_trainer"]) for r in report["steps"])}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = launch(args)
    report["summary"] = summarize(report)
    m = report["memory"]
    if args.device == "cuda":
        print("memory (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in m.items()), flush=True)
    for side, row in report.get("held_items", {}).items():
        print(f"memory held asleep, {side} (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in row.items()),
              flush=True)
    s = report["summary"]
    if s:
        print(f"mean of steps after the first: sleep+wake trainer {s['trainer_sleep_wake_s'] * 1e3:.1f} ms, "
              f"inference {s['inference_sleep_wake_s'] * 1e3:.1f} ms, step {s['wall_s'] * 1e3:.0f} ms, "
              f"share {100 * s['share']:.1f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
