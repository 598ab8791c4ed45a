"""A stand-in for ``OptimizerConfig.defer_main_param_initialization`` on a megatron-core
release that lacks it (every release up to 0.19.2), for tests; also runs
examples/megatron/train_gpt.py with it installed (the same arguments).

What the option does in the patched Megatrons that carry it (their documentation and
tests, read for this): the DistributedOptimizer still builds one FP32 main param per
16-bit model shard (shape, dtype float32, the model's device, Megatron's tensor-parallel
attributes), the same object in ``model_param.main_param`` and in the inner optimizer's
groups, but releases its storage (``untyped_storage().nbytes() == 0``) and leaves the
values to an external state backend.  ``install()`` reproduces exactly that on the
installed megatron-core: OptimizerConfig gains the field (a dataclass subclass under the
same name in megatron.core.optimizer), and DistributedOptimizer's
``_build_model_and_main_param_groups``, Megatron's own, releases each FP32 main param's
storage after building it when the config asks.  FP32 model params (whose main param is
the param itself) are untouched, as there.  One difference: the patched builder releases
each main as it is made, this one after the loop (the peak of construction differs on a
GPU, not anything the tests check).
"""
from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def install() -> bool:
    """Installs the stand-in; False when megatron-core has the real option (nothing done)."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    base = optimizer_config.OptimizerConfig
    if "defer_main_param_initialization" in {f.name for f in dataclasses.fields(base)}:
        return False
    if getattr(base, "_dfa_standin", False):
        return True

    @dataclasses.dataclass
    class OptimizerConfig(base):
        defer_main_param_initialization: bool = False
        """Make FP32 main params with released storage; an external backend initialises them."""

    OptimizerConfig._dfa_standin = True
    OptimizerConfig.__qualname__ = OptimizerConfig.__name__ = "OptimizerConfig"
    optimizer_config.OptimizerConfig = OptimizerConfig
    mo.OptimizerConfig = OptimizerConfig

    original = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build(cls, *args, **kwargs):
        out = original.__func__(cls, *args, **kwargs)
        config = kwargs.get("config", args[-1] if args else None)
        if getattr(config, "defer_main_param_initialization", False):
            shard_fp32_from_float16_groups = out[4]
            for group in shard_fp32_from_float16_groups:
                for main in group:
                    main.untyped_storage().resize_(0)
        return out

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build)
    return True


def main() -> int:
    sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "megatron"))
    import train_gpt
    setup = train_gpt.setup

    def setup_with_standin(a):
        setup(a)
        install()

    train_gpt.setup = setup_with_standin
    return train_gpt.main()


if __name__ == "__main__":
    sys.exit(main())
