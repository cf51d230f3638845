"""``make gpu-check``: the course's GPU path, run on a machine with an NVIDIA GPU.

``python -m course_lib.classroom.gpu_check [--iters N] [--skip-tests] [--hardware NAME]`` runs, in order:

(a) **The code that only runs on a GPU.** The unit-test files that touch CUDA/NCCL (found by
    grepping ``tests/`` for ``torch.cuda`` / ``nccl``, today ``tests/launch/test_launch.py``) under pytest,
    then three probes on real ranks: the launcher's ``cpu:gloo,cuda:nccl`` group
    (:func:`course_lib.launch.init_rank`: one all-reduce of a CUDA tensor over NCCL and of a CPU
    tensor over gloo in the same group, under ``launch(..., launcher="torchrun", backend="nccl")``);
    the trainer on one GPU in fp32 (its loss against the CPU single-process reference, within
    1e-3 relative, TF32 being off for matmuls by default, and its memory lines read from
    ``torch.cuda.memory_allocated`` and friends, not the CPU's tracked bytes); the same in bf16 against
    the CPU's bf16 run (2e-2: the two devices' bf16 kernels round differently); with two or more
    GPUs, PP2 on two GPUs (the pipeline executor's receive buffers on the device, P2P over NCCL)
    against the same reference.
(b) **A single-GPU training run large enough to measure MFU**: the course GPT (8 layers,
    hidden 2048, 16 heads, sequence 1024, micro-batch 8: 0.41 B parameters, 21.5 model TFLOP a step) through
    ``python -m course_lib train --nproc-per-node 1``, in bf16 when the GPU supports it (else
    fp32); the median step time of the logged iterations (the first excluded, as
    :meth:`course_lib.training.logs.ParsedLog.step_time_ms` does), tokens/s, achieved TFLOP/s
    and MFU = model FLOPs (Korthikanti Eq. 7, :func:`course_lib.sizing.flops.model_flops_per_iteration`)
    / (step time x the GPU's dense bf16 peak).
(c) **Measured against the projection** for that GPU (:func:`course_lib.sizing.projection.project`
    with the profile :mod:`course_lib.sizing.hardware` matches to the device name: A100, H100 or
    H200), printing the ratio measured / projected. The course GPT is an unfused teaching model
    (no fused kernels, fp32 LayerNorm/softmax, a Python pipeline loop), so expect it to run slower
    than Megatron's kernels that the projection's GEMM model was fitted to: a ratio above 1.

Without a CUDA GPU it prints one line and exits 0::

    gpu-check: no CUDA GPU on this machine (torch 2.13.0+cpu): nothing to check; run `make gpu-check` where one is

Expected output on a GPU machine, on one H200 (the measured numbers below are an example, a
150 ms step, and the rest follows from it; the projection, 48.6 ms, is what ``project`` gives)::

    gpu-check: 1 x NVIDIA H200 (139.7 GiB), torch 2.x, CUDA 12.x, bf16 supported
    (a) pytest tests/launch/test_launch.py: passed
    (a) launcher cpu:gloo,cuda:nccl group on 1 rank(s): nccl all-reduce 1 on cuda:0, gloo all-reduce 1 on cpu
        (backend cpu:gloo,cuda:nccl): ok
    (a) trainer fp32 on 1 GPU: lm loss 5.936 5.728 5.171 vs CPU 5.936 5.728 5.171 (max rel err 2e-06): ok;
        memory lines from torch.cuda (rank 0: max allocated 12.3 MB): ok
    (a) trainer bf16 on 1 GPU: lm loss ... vs CPU bf16 ... (max rel err ...): ok; memory lines from torch.cuda: ok
    (a) trainer MoE (4 experts, top-2) on 1 GPU: lm loss ... vs CPU ... (max rel err ...): ok; memory lines ...: ok
    (a) trainer PP2 and MoE EP2 on 2 GPUs: skipped (1 GPU)
    (b) course GPT 0.41 B params, bf16, 1 GPU, micro-batch 8 x 1024 tokens: step 150 ms (median of 9),
        54,613 tokens/s, 143 TFLOP/s, MFU 14.5%
    (c) projection for H200 SXM (HGX H200, NDR): step 48.6 ms, MFU 45%; measured / projected = 3.09
    gpu-check: all checks passed

Every check prints ``ok``/``FAILED``; the exit code is 1 when any failed. ``--skip-tests`` skips
(a)'s pytest run; ``--hardware`` forces a profile when the device name matches none.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = "gpu-check: no CUDA GPU on this machine (torch {torch}): nothing to check; run `make gpu-check` where one is"
# The MFU run (b): the course GPT at a size where the GEMMs dominate a step.
MFU_MODEL = dict(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=1024, micro_batch_size=8)
# The parity runs (a): tests/test_train.py's small model and settings.
PARITY = ["--uniform-vocab-padding", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
          "--log-interval", "2", "--lr", "3e-3", "--lr-decay-style", "constant"]
PARITY_TOL = 1e-3
BF16_TOL = 2e-2
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall"]
"""The MoE GPT of the MoE checks: 4 experts in every layer, top-2, Megatron's alltoall dispatcher."""
EP2 = MOE + ["--expert-model-parallel-size", "2"]
"""...split over 2 ranks: the counts all-gathered and the rows and gates all-to-all'd over NCCL."""


