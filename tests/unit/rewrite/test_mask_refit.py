"""compact_mask refits each term of a conjunction where the others hold. Refitting two terms
each under the other's original form is not exact: both may turn true where both were false.
That made the CUDA plan of a ConvTranspose (auto_pad SAME_UPPER, stride 2; ONNX's
test_convtranspose_autopad_same) read the input into the zero-stuffed odd rows. The rewritten
kernel must compute what the merged (unrewritten) one does, on every element."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

from powerfusion.gir.interpreter import run_gir


def _conv_transpose(n: int, stride: int):
    node = h.make_node("ConvTranspose", ["X", "W"], ["Y"], auto_pad="SAME_UPPER", strides=[stride, stride])
    g = h.make_graph([node], "convtranspose_same", [h.make_tensor_value_info("X", T.FLOAT, [1, 1, n, n]),
                                                    h.make_tensor_value_info("W", T.FLOAT, [1, 2, 3, 3])],
                     [h.make_tensor_value_info("Y", T.FLOAT, [1, 2, n * stride, n * stride])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("n,stride", [(3, 2), (5, 2), (4, 3)])
def test_rewritten_zero_stuffing_matches_the_merged_kernel(n, stride):
    from powerfusion.compiler import compile_model
    rng = np.random.default_rng(0)
    feeds = {"X": rng.standard_normal((1, 1, n, n)).astype(np.float32) + 1.0,
             "W": rng.standard_normal((1, 2, 3, 3)).astype(np.float32)}
    plan = compile_model(_conv_transpose(n, stride), "cuda")
    assert plan.kernel_steps
    for step in plan.kernel_steps:
        assert step.merged is not None
        got, want = run_gir(step.gir, feeds), run_gir(step.merged, feeds)
        for name in step.gir.outputs:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_search_rejects_a_rewritten_plan_that_computes_something_else():
    """The search's numeric check (pipeline/search.py: equivalence) runs a small rewritten plan
    against its merged plan: a plan that reads the input where the merged one writes zeros is
    refused (the mask-refit bug above would have been caught there)."""
    from dataclasses import replace
    from powerfusion.compiler import compile_model
    from powerfusion.pipeline.search import equivalence
    step = compile_model(_conv_transpose(3, 2), "cuda").kernel_steps[0]
    assert equivalence(step.gir, step.merged) == ""
    op = step.merged.ops[0]
    unmasked = replace(op, inputs=(replace(op.inputs[0], valid=None),))
    broken = replace(step.merged, ops=(unmasked,) + tuple(step.merged.ops[1:]))
    assert equivalence(broken, step.merged) != ""
