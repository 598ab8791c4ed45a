"""deferalloc.megatron's ``step_in_backward="auto"`` (Note [Stepping aside]) on the CPU (gloo,
cpu_emulation, deferalloc's host driver, one process).

examples/megatron/train_gpt.py's model, DDP with ``overlap_grad_reduce`` and small buckets,
Megatron's clipping never firing, 20 steps, built three times in one process: the plain step,
the step always inside backward, and "auto" with a fake clock (the policy's ``clock``, set
before the first step) that the test advances by the cost it gives the mode of each iteration:
the inside mode cheaper until step 12, the plain mode cheaper after it, a probe every 4
iterations after the first.  Checks:
  1. the policy (its ``settle`` set to 0): plain through the warm-up (2 steps), a probe of 3 plain + 3 inside steps,
     inside chosen (the faster), 4 steps inside, a probe (3 inside + 3 plain), plain chosen;
     the times it measured are the fake clock's; one INFO line per choice;
  2. bit-identity across the switches: every step's loss and every step's optimizer state
     (read through the engine right after the step: main params, moments, step counts)
     equal the plain run's and the always-inside run's;
  3. the inside iterations really stepped inside backward (bucket passes, speculations);
  4. the same switches (a warm-up of 1 step) with Megatron's clipping firing at every step
     and clip policy "speculate" (every inside iteration's speculation discarded and redone):
     losses and every step's state equal the plain run's; the same always inside with the
     worker lagging (each pass 20 ms late, so that passes run after Megatron's clip);
  5. with ``step_overlap_forward=True`` (overlap_param_gather; the policy times whole
     iterations, from one zero_grad_buffer to the next, the fake clock advanced after each
     step by its mode's cost), the policy's default ``settle`` (2) and the first three inside
     iterations costing 10 s (one-off costs): the first probe runs the inside mode 5 times, 3
     untimed, and chooses it (timing the costly ones would choose plain), then 4 inside and a
     probe of 3 inside + 3 plain; losses and every step's state equal the plain run's;
  6. an unknown ``step_in_backward`` is refused;
  7. the worker waits for a grad-reduce handle of NCCL only (the grads' device type's backend).
Exit 0 / 1; 77 without megatron-core.
"""
from __future__ import annotations

import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "megatron")
sys.path.insert(0, EXAMPLE)
sys.path.insert(0, HERE)

from megatron_runs import check, failures, in_child, require_megatron  # noqa: E402

require_megatron()

import torch  # noqa: E402

MODEL = ["--cpu-emulation", "--layers", "1", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq", "16",
         "--batch", "2", "--deferalloc", "host", "--overlap-grad-reduce", "--bucket-size", "3000",
         "--clip-grad", "1000"]
STEPS = 20
# The mode of each step under the fake clock below (warm-up, probe, chosen, probe, chosen).
EXPECTED = ["plain"] * 2 + ["plain"] * 3 + ["inside"] * 3 + ["inside"] * 4 + ["inside"] * 3 + ["plain"] * 3 + \
    ["plain"] * 2
# The same with a warm-up of 1 (set on the policy after construction).
EXPECTED_W1 = ["plain"] + ["plain"] * 3 + ["inside"] * 3 + ["inside"] * 4 + ["inside"] * 3 + ["plain"] * 3 + \
    ["plain"] * 3


# The same policy's default `settle` (2) where the first three inside iterations carry a one-off
# cost (10 s): the first probe runs inside for 5 iterations, 3 untimed, and chooses inside;
# timing the second and third (settle 0) would choose plain.
EXPECTED_SETTLE = ["plain"] * 2 + ["plain"] * 3 + ["inside"] * 5 + ["inside"] * 4 + ["inside"] * 3 + ["plain"] * 3


def cost(step: int, mode: str) -> float:
    """The fake clock's seconds for an iteration: inside backward cheaper up to step 12."""
    inside_faster = step <= 12
    return 1.0 if (mode == "inside") == inside_faster else 2.0


class OneOff:
    """`cost` with 10 s for each of the first ``n`` inside iterations (first-use costs)."""

    def __init__(self, n: int = 3):
        self.left = n

    def __call__(self, step: int, mode: str) -> float:
        if mode == "inside" and self.left:
            self.left -= 1
            return 10.0
        return cost(step, mode)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if "step_in_backward" in record.getMessage():
            self.lines.append(record.getMessage())


