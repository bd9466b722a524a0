"""A/B of frontend/layout.py on zoo models (device only): the CUDA session as built, and built
with the channels-last rewrite switched off (every conv on NCHW: 1x1 convs timed cuDNN against
im2col + cuBLAS, depthwise convs GIR templates, no transposes around them).

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/diag/layout_ab.py efficientnet_b0:8:fp16 ...

Device time: back-to-back CUDA-graph replays (bench_models.graph_replay_times), median.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(cases: list[str]) -> None:
    import zoo_models
    from bench_models import graph_replay_times
    from powerfusion import InferenceSession
    from powerfusion.frontend import layout
    exports = ROOT / "build" / "zoo-onnx"
    exports.mkdir(parents=True, exist_ok=True)
    keep = layout.to_channels_last
    for case in cases:
        name, batch, dtype = case.split(":")
        path = exports / zoo_models.export_name(name, int(batch), dtype)
        if not path.exists():
            zoo_models.export(zoo_models.build(name, int(batch), dtype), path, dtype)
        built = None
        for label, fn in (("channels-last", keep), ("nchw", lambda graph: 0)):
            layout.to_channels_last = fn
            built = zoo_models.build(name, int(batch), dtype) if label == "channels-last" else built
            sess = InferenceSession(str(path), target="cuda", options={"cuda_graph": True})
            sess.run(None, {n: a.detach().cpu().numpy() for n, a in zip(built.names, built.args)})   # captures
            t = statistics.median(graph_replay_times(sess))
            plan = sess._executor.plan
            kernels = sum(len(s.kernels) for s in plan.kernel_steps)
            print(f"{case:28s} {label:14s} {t * 1e6:8.1f} us  {kernels} kernels  {len(plan.library_steps)} library",
                  flush=True)
    layout.to_channels_last = keep


if __name__ == "__main__":
    main(sys.argv[1:])
