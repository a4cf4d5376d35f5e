"""``torch.compile`` with inductor on CUDA, fp32: the compiled MoE layer against the loop
reference and the compiled whole model against eager (:mod:`compile_check`)."""

from __future__ import annotations

import torch
from compile_check import check_layer, check_model, markdown
from gpu_util import needs_cuda, report_dir

pytestmark = needs_cuda


def test_inductor_layer_and_model_match_eager():
    layer = check_layer("cuda", "inductor", 64)
    model = check_model("cuda", "inductor", 64)
    md = markdown({"device": torch.cuda.get_device_name(), "backend": "inductor"}, layer, model)
    d = report_dir("compile_check")
    if d is not None:
        (d / "compile_check.md").write_text(md)
    print(md)
    assert layer["ok"], layer
    assert model["ok"], model
