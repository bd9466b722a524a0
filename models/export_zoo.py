"""Export torchvision (and, where installed, transformers) models as a user would, and check
that PowerFusion imports them without help and matches onnxruntime.

    python3 -m models.export_zoo --out DIR [--only swin_t maxvit_t] [--targets cpu,cuda]

Each model gets random weights (nothing is downloaded) and is exported as it is, with no
folding or clean-up of ours: the TorchScript exporter at opset 17 first, the dynamo
exporter if that fails. Then onnxruntime (CPU) runs it, and a PowerFusion session per
target runs the same file; outputs must agree within max |pf - ort| / max |ort| < REL_TOL
(float32). A table of PASS / FAIL, with the stage that failed and why, ends the run; the
exit status is 1 if any model failed.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REL_TOL = 1e-3
IMAGE = (1, 3, 224, 224)
# swin_t (shape arithmetic: Mod, Range, ScatterND) and maxvit_t (Einsum) first, then a typical zoo
TORCHVISION = ("swin_t", "maxvit_t", "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny",
               "vit_b_16", "regnet_y_400mf", "densenet121", "shufflenet_v2_x1_0", "squeezenet1_0",
               "mnasnet0_5", "googlenet", "resnext50_32x4d", "wide_resnet50_2", "alexnet", "vgg11")
TRANSFORMERS = ("bert", "gpt2")


@dataclass
class Outcome:
    name: str
    status: str          # PASS | FAIL
    stage: str = ""      # build | export | onnxruntime | import (target) | run (target) | compare (target)
    detail: str = ""
    seconds: float = 0.0


def torchvision_model(name: str):
    import torch
    import torchvision
    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    return model, (torch.randn(*IMAGE),), ["image"]


def transformers_model(name: str):
    import torch
    import transformers
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                         intermediate_size=512)
        model = transformers.BertModel(config).eval()
    else:
        config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2)
        model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 64))
    return model, (ids,), ["input_ids"]


def export(model, args, names, path: Path) -> str:
    """Writes `path`; returns the exporter that worked."""
    import torch
    try:
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=names)
        return "torchscript opset 17"
    except Exception as first:
        try:
            program = torch.onnx.export(model, args, dynamo=True, input_names=names)
            program.save(str(path))
            return "dynamo"
        except Exception as second:
            raise RuntimeError(f"torchscript exporter: {_line(first)}; dynamo exporter: {_line(second)}") from None


def check_model(name: str, out: Path, targets: list[str]) -> Outcome:
    start = time.perf_counter()
    stage = "build"
    try:
        model, args, names = (transformers_model if name in TRANSFORMERS else torchvision_model)(name)
        stage = "export"
        path = out / f"{name}.onnx"
        export(model, args, names, path)
        feeds = {n: a.numpy() for n, a in zip(names, args)}
        stage = "onnxruntime"
        want = _run_onnxruntime(path, feeds)
        for target in targets:
            problem = _check_target(path, feeds, want, target)
            if problem:
                return Outcome(name, "FAIL", problem[0], problem[1], time.perf_counter() - start)
    except Exception as e:
        return Outcome(name, "FAIL", stage, _line(e), time.perf_counter() - start)
    return Outcome(name, "PASS", "", "", time.perf_counter() - start)


def _check_target(path: Path, feeds: dict, want: list, target: str) -> tuple[str, str] | None:
    from powerfusion.session import InferenceSession
    try:
        session = InferenceSession(str(path), target=target)
    except Exception as e:
        return f"import ({target})", _line(e)
    try:
        got = session.run(None, feeds)
    except Exception as e:
        return f"run ({target})", _line(e)
    for k, (g, w) in enumerate(zip(got, want)):
        scale = float(np.max(np.abs(w))) or 1.0
        err = float(np.max(np.abs(np.asarray(g, np.float64) - w))) / scale if w.size else 0.0
        if g.shape != w.shape or not err < REL_TOL:
            return f"compare ({target})", f"output {k}: shape {g.shape} vs {w.shape}, relative error {err:.2e}"
    return None


def _run_onnxruntime(path: Path, feeds: dict) -> list:
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [np.asarray(v, np.float64) for v in sess.run(None, feeds)]


def _line(e: Exception) -> str:
    text = " ".join(str(e).split())
    if not text:
        where = traceback.extract_tb(e.__traceback__)[-1]
        text = f"{type(e).__name__} at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
    return text[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the exported .onnx files")
    parser.add_argument("--only", nargs="*", help="model names (default: every torchvision model listed, "
                        "and bert / gpt2 where transformers is installed)")
    parser.add_argument("--targets", default="cpu", help="comma-separated PowerFusion targets (cpu, cuda, h100, ...)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(TORCHVISION) + [n for n in TRANSFORMERS if _has("transformers")]
    targets = [t for t in args.targets.split(",") if t]
    results = []
    for name in names:
        print(f"{name} ...", flush=True)
        results.append(check_model(name, out, targets))
        r = results[-1]
        print(f"  {r.status} {r.stage} {r.detail}".rstrip() + f" ({r.seconds:.0f} s)", flush=True)
    print(f"\n{'model':<22}{'result':<8}{'stage':<22}detail")
    for r in results:
        print(f"{r.name:<22}{r.status:<8}{r.stage:<22}{r.detail[:160]}")
    failed = [r.name for r in results if r.status != "PASS"]
    print(f"\n{len(results) - len(failed)} of {len(results)} passed on {', '.join(targets)}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
