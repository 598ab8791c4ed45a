"""A small megatron-core GPTModel trained with the DistributedOptimizer, with or without deferalloc.

    torchrun --nproc-per-node 1 examples/megatron/train_gpt.py --deferalloc host
    torchrun --nproc-per-node 1 examples/megatron/train_gpt.py            # Megatron's own FP32 state
    # no GPU: megatron-core's GPU paths on the CPU (--cpu-emulation), a small model
    torchrun --nproc-per-node 1 examples/megatron/train_gpt.py --deferalloc host --cpu-emulation --steps 2 --layers 1 --hidden 32 --heads 4 --vocab 64 --seq 16 --batch 2

Local layer spec (no Transformer Engine, no Apex), BF16 params under Float16Module, FP32
gradient reduction, grad clipping 1.0, a warm-up LR set each step, fixed token batches (the
same for every run and every restart): ``--data random`` (default) uniform random tokens,
nothing to learn (the loss stays near ln(vocab)); ``--data pattern`` a fixed random sparse
Markov chain (Note [Pattern data]), so that the loss falls and loss curves compare something.
``--deferalloc host|file|device`` builds the optimizer inside
``deferalloc.megatron.deferred_main_params()`` and calls
``deferalloc.megatron.stream_optimizer_state`` after ``get_megatron_optimizer``.
``--hdo`` is megatron-core's CPU offload instead (HybridDeviceOptimizer, offload_fraction=1.0; without Transformer Engine the
precision-aware optimizer is unavailable, so Megatron keeps FP32 main params on the GPU and
HDO steps them on the CPU).  megatron-core's inner optimizer is torch.optim.AdamW in every
mode (``use_torch_adamw``: megatron-core would take Transformer Engine's or Apex's FusedAdam
when installed; neither is on the H200 image), and Megatron's own run tells it ``fused=True``
(torch._fused_adamw_, the arithmetic the engine reproduces bit for bit; torch's default
foreach AdamW rounds differently).  The summary's ``reference`` records what stepped.

Prints one line per step (loss as a float hex, optimizer-phase seconds) and a JSON summary
(``--summary FILE``): losses, peak HBM sampled through the steps with cuMemGetInfo (a thread
polling torch.cuda.mem_get_info), HBM in use between steps with torch's reserved and
allocated bytes beside it, optimizer-phase times, whole-iteration times (``step_seconds``:
forward, backward, grad sync and step, until the device has finished them), the engine's per-step pass statistics
(``engine``: seconds, host time mapping / retiring pieces, pieces, bytes), the parameter
count.  ``--save DIR --save-at N`` saves with Megatron's dist-checkpointing after step N;
``--load DIR`` loads one and continues from the step after it.

Data parallelism (torchrun ``--nproc-per-node N``): ``--batch`` is the global batch, the same
tokens at every data-parallel size; rank r trains on rows [r*B/N, (r+1)*B/N) of it (B must
divide by N).  Megatron's DDP scales each rank's gradient by 1/N before its SUM
reduce-scatter (megatron-core 0.16.1, DistributedDataParallel: average_in_collective=False,
gradient_scaling_factor = 1/dp_size), so the reduced gradient is the mean of the ranks'
mean-loss gradients: the gradient of the global batch's mean loss, as at N = 1, up to the
order of the additions.  The printed loss is the global-batch mean (the ranks' means summed
by an all-reduce, divided by N); rank 0 prints and writes the summary; ``saved_digest`` /
``loaded_digest`` cover the whole optimizer state (every rank's shards, gathered), so they
compare across data-parallel sizes.  At N = 1 none of this changes anything.

Note [HBM sampling]
The sampler starts after ``--warmup-steps`` (1) steps, once torch.cuda.empty_cache() has
given back what torch's allocator keeps cached but free, in every mode alike.  Why: in an
H200 run of 168 M params sampling from step 1 (docs/BENCHMARKS.md), HBM between steps beyond the
optimizer state was about 240 MiB higher in the deferalloc run (5471 MiB - 6 B/param) and
in the HDO run (6101 - 10 B/param) than in Megatron's own (7155 - 18 B/param).  HDO holds no
moments on the GPU either, so the engine is not the cause; the likely one is that Megatron's
own run made its Adam moments in its first step inside blocks that step had used and freed,
while the other two runs keep such first-step blocks cached and idle.  The summary's ``hbm``
(cuMemGetInfo next to torch's reserved and allocated bytes) lets the next run confirm it.

``--cpu-emulation`` runs the same flow on the CPU (CI without a GPU; see cpu_emulation.py;
deferalloc's host driver).

``--odirect-baseline DIR`` steps the same model and DDP with the synchronous O_DIRECT
baseline instead of Megatron's optimizer (Note [The O_DIRECT baseline under Megatron]): what a
Megatron user with FP32 state on NVMe has today, for benchmarks/megatron/bench_megatron.py's
row odirect_file.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deferalloc", choices=["off", "host", "file", "device"], default="off")
    ap.add_argument("--directory", help="file tier: the state directory")
    ap.add_argument("--window-mb", type=int, default=512)
    ap.add_argument("--moment-dtype", choices=["fp32", "bf16", "int8"], default="fp32",
                    help="stream_optimizer_state(moment_dtype=): how the host and file tiers store the moments")
    ap.add_argument("--resident-mb", type=lambda v: v if v == "auto" else int(v),
                    help="stream_optimizer_state(resident_mb=): host tier, HBM (MiB or auto) for resident shards")
    ap.add_argument("--release-torch-cache", action="store_true",
                    help="stream_optimizer_state(release_torch_cache=True): empty torch's cache before each step")
    ap.add_argument("--overlap-grad-reduce", action="store_true",
                    help="DDP's overlap_grad_reduce (bucket reduce-scatters during backward)")
    ap.add_argument("--overlap-param-gather", action="store_true",
                    help="DDP's and the optimizer's overlap_param_gather (param all-gathers in the next forward)")
    ap.add_argument("--bucket-size", type=int, help="DDP's bucket_size (parameters)")
    ap.add_argument("--bf16-grads", action="store_true",
                    help="DDP's grad_reduce_in_fp32=False: BF16 grad buffers (Megatron's main grads are then "
                         "their .float() copies)")
    ap.add_argument("--step-in-backward", nargs="?", const=True, default=False, choices=[True, "auto"],
                    help="--deferalloc: step each bucket group inside backward (needs --overlap-grad-reduce); "
                         "'auto': whichever of that and the plain step a few timed iterations find faster")
    ap.add_argument("--step-overlap-forward", action="store_true",
                    help="--step-in-backward with --overlap-param-gather: the step also overlaps the next forward "
                         "(stream_optimizer_state(step_overlap_forward=True))")
    ap.add_argument("--coalesce", type=int, metavar="N",
                    help="--step-in-backward: at most N bucket groups whose grads are done per engine pass, 0: all "
                         "(stream_optimizer_state(coalesce=N)); default: the tier's (host: one a pass)")
    ap.add_argument("--switch-interval", type=float, metavar="S",
                    help="sys.setswitchinterval(S) before training (Python's GIL hand-over interval, default "
                         "0.005 s): how long the optimizer's worker thread may wait for the GIL that the training "
                         "loop holds")
    ap.add_argument("--offload-grads", action="store_true",
                    help="after each optimizer step, DDP's offload_grad_buffers() and restore_grad_buffers() "
                         "(megatron-core 0.19's colocation API; the summary's grad_offloads counts them)")
    ap.add_argument("--clip-policy", default="auto", choices=["auto", "speculate", "after"],
                    help="--step-in-backward: when to speculate on Megatron's clipping")
    ap.add_argument("--clip-grad", type=float, default=1.0, help="OptimizerConfig.clip_grad")
    ap.add_argument("--process-group", choices=["auto", "single"], default="auto",
                    help="auto: NCCL (gloo under --cpu-emulation); single: one rank, its collectives done in "
                         "place, no NCCL (single_rank.py, Note [A single-rank process group])")
    ap.add_argument("--hdo", action="store_true", help="megatron-core's HybridDeviceOptimizer(offload_fraction=1.0)")
    ap.add_argument("--odirect-baseline", metavar="DIR",
                    help="step with the synchronous O_DIRECT baseline (benchmarks/optimizer/odirect_baseline.py), "
                         "its state file in DIR, instead of Megatron's optimizer (one process, no checkpoints)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--query-groups", type=int, default=None,
                    help="TransformerConfig.num_query_groups (grouped-query attention); default: --heads (none)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over the data-parallel ranks)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="gradient accumulation: this rank's rows in this many micro-batches, all but the last "
                         "under DDP's no_sync() (--pp 1 only)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data", choices=["random", "pattern"], default="random",
                    help="the batches: uniform random tokens, or a learnable Markov chain (Note [Pattern data])")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model", choices=["auto", "gpt", "hybrid"], default="auto",
                    help="auto: HybridModel where megatron-core deprecates GPTModel (0.19 on), else GPTModel")
    ap.add_argument("--main-params", choices=["auto", "megatron", "deferalloc"], default="auto",
                    help="who makes the main-param handles: Megatron (OptimizerConfig."
                         "defer_main_param_initialization) or deferalloc.megatron.deferred_main_params(); "
                         "auto: Megatron's where its OptimizerConfig has the option")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--tie-embeddings", action="store_true",
                    help="share_embeddings_and_output_weights: with --pp > 1 finalize_model_grads sums the "
                         "word embedding's grads over the first and last stages")
    ap.add_argument("--save", help="dist-checkpointing directory to save into")
    ap.add_argument("--save-at", type=int, default=0, help="save after this step")
    ap.add_argument("--load", help="dist-checkpointing directory to load, then continue")
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="steps before HBM sampling starts; torch's cache is emptied after them (every mode)")
    ap.add_argument("--summary", help="write the JSON summary here")
    ap.add_argument("--digest", action="store_true", help="the summary's final_digest: state_digest after the "
                                                          "last step (test-sized models)")
    ap.add_argument("--cpu-emulation", action="store_true", help="CI: run on the CPU (deferalloc host driver)")
    args = ap.parse_args(argv)
    if args.odirect_baseline:
        clash = [flag for flag, on in (("--deferalloc " + args.deferalloc, args.deferalloc != "off"),
                                       ("--hdo", args.hdo), ("--save", args.save), ("--load", args.load),
                                       ("--moment-dtype " + args.moment_dtype, args.moment_dtype != "fp32"),
                                       ("--resident-mb", args.resident_mb is not None),
                                       ("--step-in-backward", bool(args.step_in_backward)),
                                       ("--step-overlap-forward", args.step_overlap_forward),
                                       ("--coalesce", args.coalesce is not None),
                                       ("--overlap-param-gather", args.overlap_param_gather),
                                       ("--tp", args.tp > 1), ("--pp", args.pp > 1)) if on]
        if clash:
            ap.error(f"--odirect-baseline replaces Megatron's optimizer in one process; it does not go with "
                     f"{', '.join(clash)}")
    if args.microbatches < 1 or (args.microbatches > 1 and args.pp > 1):
        ap.error("--microbatches: at least 1, and more than 1 with --pp 1 only")
    return args


# ---- HBM sampling ---------------------------------------------------------------------------

class HbmSampler:
    """Device memory in use (total - free from cuMemGetInfo), polled by a thread."""

    def __init__(self, period_s: float = 0.002):
        # 2 ms: a streamed step holds its window for tens of ms, and a faster poll would take
        # the GIL from the step being timed.
        self.period_s = period_s
        self.peak = 0
        self._on = False
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def used() -> int:
        if not torch.cuda.is_available():
            return 0
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device())
        return total - free

    def _run(self):
        torch.cuda.set_device(self._device)
        while not self._stop.is_set():
            if self._on:
                self.peak = max(self.peak, self.used())
            time.sleep(self.period_s)

    def start(self):
        self.peak = 0
        if torch.cuda.is_available():
            self._device = torch.cuda.current_device()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        self._on = True

    def stop(self):
        self._on = False
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = max(self.peak, self.used())


# ---- model and optimizer --------------------------------------------------------------------

def setup(args):
    if args.cpu_emulation:
        sys.path.insert(0, HERE)
        import cpu_emulation
        cpu_emulation.enable()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not args.cpu_emulation:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(process_group_backend(args))
    torch.use_deterministic_algorithms(True, warn_only=True)
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(args.tp, args.pp)
    dp = dp_size()
    if args.batch % dp:
        raise SystemExit(f"train_gpt.py: --batch {args.batch} (the global batch) is not divisible by the "
                         f"data-parallel size {dp}")
    if args.cpu_emulation:
        cpu_emulation.after_model_parallel_init()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)


def process_group_backend(args) -> str:
    """torch.distributed's default backend for --process-group: "auto" NCCL (gloo under the
    CPU emulation), "single" single_rank.py's for every device (Megatron's explicit gloo groups
    stay gloo)."""
    if args.process_group == "auto":
        return "gloo" if args.cpu_emulation else "nccl"
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import single_rank
    single_rank.register()
    return single_rank.NAME


def gpt_is_deprecated() -> bool:
    """megatron-core 0.19 deprecates GPTModel in favour of HybridModel (its constructor logs
    "GPTModel IS DEPRECATED"); before that GPTModel is the recommended class."""
    import megatron.core
    from packaging.version import Version
    return Version(megatron.core.__version__) >= Version("0.19")


def local_hybrid_stack_spec():
    """HybridModel's decoder made of megatron-core's own modules (no Transformer Engine): an
    attention layer ('*') is the local GPT layer without its MLP, an MLP layer ('-') the
    local GPT layer without its attention, so the pattern "*-" * L is L GPT layers.
    megatron-core's published hybrid specs use Transformer Engine modules only."""
    import dataclasses
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    local = get_gpt_layer_local_spec().submodules
    attention = dataclasses.replace(local, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    mlp = dataclasses.replace(local, input_layernorm=IdentityOp, self_attention=IdentityOp,
                              self_attn_bda=IdentityFuncOp)
    if not getattr(hybrid_block, "HAVE_TE", True) or not _have_te():
        # HybridStack builds its final norm with TENorm by name; without Transformer Engine
        # the local spec's norm (torch's LayerNorm, what GPTModel's local spec uses) stands in.
        hybrid_block.TENorm = local.input_layernorm
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp)))


