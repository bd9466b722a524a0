"""Transposes that only move extent-1 axes are reshapes (no data moves); a bad perm is an
error naming the node."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from powerfusion.errors import PowerFusionError
from powerfusion import basic as B
from powerfusion.frontend import import_model


def _model(shape, perm):
    out = [shape[p] for p in perm] if sorted(perm) == list(range(len(shape))) else shape
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=perm, name="tr")], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("shape,perm,moves", [((4, 12, 1, 64), (0, 2, 1, 3), False),
                                              ((1, 5, 7), (1, 0, 2), False),
                                              ((4, 12, 2, 64), (0, 2, 1, 3), True),
                                              ((1, 5, 7), (0, 2, 1), True)])
def test_unit_axis_moves_become_reshapes(shape, perm, moves):
    graph = import_model(_model(shape, perm))
    kinds = {type(n.op) for n in graph.nodes}
    assert (B.Transpose in kinds) == moves
    assert graph.outputs[0].shape == tuple(shape[p] for p in perm)


def test_bad_perm_names_the_node():
    with pytest.raises(PowerFusionError) as e:   # onnx shape inference or the converter
        import_model(_model((2, 3), (0, 0)))
    assert "tr" in str(e.value) and "Transpose" in str(e.value)