def hardware_name(device_name: str) -> str | None:
    """The :mod:`course_lib.sizing.hardware` profile for a CUDA device name (``"NVIDIA H200"`` -> ``"H200"``)."""
    for key in ("H200", "H100", "A100"):
        if key in device_name.upper():
            return key
    return None


def cuda_test_files(tests_dir: Path = ROOT / "tests") -> list[Path]:
    """The test files that touch CUDA or NCCL (their source names ``torch.cuda`` or ``nccl``)."""
    return sorted(p for p in tests_dir.rglob("test_*.py") if re.search(r"torch\.cuda|nccl", p.read_text()))


def nccl_probe() -> dict:
    """One rank of (a)'s launcher probe: the ``cpu:gloo,cuda:nccl`` default group carries a CUDA
    tensor over NCCL and a CPU tensor over gloo."""
    import torch
    import torch.distributed as dist

    gpu = torch.ones(1, device="cuda")
    dist.all_reduce(gpu)
    cpu = torch.ones(1)
    dist.all_reduce(cpu)
    return dict(backend=str(dist.get_backend()), gpu=gpu.item(), gpu_device=str(gpu.device), cpu=cpu.item(),
                world=dist.get_world_size())


def run_trainer(flags: list[str], nproc: int = 1, timeout: float = 600):
    """``python -m course_lib train --nproc-per-node nproc FLAGS``; (exit code, parsed log, output)."""
    from course_lib.training.logs import parse_log

    cmd = [sys.executable, "-m", "course_lib", "train", "--nproc-per-node", str(nproc), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)))
    text = out.stdout + out.stderr
    return out.returncode, parse_log(text), text


def _losses(log) -> list[float]:
    return [it["lm_loss"] for it in log.iterations]


def parity_check(label: str, flags: list[str], nproc: int, reference: list[float],
                 tol: float = PARITY_TOL) -> tuple[bool, str]:
    """A trainer run on GPUs whose logged losses must equal the CPU reference (Megatron's logged averages)."""
    return judge_parity(label, *run_trainer(PARITY + flags, nproc), reference, tol)


