"""A Hugging Face ``Trainer`` run with deferalloc.optim.StreamedAdamW as its optimizer.

The Trainer takes any torch optimizer through ``optimizers=(optimizer, scheduler)``; its
checkpoints save ``optimizer.state_dict()`` and ``resume_from_checkpoint`` loads it back
(StreamedAdamW's FP32 main params and moments, read from the tier).  A tiny Llama from a
config (random init, nothing downloaded) on random tokens.

    # CPU, host driver (no GPU)
    DEFERALLOC_CONF=driver:host python examples/python/hf_trainer.py --cpu
    # GPU
    python examples/python/hf_trainer.py

(With ``pip install .``; from a source build, prefix ``PYTHONPATH=python
DEFERALLOC_LIB=build/allocator/libdeferalloc.so``.)

--check also resumes a second Trainer from the run's middle checkpoint and requires the
final weights to be the uninterrupted run's, bit for bit.  Needs transformers and
accelerate (the Trainer's dependency); without them it exits with 77 (skipped).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

try:
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments,
                              get_linear_schedule_with_warmup)
    import accelerate  # noqa: F401  (the Trainer needs it)
except ImportError as e:
    print(f"hf_trainer: skipped: {e} (pip install transformers accelerate)")
    sys.exit(77)

from deferalloc.optim import StreamedAdamW


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(args):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)
    # The optimizer takes the parameters where they will train: on the GPU unless --cpu (the
    # Trainer would move the model after the optimizer was built on its CPU parameters).
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to("cpu" if args.cpu else "cuda")
    opt = StreamedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, tier=args.tier, window_mb=8,
                        directory=args.directory, overwrite=args.tier == "file")
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=args.steps)
    return model, opt, sched


def run(args, out: str, resume: str | None = None):
    model, opt, sched = build(args)
    targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                              save_strategy="steps", save_steps=args.steps // 2, logging_steps=1,
                              report_to=[], use_cpu=args.cpu, seed=0, data_seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(64, 32, 256), optimizers=(opt, sched))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tier", default="host", choices=("host", "file", "device"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.directory = os.path.join(tmp, "state") if args.tier == "file" else None
        if args.directory:
            os.makedirs(args.directory)
        model, losses = run(args, os.path.join(tmp, "run"))
        print("hf_trainer: losses", " ".join(f"{x:.4f}" for x in losses))
        if args.check:
            middle = os.path.join(tmp, "run", f"checkpoint-{args.steps // 2}")
            resumed, rlosses = run(args, os.path.join(tmp, "resumed"), resume=middle)
            same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), resumed.state_dict().values()))
            print(f"hf_trainer: resumed from {os.path.basename(middle)}: losses",
                  " ".join(f"{x:.4f}" for x in rlosses), "; final weights", "identical" if same else "DIFFER")
            if not same:
                sys.exit(1)


if __name__ == "__main__":
    main()
