"""course_lib.classroom.gpu_check (``make gpu-check``) on a machine without a GPU: one line, exit 0; its pieces."""

import pytest
import torch

from course_lib.classroom import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs the checks")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(capsys):
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out == gpu_check.NO_GPU.format(torch=torch.__version__) + "\n"


def test_pieces_that_do_not_need_a_gpu():
    assert [gpu_check.hardware_name(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                                                 "Tesla T4")] == ["H200", "H100", "A100", None]
    assert "test_launch.py" in [p.name for p in gpu_check.cuda_test_files()]
    # the MFU model: 8 layers x 12 h^2 + embeddings (Narayanan Eq. 2), ~0.40 B parameters
    from course_lib.sizing.flops import num_parameters

    m = gpu_check.MFU_MODEL
    assert round(num_parameters(m["num_layers"], m["hidden_size"], 384, m["seq_length"]) / 1e9, 2) == 0.41
    line = gpu_check.projection_line(0.1, "H200", 384)
    projected_ms = float(line.split("step ")[1].split(" ms")[0])
    ratio = float(line.rsplit("= ", 1)[1])
    assert line.startswith("(c) projection for H200") and ratio == pytest.approx(100 / projected_ms, rel=1e-2)
    assert gpu_check.projection_line(0.1, None, 384).startswith("(c) projection: not available")


def test_the_moe_parity_check_passes_through_gloo_and_catches_a_wrong_reference():
    """The GPU check's MoE EP2 parity, run as it runs on GPUs but on 2 CPU ranks (the trainer's gloo path):
    the EP2 losses equal the single-process reference; the same run against a reference off by 1% fails."""
    reference = gpu_check.cpu_reference(gpu_check.MOE)
    run = gpu_check.run_trainer(gpu_check.PARITY + gpu_check.EP2, 2)
    good, line = gpu_check.judge_parity("MoE EP2 on 2 CPU ranks", *run, reference)
    assert good is False and "memory lines: FAILED (not from torch.cuda)" in line     # CPU: tracked bytes
    assert line.startswith("(a) MoE EP2 on 2 CPU ranks: lm loss") and "): ok;" in line, line
    wrong, line = gpu_check.judge_parity("MoE EP2, wrong reference", *run, [x * 1.01 for x in reference])
    assert wrong is False and "): FAILED;" in line, line