def judge_parity(label: str, code: int, log, text: str, reference: list[float],
                 tol: float = PARITY_TOL) -> tuple[bool, str]:
    """(passed, the report line) of one trainer run (:func:`run_trainer`'s exit code, parsed log and
    output) against the CPU reference: the losses within ``tol`` and the memory lines from torch.cuda."""
    got = _losses(log)
    if code != 0 or len(got) != len(reference):
        return False, f"(a) {label}: FAILED (exit {code})\n{text[-2000:]}"
    err = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    ok = err < tol
    line = (f"(a) {label}: lm loss {' '.join(f'{x:.3f}' for x in got)} vs CPU "
            f"{' '.join(f'{x:.3f}' for x in reference)} (max rel err {err:.1g}): {'ok' if ok else 'FAILED'}")
    mem = [m for m in log.memory if m["rank"] == 0]
    cuda_mem = bool(mem) and all(m.get("source") != "tracked tensor bytes" for m in mem)
    line += (f";\n    memory lines from torch.cuda (rank 0: max allocated {max(m['max_allocated_mb'] for m in mem):.1f} "
             f"MB): ok" if cuda_mem else ";\n    memory lines: FAILED (not from torch.cuda)")
    return ok and cuda_mem, line


def cpu_reference(flags: list[str] = ()) -> list[float]:
    """The single-process CPU losses as the trainer logs them (iteration 1, then averages over 2)."""
    from course_lib.train import parse_args, train_single_process

    losses = train_single_process(parse_args(PARITY + list(flags)))["lm_loss"]
    return [losses[0], (losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2]


def measure_mfu(precision: str, iters: int = 10) -> dict:
    """(b): the MFU run on one GPU; returns step time (s), tokens/s, TFLOP/s and MFU against ``peak``."""
    m = MFU_MODEL
    flags = ["--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
             "--num-attention-heads", str(m["num_attention_heads"]), "--seq-length", str(m["seq_length"]),
             "--micro-batch-size", str(m["micro_batch_size"]), "--global-batch-size", str(m["micro_batch_size"]),
             "--train-iters", str(iters), "--log-interval", "1"]
    if precision != "fp32":
        flags.append(f"--{precision}")
    code, log, text = run_trainer(flags, 1)
    if code != 0 or log.step_time_ms() is None:
        raise RuntimeError(f"the MFU run failed (exit {code}):\n{text[-3000:]}")
    from course_lib.rules import vocab_size_with_padding

    # the byte tokenizer's 257 symbols padded as the trainer pads them at TP 1 (Megatron's rule): 384
    return dict(step_time=log.step_time_ms() / 1000, steps=len(log.iterations) - 1,
                vocab=vocab_size_with_padding(257))


def model_flops(vocab: int) -> float:
    from course_lib.sizing.flops import model_flops_per_iteration

    m = MFU_MODEL
    return model_flops_per_iteration(m["micro_batch_size"], m["seq_length"], m["num_layers"], m["hidden_size"],
                                     vocab)


def projection_line(step_time: float, hardware: str | None, vocab: int) -> str:
    """(c): the projected step for the MFU run's model on ``hardware``, and measured / projected."""
    try:
        from course_lib.sizing.planner import ModelSpec
        from course_lib.sizing.projection import project
    except ImportError:
        return "(c) projection: not available"
    if hardware is None:
        return "(c) projection: not available (no profile for this GPU; give --hardware A100|H100|H200)"
    m = MFU_MODEL
    spec = ModelSpec("course GPT", m["num_layers"], m["hidden_size"], m["num_attention_heads"], vocab,
                     m["seq_length"])
    p = project(spec, tp=1, pp=1, dp=1, micro_batch_size=m["micro_batch_size"],
                global_batch_size=m["micro_batch_size"], hardware=hardware)
    return (f"(c) projection for {p.hardware.name}: step {p.step_time * 1e3:.3g} ms, MFU {p.mfu:.0%}; "
            f"measured / projected = {step_time / p.step_time:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.classroom.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="iterations of the MFU run (b)")
    parser.add_argument("--skip-tests", action="store_true", help="skip (a)'s pytest run")
    parser.add_argument("--hardware", default=None, help="projection profile (default: from the device name)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU.format(torch=torch.__version__))
        return 0
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    bf16 = torch.cuda.is_bf16_supported()
    print(f"gpu-check: {n} x {name} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, bf16 {'supported' if bf16 else 'not supported'}",
          flush=True)
    ok = True
    if not args.skip_tests:
        files = [str(p.relative_to(ROOT)) for p in cuda_test_files()]
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                              cwd=ROOT).returncode
        print(f"(a) pytest {' '.join(files)}: {'passed' if code == 0 else 'FAILED'}", flush=True)
        ok &= code == 0
    from course_lib.classroom.gpu_check import nccl_probe as probe  # importable by torchrun's ranks (not __main__'s)
    from course_lib.launch import launch

    world = min(n, 2)
    res = launch(probe, world_size=world, launcher="torchrun", backend="nccl", output="none", timeout=120)
    probe_ok = all(r["gpu"] == world and r["cpu"] == world and r["gpu_device"].startswith("cuda") for r in res)
    print(f"(a) launcher cpu:gloo,cuda:nccl group on {world} rank(s): nccl all-reduce {res[0]['gpu']:g} on "
          f"{res[0]['gpu_device']}, gloo all-reduce {res[0]['cpu']:g} on cpu (backend {res[0]['backend']}): "
          f"{'ok' if probe_ok else 'FAILED'}", flush=True)
    ok &= probe_ok
    reference = cpu_reference()
    good, line = parity_check("trainer fp32 on 1 GPU", [], 1, reference)
    print(line, flush=True)
    ok &= good
    if bf16:   # CUDA's and the CPU's bf16 kernels round differently: a looser tolerance than fp32's
        good, line = parity_check("trainer bf16 on 1 GPU", ["--bf16"], 1, cpu_reference(["--bf16"]), BF16_TOL)
        print(line, flush=True)
        ok &= good
    moe_reference = cpu_reference(MOE)
    good, line = parity_check("trainer MoE (4 experts, top-2) on 1 GPU", MOE, 1, moe_reference)
    print(line, flush=True)
    ok &= good
    if n >= 2:
        for label, flags, want in (("trainer PP2 on 2 GPUs", ["--pipeline-model-parallel-size", "2"], reference),
                                   ("trainer MoE EP2 on 2 GPUs (alltoall dispatch over NCCL)", EP2, moe_reference)):
            good, line = parity_check(label, flags, 2, want)
            print(line, flush=True)
            ok &= good
    else:
        print("(a) trainer PP2 and MoE EP2 on 2 GPUs: skipped (1 GPU)", flush=True)
    precision = "bf16" if bf16 else "fp32"
    hw = args.hardware or hardware_name(name)
    mfu = measure_mfu(precision, args.iters)
    flops = model_flops(mfu["vocab"])
    peak = None
    if hw is not None:
        from course_lib.sizing.hardware import get_hardware

        peak = get_hardware(hw).peak_flops
    m = MFU_MODEL
    tokens = m["micro_batch_size"] * m["seq_length"]
    from course_lib.sizing.flops import num_parameters

    params = num_parameters(m["num_layers"], m["hidden_size"], mfu["vocab"], m["seq_length"])
    print(f"(b) course GPT {params / 1e9:.2f} B params, {precision}, 1 GPU, micro-batch {m['micro_batch_size']} x "
          f"{m['seq_length']} tokens: step {mfu['step_time'] * 1e3:.3g} ms (median of {mfu['steps']}), "
          f"{tokens / mfu['step_time']:,.0f} tokens/s, {flops / mfu['step_time'] / 1e12:.0f} TFLOP/s, "
          + (f"MFU {flops / mfu['step_time'] / peak:.1%}" if peak else "MFU: no peak known for this GPU"),
          flush=True)
    print(projection_line(mfu["step_time"], hw, mfu["vocab"]), flush=True)
    print("gpu-check: all checks passed" if ok else "gpu-check: some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
