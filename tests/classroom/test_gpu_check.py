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
