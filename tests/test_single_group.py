"""A grouped convolution split to one group per rank (``autotp.rewrite.single_group``): it runs as im2col and a
matmul on CPU, never reaching oneDNN's dense weight-gradient kernel, which the unsharded depthwise convolution
never reaches either and which aborts the process for a kernel large against its input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from autotp.capture import capture
from autotp.options import Options
from autotp.planning import make_plan
from autotp.rewrite import rewrite
from autotp.rewrite.comm import ThreadComm
from autotp.rewrite.single_group import single_group_conv
from tests import conv_models

ROOT = Path(__file__).resolve().parent.parent
_CHECK = ("import torch, autotp; from tests.conv_models import HeadwiseConvAttention as M; torch.manual_seed(0); "
          "print(autotp.check(M(), 4, (torch.randint(0, 64, (2, 32)),)))")


def test_one_head_per_rank_of_a_long_depthwise_kernel_checks_exact_in_a_process_that_survives():
    """Nystromformer's structure (kernel 65 over 32 positions, 4 heads at tp=4): routed to oneDNN's dense kernel,
    the check's backward segfaults or hangs, so it runs in a child process that must exit cleanly."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.startswith("exact: tp=4"), proc.stdout


def test_each_rank_convolves_its_one_head_through_single_group_conv():
    torch.manual_seed(0)
    model, ids = conv_models.HeadwiseConvAttention(kernel=5), torch.randint(0, 64, (2, 8))
    cap = capture(model, (ids,), training=True)
    plan = make_plan(cap, Options(tp=4))
    assert plan.placements["conv.weight"].is_split
    gm = rewrite(cap, plan, 0, ThreadComm.group(4)[0])
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    assert [n.target for n in convs] == [single_group_conv], [n.target for n in convs]
    # at tp=2 each rank keeps two heads: still grouped, still torch's own (depthwise) convolution
    gm = rewrite(cap, make_plan(cap, Options(tp=2)), 0, ThreadComm.group(2)[0])
    assert [n.target for n in gm.graph.nodes if n.target is single_group_conv] == []


@pytest.mark.parametrize("spatial, kernel, stride, padding, dilation", [
    (2, (5, 3), (1, 1), (2, 1), (1, 1)),
    (2, (3, 3), (2, 1), (1, 0), (2, 1)),
    (2, (4, 3), (1, 1), "same", (1, 1)),   # an odd total padding: one more at the end, as torch pads
    (2, (3, 2), (1, 1), "valid", (1, 1)),
    (1, (7,), (1,), (3,), (1,)),
    (1, (4,), (2,), (2,), (1,)),
    (1, (4,), (1,), "same", (2,)),
    (3, (3, 2, 3), (1, 2, 1), (1, 0, 2), (1, 1, 2)),
])
def test_single_group_conv_computes_torch_s_convolution_and_its_gradients(spatial, kernel, stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 3, *(9, 8, 7)[:spatial], requires_grad=True)
    weight = torch.randn(4, 3, *kernel, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    want = conv(x, weight, bias, stride, padding, dilation)
    got = single_group_conv(x, weight, bias, stride, padding, dilation)
    assert_close(got, want)
    grad = torch.randn_like(want)
    assert_close(torch.autograd.grad(got, (x, weight, bias), grad), torch.autograd.grad(want, (x, weight, bias), grad))