def run(train_gpt, mode: str | bool, clock: FakeClock | None = None, more: tuple = (), warmup: int = 2,
        whole: bool = False, settle: int | None = 0, costs=cost) -> dict:
    """``whole``: step_overlap_forward, whose policy decides and times at the next iteration's
    start (its zero_grad_buffer): each step's mode is read, and its cost added, after it.
    ``settle``: the policy's (None: its default)."""
    extra = [] if mode is False else ["--step-in-backward"] if mode is True else ["--step-in-backward", "auto"]
    args = train_gpt.parse_args(MODEL + extra + ["--steps", str(STEPS), *more])
    gpt, ddp, optimizer, streamed = train_gpt.build(args)
    inner = streamed[0]
    aside = inner.backward_step.aside if inner.backward_step is not None else None
    if clock is not None:
        aside.clock = clock
        aside.recheck = 4
        aside.warmup = warmup
        if settle is not None:
            aside.settle = settle
    out = {"losses": [], "digests": [], "steps": [], "modes": [], "optimizer": optimizer}
    for step in range(1, STEPS + 1):
        if aside is not None and not whole:
            out["modes"].append(aside.mode)
            clock.t += costs(step, aside.mode)
        loss, _, _ = train_gpt.train_step(args, ddp, optimizer, step, torch.device("cpu"))
        if aside is not None and whole:
            out["modes"].append(aside.mode)
            clock.t += costs(step, aside.mode)
        out["losses"].append(loss)
        out["digests"].append(train_gpt.state_digest(optimizer))  # (reads through the engine)
        out["steps"].append(sorted(int(st["step"]) for st in inner.state_dict()["state"].values()))
    out["stats"] = inner.backward_step.stats() if inner.backward_step is not None else None
    return out