def _have_te() -> bool:
    from megatron.core.extensions import transformer_engine
    return bool(getattr(transformer_engine, "HAVE_TE", False))


def build_model(args, cfg):
    """The model class the installed megatron-core recommends: HybridModel with the pattern
    "*-" * layers where GPTModel is deprecated (0.19 on), else GPTModel; ``--model`` picks
    one.  Both hold the same GPT layers; with the local specs and learned absolute position
    embeddings their forward is the same computation."""
    kind = args.model
    if kind == "auto":
        kind = "hybrid" if gpt_is_deprecated() else "gpt"
    pre, post = _pipeline_stage()
    if kind == "hybrid":
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        cfg.num_layers = 2 * args.layers
        return HybridModel(config=cfg, hybrid_stack_spec=local_hybrid_stack_spec(), vocab_size=args.vocab,
                           max_sequence_length=args.seq, hybrid_layer_pattern=_hybrid_pattern(args),
                           position_embedding_type="learned_absolute", pre_process=pre, post_process=post,
                           share_embeddings_and_output_weights=args.tie_embeddings)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                    max_sequence_length=args.seq, pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=args.tie_embeddings)


def _hybrid_pattern(args) -> str:
    """HybridModel's layer pattern: its pipeline stages are given in the pattern ('|')."""
    pp = args.pp
    if args.layers % pp:
        raise SystemExit(f"train_gpt.py: --layers {args.layers} is not divisible by --pp {pp}")
    return "|".join(["*-" * (args.layers // pp)] * pp)


def _pipeline_stage() -> tuple[bool, bool]:
    from megatron.core import parallel_state
    return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()


def build(args):
    """Model, DDP, Megatron's optimizer and (--deferalloc) the streamed inner optimizers."""
    gpt, ddp = build_model_and_ddp(args)
    optimizer, streamed = build_optimizer(args, ddp)
    return gpt, ddp, optimizer, streamed


def build_model_and_ddp(args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            num_query_groups=args.query_groups, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                            deterministic_mode=not args.cpu_emulation)
    torch.manual_seed(args.seed)
    gpt = build_model(args, cfg)
    model = Float16Module(cfg, gpt)
    if not args.cpu_emulation:
        model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(config=cfg, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=not args.bf16_grads, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, bucket_size=args.bucket_size))
    return gpt, ddp


def main_params_route(args) -> str:
    """Who makes the main-param handles under --deferalloc: "megatron" (OptimizerConfig's
    defer_main_param_initialization, where it exists) or "deferalloc" (deferred_main_params)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig
    has_option = "defer_main_param_initialization" in {f.name for f in dataclasses.fields(OptimizerConfig)}
    route = args.main_params
    if route == "auto":
        route = "megatron" if has_option else "deferalloc"
    if route == "megatron" and not has_option:
        raise SystemExit("train_gpt.py: --main-params megatron needs an OptimizerConfig with "
                         "defer_main_param_initialization (no megatron-core release has it)")
    return route


# Megatron's AdamW settings in every mode (OptimizerConfig's names).
ADAM = dict(weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def build_optimizer(args, ddp, stream: bool = True):
    """Megatron's optimizer and, under --deferalloc, the streamed inner optimizers (with
    ``stream=False`` on Megatron's route: its handles before stream_optimizer_state, for tests)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if args.odirect_baseline:
        return ODirectBaseline(args, ddp), []
    ocfg = dict(optimizer="adam", lr=args.lr, **ADAM, bf16=True, use_distributed_optimizer=True,
                clip_grad=args.clip_grad, overlap_param_gather=args.overlap_param_gather)
    if args.hdo:
        ocfg.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                    overlap_cpu_optimizer_d2h_h2d=True)
    use_torch_adamw()
    if args.deferalloc == "off":
        optimizer = get_megatron_optimizer(OptimizerConfig(**ocfg), [ddp])
        if not args.hdo:
            for dopt in optimizers_of(optimizer):
                for g in dopt.optimizer.param_groups:
                    g["fused"], g["foreach"] = True, False
        return optimizer, []
    if main_params_route(args) == "megatron":
        import deferalloc.megatron as dm
        # Megatron makes its main params as handles (storage released); the engine takes them.
        optimizer = get_megatron_optimizer(OptimizerConfig(**ocfg, defer_main_param_initialization=True), [ddp])
        if not stream:
            return optimizer, []
        return optimizer, dm.stream_optimizer_state(optimizer, tier=args.deferalloc, directory=args.directory,
                                                    window_mb=args.window_mb,
                                                    release_torch_cache=args.release_torch_cache,
                                                    step_in_backward=args.step_in_backward,
                                                    step_overlap_forward=args.step_overlap_forward,
                                                    coalesce=args.coalesce, clip_policy=args.clip_policy,
                                                    moment_dtype=args.moment_dtype, resident_mb=args.resident_mb)
    import deferalloc.megatron
    # Main params as deferalloc handles from construction on (no FP32 copy is ever made),
    # then the streamed engine: the two deferalloc lines of a Megatron script.
    with deferalloc.megatron.deferred_main_params():
        optimizer = get_megatron_optimizer(OptimizerConfig(**ocfg), [ddp])
    streamed = deferalloc.megatron.stream_optimizer_state(optimizer, tier=args.deferalloc,
                                                          directory=args.directory, window_mb=args.window_mb,
                                                          release_torch_cache=args.release_torch_cache,
                                                          step_in_backward=args.step_in_backward,
                                                          step_overlap_forward=args.step_overlap_forward,
                                                          coalesce=args.coalesce, clip_policy=args.clip_policy,
                                                          moment_dtype=args.moment_dtype,
                                                          resident_mb=args.resident_mb)
    return optimizer, streamed


def use_torch_adamw() -> None:
    """megatron-core takes Transformer Engine's FusedAdam (else Apex's) when installed, and
    torch.optim.AdamW only without both (its module flag USING_PYTORCH_OPTIMIZER); it has
    no option to choose.  The example uses torch's AdamW in every mode: the arithmetic the
    engine reproduces (TE's and Apex's Adam round differently, and deferalloc.megatron
    refuses them).  On the H200 image neither is installed, so this changes nothing there."""
    import megatron.core.optimizer as mo
    if not mo.USING_PYTORCH_OPTIMIZER:
        mo.Adam, mo.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, True


def describe_optimizer(optimizer) -> list[dict]:
    """What steps each DistributedOptimizer's shards: the inner optimizer's class and the
    settings that decide its arithmetic (for the summary; test_megatron_gpu checks them)."""
    if isinstance(optimizer, ODirectBaseline):
        return [optimizer.describe()]
    out = []
    for dopt in optimizers_of(optimizer):
        inner = dopt.optimizer
        d = {"wrapper": type(dopt).__name__, "inner": f"{type(inner).__module__}.{type(inner).__qualname__}"}
        groups = inner.param_groups
        d["param_dtypes"] = sorted({str(p.dtype) for g in groups for p in g["params"]})
        d["lr_type"] = sorted({type(g["lr"]).__name__ for g in groups})
        d["weight_decay"] = sorted({float(g["weight_decay"]) for g in groups})
        d["betas"] = [float(b) for b in groups[0]["betas"]] if "betas" in groups[0] else None
        d["eps"] = groups[0].get("eps")
        for key in ("fused", "foreach", "decoupled_weight_decay"):
            d[key] = sorted({str(g.get(key)) for g in groups})
        subs = getattr(inner, "cpu_optimizers", None)
        if subs is not None:  # HybridDeviceOptimizer
            d["hdo"] = {"cpu_optimizers": len(subs), "gpu_optimizer": type(inner.gpu_optimizer).__name__,
                        "cpu_classes": sorted({type(o).__name__ for o in subs}),
                        "cpu_fused": sorted({str(g.get("fused")) for o in subs for g in o.param_groups}),
                        "cpu_param_dtypes": sorted({str(p.dtype) for o in subs for g in o.param_groups
                                                    for p in g["params"]}),
                        "cpu_params_pinned": all(p.is_pinned() for o in subs for g in o.param_groups
                                                 for p in g["params"]),
                        "param_update_in_fp32": inner.param_update_in_fp32,
                        "overlap_d2h_h2d": inner.overlap_cpu_optimizer_d2h_h2d}
        out.append(d)
    return out


# Note [The O_DIRECT baseline under Megatron]
# Rationale: the file tier is judged against what a Megatron user with FP32 main params and
# Adam moments on NVMe has today, measured in the same training loop: Megatron's model and DDP
# (the same gradient buffers and reduce-scatter), then a synchronous per-bucket step with direct
# I/O (benchmarks/optimizer/odirect_baseline.py, Note [The synchronous O_DIRECT baseline]: read a
# bucket's main + moments through one 256 MiB pinned staging buffer, torch's fused AdamW on the
# device, write it back, bucket after bucket on the calling thread).
# Approach: ODirectAdamW over DDP's parameters, the gradient each one's FP32 main_grad, ADAM's
# settings on every parameter (megatron-core's groups carry wd_mult 0 for biases and 1-D
# parameters, but only Megatron-LM's LR scheduler applies it; this example sets the LR alone, so
# its Megatron runs decay every parameter by the group's weight decay).  This class gives
# train_step what it uses of Megatron's optimizer: param_groups (the LR), zero_grad, step() ->
# (ok, grad norm, None).  Clipping is computed as Megatron computes it rather than refused: with
# clip_grad > 0 the L2 norm over the main_grads by megatron-core's own get_grad_norm_fp32 (whichever
# multi-tensor kernel it picks: Transformer Engine's, Apex's or its local one), and the grads scaled
# by clip / (norm + 1e-6) where that is below 1.  The per-tensor norms are taken in DDP's parameter
# order, not in the order of Megatron's optimizer groups, so a reached clip may differ from
# Megatron's in the norm's last bits.  So the example's default (1.0) runs, and the benchmark's
# never-reached 1e9 costs the baseline the norm pass it costs Megatron's step.  With clipping not reached the
# arithmetic is Megatron's own optimizer's (the same fused kernel, element by element): losses
# and the final state digest equal the resident run's bit for bit (bench_megatron.py --smoke
# checks it); state_digest hashes the file's state in the order Megatron's digest takes (its grad
# buffers' buckets).  The module is loaded by path: it is the benchmarks' reference
# implementation (its CPU and GPU tests check it against torch's AdamW); a copy here could drift.
# Limits: one process (no data, tensor or pipeline parallelism: ODirectAdamW steps whole
# parameters from whole gradients), no checkpoints; where the directory's file system refuses
# O_DIRECT it runs buffered and says so (ODirectAdamW's reason).
class ODirectBaseline:
    """Megatron's optimizer interface (as train_step uses it) over ODirectAdamW."""

    STAGING_BYTES = 256 << 20

    def __init__(self, args, ddp):
        if torch.distributed.get_world_size() > 1:
            raise SystemExit("train_gpt.py: --odirect-baseline runs in one process (world size "
                             f"{torch.distributed.get_world_size()})")
        import importlib.util
        path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks", "optimizer", "odirect_baseline.py")
        spec = importlib.util.spec_from_file_location("odirect_baseline", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        index = {p: i for i, p in enumerate(self.params)}
        # state_digest's order: Megatron's (DistributedOptimizer's gbuf_ranges at one rank).
        self.digest_order = [index[p] for buf in ddp.buffers + getattr(ddp, "expert_parallel_buffers", [])
                             for bucket in buf.buckets for p in buf.param_index_map if p in bucket.params]
        self.clip_grad = args.clip_grad
        self.param_groups = [{"lr": args.lr}]
        os.makedirs(args.odirect_baseline, exist_ok=True)
        self.odirect = module.ODirectAdamW(
            self.params, os.path.join(args.odirect_baseline, "odirect_state.bin"), lr=args.lr,
            betas=(ADAM["adam_beta1"], ADAM["adam_beta2"]), eps=ADAM["adam_eps"],
            weight_decay=ADAM["weight_decay"], staging_bytes=self.STAGING_BYTES, grad_attr="main_grad")

    def zero_grad(self) -> None:
        """Nothing: the gradients are DDP's buffer, which zero_grad_buffer() zeroes."""

    @torch.no_grad()
    def step(self):
        grad_norm = 0.0
        if self.clip_grad > 0.0:
            from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
            grads = [p.main_grad for p in self.params]
            grad_norm = float(get_grad_norm_fp32(grads))
            coeff = self.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        self.odirect.lr = self.param_groups[0]["lr"]
        self.odirect.step()
        return True, grad_norm, None

    def state_digest(self) -> str:
        """state_digest's sha256: main, exp_avg, exp_avg_sq of every parameter, from the file."""
        state = self.odirect.read_state()
        h = hashlib.sha256()
        for i in self.digest_order:
            for k in ("main_param", "exp_avg", "exp_avg_sq"):
                h.update(state[i][k].contiguous().numpy().tobytes())
        return h.hexdigest()

    def describe(self) -> dict:
        o = self.odirect
        return {"wrapper": type(self).__name__, "inner": f"{type(o).__module__}.{type(o).__qualname__}",
                "param_dtypes": ["torch.float32"],  # what it steps: the FP32 main params in its file
                "model_param_dtypes": sorted({str(p.dtype) for p in self.params}),
                "weight_decay": [o.weight_decay], "betas": list(o.betas), "eps": o.eps,
                "fused": ["True"], "direct_io": o.direct, "reason": o.reason, "buckets": len(o.buckets),
                "staging_bytes": o.staging_bytes, "file_bytes": o.file_bytes}


def dp_size() -> int:
    if not torch.distributed.is_initialized():
        return 1
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_world_size()


def dp_rank() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_rank() if torch.distributed.is_initialized() else 0


def model_parallel() -> bool:
    """Tensor or pipeline parallelism in this run."""
    from megatron.core import parallel_state
    return (parallel_state.get_tensor_model_parallel_world_size() > 1 or
            parallel_state.get_pipeline_model_parallel_world_size() > 1)


def batch(args, step: int, device):
    """This rank's rows of the step's global batch (the same tokens at every data-parallel size)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    if args.data == "pattern":
        tokens = pattern_tokens(args, g)
    else:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    dp = dp_size()
    if dp > 1:
        rows = args.batch // dp
        rank = dp_rank()
        tokens = tokens[rank * rows:(rank + 1) * rows]
    pos = torch.arange(args.seq).unsqueeze(0).expand(tokens.shape[0], -1)
    return tokens[:, :-1].to(device), pos.to(device), tokens[:, 1:].to(device)


# Note [Pattern data]
# Rationale: uniform random tokens leave nothing to learn (the loss stays at ln(vocab)), so
# loss curves of two optimizers compare noise; curves need data whose loss falls steadily.
# Approach: a Markov chain fixed by (seed, vocab): PATTERN_STATES (or vocab, if fewer) tokens
# of the vocabulary, each followed by one of PATTERN_SUCCESSORS successors among them (drawn
# with repetition) picked uniformly.  A row starts at a uniformly chosen state; the step's
# generator (seed * 1000 + step, as the random batches') picks the start and the choices,
# so a step's global batch is the same at every data-parallel size and on every restart.
# The chain comes from the generator of step 0 (never a training step).  The loss falls from
# ln(vocab) toward ln(states) (which tokens occur) and then toward ln(PATTERN_SUCCESSORS) =
# 1.39 (which follow which; a little lower where successors repeat): a bigram table, which
# the embedding and output layer learn directly (no plateau, unlike copying n-grams, which
# needs induction heads).  On the CPU with the defaults' vocab, sequence, batch and lr (2
# layers, hidden 128): 10.43 at step 1, 7.26 at 100, 5.78 at 200.
# Limits: the rows are made token by token (seq iterations on the CPU, a few ms a step).
PATTERN_STATES, PATTERN_SUCCESSORS = 2048, 4
_CHAINS: dict = {}


def pattern_chain(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(states: the chain's tokens, successors: [states, PATTERN_SUCCESSORS] indices into them)."""
    key = (args.seed, args.vocab)
    if key not in _CHAINS:
        g = torch.Generator().manual_seed(args.seed * 1000)
        n = min(args.vocab, PATTERN_STATES)
        states = torch.randperm(args.vocab, generator=g)[:n]
        _CHAINS[key] = states, torch.randint(0, n, (n, PATTERN_SUCCESSORS), generator=g)
    return _CHAINS[key]


def pattern_tokens(args, g: torch.Generator) -> torch.Tensor:
    """The global batch of --data pattern: [batch, seq + 1] tokens (Note [Pattern data])."""
    states, successors = pattern_chain(args)
    n = args.seq + 1
    pick = torch.randint(0, PATTERN_SUCCESSORS, (args.batch, n), generator=g)
    at = torch.empty((args.batch, n), dtype=torch.long)
    at[:, 0] = torch.randint(0, len(states), (args.batch,), generator=g)
    for t in range(1, n):
        at[:, t] = successors[at[:, t - 1], pick[:, t]]
    return states[at]


def lr_at(args, step: int) -> float:
    return args.lr * min(1.0, step / 5)


# ---- checkpoints ----------------------------------------------------------------------------

def optimizers_of(optimizer):
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def state_digest(optimizer) -> str:
    """sha256 over every model param's FP32 main shard and moments, read through Megatron's
    own accessor (the one its checkpoint formats use).  Data-parallel: over the whole state,
    every rank's pieces gathered (the same digest as at N = 1 for the same state)."""
    if isinstance(optimizer, ODirectBaseline):
        return optimizer.state_digest()
    if dp_size() > 1 or model_parallel():
        return gathered_state_digest(optimizer)
    h = hashlib.sha256()
    for dopt in optimizers_of(optimizer):
        for gbuf in dopt.gbuf_ranges:
            for per_bucket in gbuf.values():
                for bucket in per_bucket:
                    for model_param in bucket["param_map"]:
                        t = dopt._get_main_param_and_optimizer_states(model_param)
                        for k in ("param", "exp_avg", "exp_avg_sq"):
                            h.update(t[k].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def gathered_state_digest(optimizer) -> str:
    """state_digest of a data-parallel optimizer: each rank's pieces of every param (main,
    exp_avg, exp_avg_sq with its offset in the param) gathered to every rank, then hashed in
    the order of the N = 1 digest (params in grad-buffer order, a param's pieces by offset).
    Every piece travels as a Python object: for test-sized models."""
    from megatron.core import parallel_state
    mp = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank())
    mine = []
    for o, dopt in enumerate(optimizers_of(optimizer)):
        for b, gbuf in enumerate(dopt.gbuf_ranges):
            position = {p: i for i, p in enumerate(dopt.buffers[b].param_index_map)}
            for per_bucket in gbuf.values():
                for bucket in per_bucket:
                    for model_param, ranges in bucket["param_map"].items():
                        t = dopt._get_main_param_and_optimizer_states(model_param)
                        mine.append(((*mp, o, b, position[model_param]), ranges["param"].start,
                                     [t[k].detach().float().cpu().contiguous().numpy().tobytes()
                                      for k in ("param", "exp_avg", "exp_avg_sq")]))
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    by_param: dict = {}
    for key, start, data in sorted((p for rank in every for p in rank), key=lambda p: (p[0], p[1])):
        by_param.setdefault(key, []).append(data)
    h = hashlib.sha256()
    for pieces in by_param.values():
        for k in range(3):
            for data in pieces:
                h.update(data[k])
    return h.hexdigest()


# dp_reshardable: each rank saves its buckets' state in place (no gather), and a load at
# another data-parallel size reshards it.  (megatron-core 0.16.1's own torch-AdamW
# DistributedOptimizer cannot load its "fully_reshardable" format: the loaded tensors lack
# the "step" key that _set_main_param_and_optimizer_states copies; the streamed optimizer
# takes both.)
CKPT_METADATA = {"distrib_optim_sharding_type": os.environ.get("DFA_MEGATRON_CKPT_FORMAT", "dp_reshardable"),
                 "distrib_optim_fully_reshardable_mem_efficient": True}


def save(gpt, optimizer, directory: str, step: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not filesystem_async.HAVE_PSUTIL:
        # megatron-core 0.16.1's writer logs its RSS through psutil, a dependency its wheel
        # does not declare; without psutil that log probe reads 0 (nothing else uses it).
        filesystem_async._process_memory = lambda: 0
    os.makedirs(directory, exist_ok=True)
    model_sd = gpt.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=CKPT_METADATA),
                             "step": step}, directory)


