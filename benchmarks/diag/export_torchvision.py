"""Export one torchvision model with random weights as models/export_zoo.py does (seed 0, the
TorchScript exporter at opset 17, input "image" 1x3x224x224) and save the input it was given.

    PYTHONPATH=$PWD python3 benchmarks/diag/export_torchvision.py swin_t OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import numpy as np
    from models.export_zoo import export, torchvision_model
    name, out = (argv or sys.argv[1:])[:2]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, args, names = torchvision_model(name)
    print(export(model, args, names, out / f"{name}.onnx"))
    np.savez(out / f"{name}_inputs.npz", **{n: a.numpy() for n, a in zip(names, args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
