"""Diagnose test_maxpool_2d_uint8 on CUDA: got vs expected."""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.conformance.node_cases import all_cases
import powerfusion as pf
c = all_cases()["test_maxpool_2d_uint8"]
for inputs, outputs in c.data_sets:
    feeds = dict(zip([i.name for i in c.model.graph.input], inputs))
    s = pf.InferenceSession(c.model, target="cuda")
    got = s.run(None, feeds)[0]
    print("x", inputs[0].reshape(5, 5).tolist())
    print("got", got.reshape(5, 5).tolist())
    print("want", outputs[0].reshape(5, 5).tolist())
    for k in s._executor.plan.kernel_steps:
        for ks in k.kernels:
            print(ks.source[ks.source.index("extern"):][:3000])