def load(gpt, optimizer, directory: str) -> int:
    from megatron.core import dist_checkpointing
    for dopt in optimizers_of(optimizer):
        dopt._init_optimizer_states_with_dummy_values()  # Megatron-LM does this before a load
    model_sd = gpt.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd,
                                      "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                                   metadata=CKPT_METADATA),
                                      "step": None}, directory)
    gpt.load_state_dict(loaded["model"], strict=False)
    optimizer.load_state_dict(loaded["optimizer"])
    return int(loaded["step"])


# ---- training -------------------------------------------------------------------------------

GRAD_OFFLOADS = [0]  # --offload-grads: offload / restore pairs done


def train_step(args, ddp, optimizer, step: int, device, sync_before_step: bool = True,
               sync_after_step: bool = True) -> tuple[float, float, float]:
    """One step: forward, backward, Megatron's grad sync, optimizer.step() (timed alone: the
    device synchronised before it, unless ``sync_before_step`` is False, and after it, unless
    ``sync_after_step`` is False: a training loop's own pace, where a step across the next
    forward returns with passes in flight and the next forward starts beside them; the
    seconds are then the host's call).  Returns (loss, grad norm, optimizer-phase seconds)."""
    for g in optimizer.param_groups:
        g["lr"] = lr_at(args, step)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, pos, labels = batch(args, step, device)
    if args.pp > 1:
        loss = pipeline_forward_backward(args, ddp, tokens, pos, labels)
    elif args.microbatches > 1:
        loss = accumulated_forward_backward(args, ddp, tokens, pos, labels)
    else:
        loss = ddp(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
    if model_parallel():
        # Megatron's own finish: the grad reduce-scatter plus the tied embedding's grads
        # summed over the first and last pipeline stages.
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads([ddp])
    else:
        ddp.finish_grad_sync()
    if dp_size() > 1 or model_parallel():
        loss = global_loss(loss)
    if torch.cuda.is_available() and sync_before_step:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ok, grad_norm, _ = optimizer.step()
    if torch.cuda.is_available() and sync_after_step:
        torch.cuda.synchronize()
    if not ok:
        raise RuntimeError(f"step {step}: Megatron skipped the update (inf/nan gradients)")
    if args.offload_grads and hasattr(ddp, "offload_grad_buffers"):
        # (with steps still reading the grad buffers: deferalloc.megatron makes these wait)
        ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        ddp.restore_grad_buffers(synchronize=False)
        GRAD_OFFLOADS[0] += 1
    return loss.item(), float(grad_norm), time.perf_counter() - t0


def accumulated_forward_backward(args, ddp, tokens, pos, labels):
    """Forward and backward of ``--microbatches`` micro-batches of this rank's rows, each
    loss divided by their number, all but the last backward under DDP's ``no_sync()`` (grads
    accumulate in the grad buffer, reduced after the last); the mean loss."""
    n = args.microbatches
    if tokens.shape[0] % n:
        raise SystemExit(f"--microbatches {n} does not divide this rank's {tokens.shape[0]} rows")
    total = None
    for i, (t, p, y) in enumerate(zip(tokens.chunk(n), pos.chunk(n), labels.chunk(n))):
        ctx = ddp.no_sync() if i < n - 1 else contextlib.nullcontext()
        with ctx:
            loss = ddp(t, p, None, labels=y).float().mean() / n
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def pipeline_forward_backward(args, ddp, tokens, pos, labels):
    """Forward and backward of one micro-batch through megatron-core's pipeline schedule
    (1F1B with one micro-batch); the loss on the last stage, None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        out = model(tokens, pos, None, labels=labels)
        def loss_func(t):
            loss = t.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
        seq_length=args.seq, micro_batch_size=tokens.shape[0], forward_only=False)
    return losses[0]["loss"] if losses else None


def global_loss(loss):
    """The global batch's mean loss on every rank: the loss of the last pipeline stage's
    tensor-parallel rank 0, summed over the data-parallel ranks (equal halves) and divided
    by their number.  Other ranks add zeros (exact)."""
    from megatron.core import parallel_state
    mine = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    device = torch.device("cpu") if not torch.cuda.is_available() else torch.device("cuda", torch.cuda.current_device())
    out = loss.detach().clone().reshape(()) if mine else torch.zeros((), dtype=torch.float32, device=device)
    torch.distributed.all_reduce(out)
    return out / dp_size()


def engine_stats(streamed) -> dict:
    """The last engine pass of every streamed optimizer, summed: seconds, the host time spent
    mapping and retiring pieces, pieces, bytes each way, Python time before the engine call."""
    keys = ("seconds", "map_seconds", "retire_seconds", "io_wait_seconds", "python_seconds", "pieces", "params",
            "bytes_to_device", "bytes_from_device")
    stats = [s.stats() for s in streamed]
    return {k: sum(st[k] for st in stats) for k in keys}


def start_sampling(sampler: HbmSampler) -> None:
    """Note [HBM sampling]: the first steps' one-time allocations, cached free by torch's
    allocator, are given back in every mode before sampling starts."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sampler.start()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.directory:
        os.makedirs(args.directory, exist_ok=True)  # the file tier's directory must exist
    setup(args)
    gpt, ddp, optimizer, streamed = build(args)
    device = torch.device("cpu") if args.cpu_emulation else torch.device("cuda", torch.cuda.current_device())
    n_params = sum(p.numel() for p in gpt.parameters())
    rank0 = torch.distributed.get_rank() == 0  # prints and writes the summary
    first = 1
    mode = "hdo" if args.hdo else "odirect" if args.odirect_baseline else args.deferalloc
    summary = {"params": n_params, "mode": mode, "model_class": type(gpt).__name__}
    if args.load:
        first = load(gpt, optimizer, args.load) + 1
        summary["loaded_digest"] = state_digest(optimizer)
        if args.save and args.save_at == first - 1:  # re-save what was loaded (resharding checks)
            save(gpt, optimizer, args.save, first - 1)
    summary["reference"] = describe_optimizer(optimizer)
    cuda = torch.cuda.is_available()
    sampler = HbmSampler()
    losses, opt_seconds, step_seconds, between, engine = {}, [], [], [], []
    steps = list(range(first, args.steps + 1))
    warm = min(args.warmup_steps, max(0, len(steps) - 1))
    for k, step in enumerate(steps):
        if k == warm:
            start_sampling(sampler)
        if cuda:
            torch.cuda.synchronize()
        t_step = time.perf_counter()
        loss, grad_norm, seconds = train_step(args, ddp, optimizer, step, device)
        if cuda:
            # (the step across the next forward returns with passes in flight: the next
            # synchronisation would wait for them outside every iteration's time)
            torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - t_step)
        opt_seconds.append(seconds)
        if k >= warm:
            between.append({"used": sampler.used(), "torch_reserved": torch.cuda.memory_reserved() if cuda else 0,
                            "torch_allocated": torch.cuda.memory_allocated() if cuda else 0})
        if streamed:
            engine.append(engine_stats(streamed))
        losses[step] = loss
        if rank0:
            print(f"step {step:3d} loss {losses[step]:.6f} {float(losses[step]).hex()} grad_norm {float(grad_norm):.4f} "
                  f"optimizer {opt_seconds[-1] * 1e3:.1f} ms", flush=True)
        if args.save and step == args.save_at:
            save(gpt, optimizer, args.save, step)
            summary["saved_digest"] = state_digest(optimizer)
    sampler.stop()
    if streamed:
        import deferalloc.megatron
        deferalloc.megatron.synchronize(optimizer)  # (every path below waits anyway)
    summary["grad_offloads"] = GRAD_OFFLOADS[0]
    if args.digest:
        summary["final_digest"] = state_digest(optimizer)
    top = max(between, key=lambda b: b["used"]) if between else {"used": 0, "torch_reserved": 0, "torch_allocated": 0}
    summary.update(losses={str(k): v.hex() for k, v in losses.items()}, peak_hbm=sampler.peak,
                   between_hbm=top["used"], optimizer_seconds=opt_seconds, step_seconds=step_seconds,
                   window_mb=args.window_mb,
                   warmup_steps=warm,
                   hbm={"between": top, "non_torch_between": top["used"] - top["torch_reserved"],
                        "torch_max_reserved": torch.cuda.max_memory_reserved() if cuda else 0,
                        "torch_max_allocated": torch.cuda.max_memory_allocated() if cuda else 0})
    if streamed and streamed[0].backward_step is not None:
        summary["backward_step"] = streamed[0].backward_step.stats()
    if streamed:
        summary["engine_peak_backed"] = max(s.stats()["peak_backed_bytes"] for s in streamed)
        summary["engine"] = engine
    if rank0:
        print(f"params {n_params} ({type(gpt).__name__}) peak HBM {sampler.peak / 2**20:.0f} MiB between steps "
              f"{summary['between_hbm'] / 2**20:.0f} MiB (torch reserved {top['torch_reserved'] / 2**20:.0f}, "
              f"allocated {top['torch_allocated'] / 2**20:.0f})", flush=True)
    if args.summary and rank0:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    if dp_size() > 1:
        # Every rank done before any tears its gloo / NCCL pairs down: a rank whose peer
        # exited first can abort in gloo's shutdown ("terminate called without an active
        # exception", seen once in about ten two-process CPU runs without this barrier).
        torch.distributed.barrier()
    del gpt, ddp, optimizer, streamed
    teardown()
    return 0


def teardown() -> None:
    """Note [Teardown]: every process group, and what holds one, released here while the
    interpreter is whole.  destroy_process_group alone left Megatron's groups (20 gloo
    groups, two worker threads each, in parallel_state's globals and in the model's and
    optimizer's reference cycles) to be destroyed during interpreter finalization.  A
    thread that needs the GIL then (a gloo worker dropping a tensor's last reference) is
    ended by Python inside a noexcept frame, which aborts with "terminate called without
    an active exception" after a finished run: the likely cause of that rare abort (not
    reproduced here in 115 runs of a --load step; seen three times in test runs).  Afterwards
    only the default group's two workers are left, idle."""
    import gc
    from megatron.core import parallel_state
    torch.distributed.destroy_process_group()
    parallel_state.destroy_model_parallel()
    # megatron-core 0.16.1's destroy_model_parallel leaves a few (the intra-partial data
    # parallel groups) set.
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, torch.distributed.ProcessGroup):
            setattr(parallel_state, name, None)
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())