def in_process() -> None:
    import train_gpt

    import deferalloc.megatron as dm
    from deferalloc.optim import InvalidArgumentError

    train_gpt.setup(train_gpt.parse_args(MODEL))
    log = Records()
    logging.getLogger("deferalloc").addHandler(log)
    logging.getLogger("deferalloc").setLevel(logging.INFO)
    plain = run(train_gpt, False)
    inside = run(train_gpt, True)
    clock = FakeClock()
    auto = run(train_gpt, "auto", clock)

    st = auto["stats"]
    aside = st["step_aside"]
    print("auto:", st, flush=True)
    check(auto["modes"] == EXPECTED, f"the modes step by step: {auto['modes']}")
    check(aside["chosen"] == "plain" and aside["mode"] == "plain" and aside["probes"] == 2 and
          aside["switches"] == 2 and aside["iterations"] == {"plain": EXPECTED.count("plain"),
                                                             "inside": EXPECTED.count("inside")},
          f"two probes, inside chosen then plain, two switches ({aside})")
    check(aside["measured_seconds"] == {"plain": 1.0, "inside": 2.0},
          f"the last probe's times are the fake clock's ({aside['measured_seconds']})")
    check(len(log.lines) == 2 and "inside backward" in log.lines[0] and "plainly" in log.lines[1],
          f"one INFO line per choice: {log.lines}")
    check(st["buckets"] > 0 and st["speculations"] > 0 and st["commits"] == st["speculations"] and
          st["redos"] == 0, "the inside iterations stepped bucket groups inside backward (speculated, committed)")
    check(inside["stats"]["buckets"] > 0 and "step_aside" not in inside["stats"],
          "step_in_backward=True: always inside, no policy")

    check(plain["losses"] == inside["losses"] == auto["losses"], "losses: auto == plain == always inside")
    check(plain["digests"] == inside["digests"] == auto["digests"],
          "the state after every step (read through the engine, across both switches): auto == plain == inside")
    check(plain["steps"] == auto["steps"] and auto["steps"][-1][0] == STEPS,
          "the step counts in state_dict after every step: auto == plain")
    differ = sum(a != b for a, b in zip(plain["digests"], plain["digests"][1:]))
    check(differ == STEPS - 1, "the state changes at every step (the comparison can fail)")

    fires = ("--clip-grad", "1.0", "--clip-policy", "speculate")  # (the tiny model's norm is about 1.7)
    plain_c = run(train_gpt, False, more=fires)
    auto_c = run(train_gpt, "auto", FakeClock(), more=fires, warmup=1)
    st = auto_c["stats"]
    print("auto, clipping fires:", st, flush=True)
    inside_steps = EXPECTED.count("inside")
    check(auto_c["modes"] == EXPECTED_W1 and st["speculations"] == inside_steps and st["redos"] == inside_steps and
          st["commits"] == 0, "clipping firing, policy speculate: every inside iteration speculated and redone")
    check(plain_c["losses"] == auto_c["losses"] and plain_c["digests"] == auto_c["digests"] and
          plain_c["losses"] != plain["losses"],
          "clipping firing: losses and every step's state, auto (switching) == plain (and they differ from unclipped)")

    # The worker lagging behind Megatron's step (each pass 20 ms late): passes taken after
    # Megatron clipped the grads; Note [A reduce-scatter waited twice].
    import deferalloc.overlap as ov
    step_bucket = ov.BackwardOverlap._step_bucket

    def late(self, items):
        time.sleep(0.02)
        return step_bucket(self, items)
    ov.BackwardOverlap._step_bucket = late
    try:
        lag_c = run(train_gpt, True, more=fires)
    finally:
        ov.BackwardOverlap._step_bucket = step_bucket
    st = lag_c["stats"]
    check(st["redos"] == STEPS and plain_c["losses"] == lag_c["losses"] and plain_c["digests"] == lag_c["digests"],
          f"clipping firing, the worker lagging: always inside == plain, every step's state ({st})")

    fwd = run(train_gpt, "auto", FakeClock(), more=("--overlap-param-gather", "--step-overlap-forward"), whole=True,
              settle=None, costs=OneOff(3))
    st = fwd["stats"]
    aside = st["step_aside"]
    print("auto, step_overlap_forward:", st, flush=True)
    check(fwd["modes"] == EXPECTED_SETTLE and aside["measured_seconds"] == {"plain": 2.0, "inside": 1.0} and
          aside["chosen"] == "inside" and aside["probes"] == 1 and aside["switches"] == 2,
          f"step_overlap_forward: whole iterations timed; the default settle leaves the inside mode's three "
          f"costly first iterations untimed and chooses it ({fwd['modes']}, {aside})")
    check(plain["losses"] == fwd["losses"] and plain["digests"] == fwd["digests"],
          "step_overlap_forward, auto: losses and every step's state == plain")

    try:
        dm.stream_optimizer_state(plain["optimizer"], step_in_backward="sometimes")
        check(False, "step_in_backward='sometimes' is refused")
    except InvalidArgumentError as e:
        check("sometimes" in str(e), f"step_in_backward='sometimes' is refused ({e})")
    torch.distributed.destroy_process_group()


def backend_rule() -> None:
    """Which grad-reduce handles the worker waits for: a NCCL group's for the grads' device
    type only (Note [A reduce-scatter waited twice]), on stand-ins for the group's config."""
    import types

    import deferalloc.megatron as dm
    real = torch.distributed.get_backend_config
    grads = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    bg = types.SimpleNamespace(data_parallel_group=None, buckets=[types.SimpleNamespace(grad_data=grads)])
    try:
        for config, device, want in [("cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cuda", True),
                                     ("cpu:gloo,cuda:nccl", "cpu", False), ("cpu:gloo,cuda:gloo", "cuda", False),
                                     ("cpu:single_rank,cuda:single_rank", "cuda", False)]:
            torch.distributed.get_backend_config = lambda group=None, c=config: c
            grads.device.type = device
            check(dm._wait_orders_streams(bg) == want,
                  f"grads on {device} under {config}: the worker {'waits' if want else 'does not wait'}")
    finally:
        torch.distributed.get_backend_config = real


def main() -> int:
    os.environ.setdefault("MASTER_PORT", str(29900 + os.getpid() % 90))
    in_child(in_process)
    backend_rule()
    print(f"{len(failures)} failure(s)" if failures else "all step-aside checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
