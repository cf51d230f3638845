"""Step time of DeepSpeed's ZeRO-3 (``deepspeed.initialize``, stage 3) against our ZeRO-3
(course_lib.distributed, ``optim_grads_params``) and PyTorch's FSDP2 on a CPU gloo mesh, as ratios
(prints figures, asserts nothing).

The model, data and timing are ``benchmarks/fsdp2_vs_zero3.py``'s: ``--layers`` Linear(``--hidden``,
``--hidden``) + GELU, fp32, AdamW (weight decay 0.01 on the matrices, none on the biases), ``--rows``
rows per rank per step on ``--ranks`` ranks; the three alternate step by step, each timing the
median over ``--repeats`` steps after warm-up. DeepSpeed runs with ``DS_ACCELERATOR=cpu`` (gloo),
``torch.optim.AdamW`` as its optimizer, ``stage3_param_persistence_threshold`` 0 (every parameter
partitioned, like the other two), ``overlap_comm``, default buckets and prefetch. Also printed: the
loss after the timed steps on each side (same data, same init: they agree to ~1e-6).

    python benchmarks/deepspeed_zero3.py [--ranks 4] [--hidden 512] [--layers 8] [--rows 32] [--repeats 20]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from course_lib.deepspeed.schema import import_deepspeed  # noqa: E402
from fsdp2_vs_zero3 import LR, _groups, _model, batch, build_steps, run_bench, time_steps  # noqa: E402

deepspeed = import_deepspeed()       # DS_ACCELERATOR=cpu without CUDA; imported once, before forking


def _rank_bench(hidden: int, layers: int, rows: int, repeats: int, warmup: int):
    warnings.filterwarnings("ignore", category=FutureWarning)
    steps, _ = build_steps(hidden, layers, rows)
    model = _model(hidden, layers)
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(_groups(model), lr=LR, eps=1e-8),
                                           config=config, dist_init_required=False)
    x, y = batch(hidden, rows)

    def step_deepspeed():
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    medians, losses = time_steps({**steps, "deepspeed": step_deepspeed}, repeats, warmup)
    engine.destroy()
    return {"median": medians, "losses": losses}


def main(argv=None) -> None:
    args, res = run_bench(_rank_bench, __doc__.splitlines()[0], argv)
    step = {name: max(r["median"][name] for r in res) for name in res[0]["median"]}   # the slowest rank ends a step
    losses = res[0]["losses"]
    print(f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}), {args.rows} rows/rank, {args.ranks} ranks, "
          f"fp32, median of {args.repeats} steps")
    print(f"  DeepSpeed ZeRO-3 (stage 3, overlap_comm, torch AdamW):   {step['deepspeed'] * 1e3:8.2f} ms/step")
    print(f"  ours ZeRO-3 (optim_grads_params, overlap_grad_reduce):   {step['ours'] * 1e3:8.2f} ms/step")
    print(f"  FSDP2 fully_shard + AdamW:                              {step['fsdp2'] * 1e3:8.2f} ms/step")
    print(f"  ratios: DeepSpeed / FSDP2 {step['deepspeed'] / step['fsdp2']:.2f}x, ours / FSDP2 "
          f"{step['ours'] / step['fsdp2']:.2f}x, DeepSpeed / ours {step['deepspeed'] / step['ours']:.2f}x")
    print(f"  loss after the timed steps: DeepSpeed {losses['deepspeed']:.6f}, ours {losses['ours']:.6f}, "
          f"FSDP2 {losses['fsdp2']:.6f}")


if __name__ == "__main__":
    main()
