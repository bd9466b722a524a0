"""Sweep: torchvision's classification models and a few transformers models, exported with
random weights, each run on a CPU `InferenceSession` (default target) and compared with
onnxruntime. The question it answers: does every exported model the frontend accepts run on
the CPU session without a crash, and agree?

    python benchmarks/model_sweep.py export --out DIR [--only NAME ...] [--all]   # needs torch,
        torchvision, transformers (the `bench` extra); writes DIR/NAME.onnx + DIR/NAME.npz
        (NAME@dynamo: NAME exported by the dynamo exporter alone)
    python benchmarks/model_sweep.py check --models DIR [--only NAME ...] [--merge] [--timeout-s 600]
        [--max-rss-gib 12]   # the project's environment; writes benchmarks/results/model-sweep.{json,md}
        (`--merge` keeps the rows of models not checked now, each with the date and commit it ran at)

A model at a time (`export --only NAME`, `check --only NAME --merge`, delete the export) keeps
one large export on disk and in memory at once: the way to sweep the largest variants on a small
machine.

torchvision weights: constant parameters perturbed, BatchNorm statistics calibrated on random
batches (models/weights.py), so outputs vary. Export is split from the check so the check runs where PowerFusion is installed and the export
where torch is. Export as `models/export_zoo.py` does: the TorchScript exporter at opset 17, the
dynamo exporter where it fails, nothing folded or cleaned up. Each model's check runs in its own
process with a time limit, so a crash, a memory blow-up or a hang is recorded against that
model and the sweep goes on.

Verdict per model: `pass` (ran; max |ours - ort| / max |ort| < REL_TOL per output, float64
arithmetic on float32 outputs), `refused` (the frontend or session raised a PowerFusionError
naming what it does not support -- "accepts" in the question above excludes these), `mismatch`,
`no reference` (onnxruntime failed on the export -- the exporter's fault -- and ours built and
ran: the row says so, with onnxruntime's error), `crash` (any other exception, a killed process, the time limit or the memory limit: the
child's resident memory is polled and the child killed above `--max-rss-gib`, so one model
cannot take a shared machine's memory; each row records the child's peak resident memory).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# max |ours - onnxruntime| / max |onnxruntime| per output, float32 models of 10-200 layers
# with random weights: summation order differs (fused reductions, im2col GEMMs), 1e-3 leaves
# room for that and catches any wrong op (those give O(1)).
REL_TOL = 1e-3
# One representative per torchvision family, the variants whose graphs differ (squeezenet 1.0 /
# 1.1 pooling, mobilenet v3 small / large, efficientnet v1 / v2, regnet x / y, vgg with and
# without BatchNorm, swin v1 / v2), and the family's other sizes up to ~90M parameters (the rest
# add depth or width, and minutes of export and build on a shared 2-core machine). `--all` takes
# every classification model torchvision lists.
TORCHVISION = ("alexnet", "convnext_tiny", "convnext_small", "densenet121", "densenet169", "efficientnet_b0",
               "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_v2_s", "googlenet",
               "inception_v3", "maxvit_t", "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
               "mobilenet_v3_small", "mobilenet_v3_large", "regnet_x_400mf", "regnet_x_800mf", "regnet_x_1_6gf",
               "regnet_y_400mf", "regnet_y_800mf", "regnet_y_1_6gf", "resnet18", "resnet34", "resnet50",
               "resnet101", "resnext50_32x4d", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5",
               "shufflenet_v2_x2_0", "squeezenet1_0", "squeezenet1_1", "swin_t", "swin_s", "swin_v2_t", "vgg11",
               "vgg11_bn", "vgg13_bn", "vit_b_16", "vit_b_32", "wide_resnet50_2")
TRANSFORMERS = ("bert", "gpt2", "distilbert", "llama", "vit_hf", "roberta", "t5_small_encoder",
                "whisper_tiny_encoder", "albert", "electra", "deberta_v2", "bart", "qwen2")
IMAGE = (1, 3, 224, 224)
DYNAMO = "@dynamo"   # NAME@dynamo: NAME exported by the dynamo exporter, not the TorchScript one
SEQ = 64


# ---- export (torch environment) -------------------------------------------------------------

def _torchvision(name: str):
    """Random weights as benchmarks/zoo_models.py sets them: constant parameters (zero biases,
    ViT's zero head) perturbed and BatchNorm statistics from random batches, so the output is
    neither zero nor constant and a relative error means something. Segmentation models give
    their "out" map, video models take 16 frames at their weights' crop size, RAFT two images
    stacked in one input at its 128x128 minimum and gives its last flow estimate."""
    import torch
    import torchvision
    from models.weights import calibrate_batchnorm, perturb_uniform_parameters
    torch.manual_seed(0)
    model, shape, calibration = _torchvision_model(torchvision.models, name)
    perturb_uniform_parameters(model)
    calibrate_batchnorm(model, torch.randn(calibration, *shape[1:]))
    return model.eval(), (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),), ["image"]


def _torchvision_model(tv, name: str):
    """(model, input shape, calibration batch) of a torchvision model by family."""
    if name in tv.list_models(module=tv.segmentation):
        model = getattr(tv.segmentation, name)(weights=None, weights_backbone=None)
        return _wrapped(model, lambda m, x: m(x)["out"]), IMAGE, 4
    if name in tv.list_models(module=tv.video):
        side = 112 if name in ("r3d_18", "mc3_18", "r2plus1d_18") else 224
        return getattr(tv.video, name)(weights=None), (1, 3, 16, side, side), 2
    if name in tv.list_models(module=tv.optical_flow):
        model = getattr(tv.optical_flow, name)(weights=None)
        return _wrapped(model, lambda m, x: m(x[0:1], x[1:2])[-1]), (2, 3, 128, 128), 2
    kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    return getattr(tv, name)(weights=None, **kwargs), IMAGE, 4


def _wrapped(model, forward):
    """`model` behind a module whose forward(x) is forward(model, x): one plain tensor in and
    out, as exporters want (a segmentation model's dict, RAFT's two images and list of flows)."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return forward(self.model, x)
    return Wrapped()


def _first_output(model, kw: str):
    """`model` wrapped so forward(x) returns one plain tensor (the last hidden state): exporters
    want plain tensor outputs."""
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(**{kw: x}, return_dict=False)[0]
    return FirstOutput().eval()


_SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512}


def _text_models(tf) -> dict:
    """name -> (builder of a model taking input_ids, vocabulary size): small configurations
    (2 layers, hidden 128) of each architecture; the T5 encoder at t5-small's own size."""
    return {
        "bert": (lambda: tf.BertModel(tf.BertConfig(**_SMALL)), 30522),
        "gpt2": (lambda: tf.GPT2Model(tf.GPT2Config(n_layer=2, n_embd=128, n_head=2, use_cache=False)), 50257),
        "distilbert": (lambda: tf.DistilBertModel(tf.DistilBertConfig(n_layers=2, dim=128, n_heads=2,
                                                                       hidden_dim=512)), 30522),
        "llama": (lambda: tf.LlamaModel(tf.LlamaConfig(num_key_value_heads=1, vocab_size=1000, use_cache=False,
                                                       **_SMALL)), 1000),
        "roberta": (lambda: tf.RobertaModel(tf.RobertaConfig(**_SMALL), add_pooling_layer=False), 50265),
        "t5_small_encoder": (lambda: tf.T5EncoderModel(tf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                                                                   num_heads=8, vocab_size=32128)), 32128),
        "albert": (lambda: tf.AlbertModel(tf.AlbertConfig(embedding_size=64, **_SMALL), add_pooling_layer=False),
                   30000),
        "electra": (lambda: tf.ElectraModel(tf.ElectraConfig(embedding_size=64, **_SMALL)), 30522),
        "deberta_v2": (lambda: tf.DebertaV2Model(tf.DebertaV2Config(vocab_size=1000, **_SMALL)), 1000),
        "bart": (lambda: tf.BartModel(tf.BartConfig(vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2,
                                                    encoder_attention_heads=2, decoder_attention_heads=2,
                                                    encoder_ffn_dim=512, decoder_ffn_dim=512, use_cache=False)), 1000),
        "qwen2": (lambda: tf.Qwen2Model(tf.Qwen2Config(num_key_value_heads=1, vocab_size=1000, use_cache=False,
                                                       **_SMALL)), 1000),
    }


def _transformers(name: str):
    """Random weights. Text models from `_text_models`; ViT small at 64x64; the Whisper encoder at
    whisper-tiny's size (it takes only its full 3000-frame log-mel input)."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    if name == "whisper_tiny_encoder":
        config = tf.WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                                  decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536, num_mel_bins=80)
        model = tf.WhisperModel(config).get_encoder()
        x = torch.randn(1, 80, 2 * config.max_source_positions, generator=torch.Generator().manual_seed(1))
        return _first_output(model.eval(), "input_features"), (x,), ["input_features"]
    if name == "vit_hf":
        model = tf.ViTModel(tf.ViTConfig(image_size=64, patch_size=16, **_SMALL), add_pooling_layer=False)
        x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
        return _first_output(model.eval(), "pixel_values"), (x,), ["pixel_values"]
    builders = _text_models(tf)
    if name not in builders:
        raise ValueError(f"unknown transformers model {name!r}")
    build, vocab = builders[name]
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))
    return _first_output(build().eval(), "input_ids"), (ids,), ["input_ids"]


def export_all(out: Path, names: list[str]) -> None:
    import torch
    sys.path.insert(0, str(ROOT))
    from models.export_zoo import export
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = out / f"{name}.onnx"
        start = time.perf_counter()
        try:
            base, dynamo = (name[: -len(DYNAMO)], True) if name.endswith(DYNAMO) else (name, False)
            model, args, inputs = (_transformers if base in TRANSFORMERS else _torchvision)(base)
            meta = out / f"{name}.export.json"
            if path.exists() and meta.exists():   # exported before: keep what exported it
                how = json.loads(meta.read_text())["exporter"]
            else:
                with torch.no_grad():
                    how = _export_dynamo(model, args, inputs, path) if dynamo else export(model, args, inputs, path)
            np.savez(out / f"{name}.npz", **{n: a.numpy() for n, a in zip(inputs, args)})
        except Exception as e:   # recorded; the check reports the model as not exported
            how = f"failed: {' '.join(str(e).split())[:300]}"
            path.unlink(missing_ok=True)
        (out / f"{name}.export.json").write_text(json.dumps({"exporter": how}))
        print(f"{name}: {how} ({time.perf_counter() - start:.0f} s)", flush=True)


def _export_dynamo(model, args, inputs, path: Path) -> str:
    """The dynamo exporter alone (its default opset), for NAME@dynamo: its graphs differ from
    the TorchScript exporter's (decomposed ops, another opset)."""
    import torch
    torch.onnx.export(model, args, dynamo=True, input_names=inputs).save(str(path))
    return "dynamo (forced)"


# ---- check (PowerFusion environment) --------------------------------------------------------

def check_one(model: Path) -> dict:
    """Runs in a child process: onnxruntime, then a CPU InferenceSession, then the comparison."""
    import onnxruntime as ort
    from powerfusion import InferenceSession
    from powerfusion.errors import PowerFusionError
    feeds = dict(np.load(model.with_suffix(".npz")))
    row = {"model": model.stem}
    try:
        sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        want = sess.run(None, feeds)
        del sess   # its weights, before ours load: the largest models hold gigabytes
    except Exception as e:   # onnxruntime refuses the export itself: ours still must not crash
        want, row["reference"] = None, f"onnxruntime failed: {_line(e)}"
    row["ort_peak_rss_gib"] = _peak_rss_gib()
    stage = "build"
    try:
        start = time.perf_counter()
        ours = InferenceSession(str(model))
        row["build_s"] = round(time.perf_counter() - start, 2)
        stage = "run"
        start = time.perf_counter()
        got = ours.run(None, feeds)
        row["run_s"] = round(time.perf_counter() - start, 2)
    except PowerFusionError as e:
        return {**row, "verdict": "refused", "stage": stage, "detail": f"{type(e).__name__}: {_line(e)}",
                "peak_rss_gib": _peak_rss_gib()}
    row["peak_rss_gib"] = _peak_rss_gib()
    if want is None:
        return {**row, "verdict": "no reference", "stage": "compare", "detail": row.pop("reference")}
    errors = [_relative_error(g, w) for g, w in zip(got, want)]
    row["rel_error"] = max(errors) if errors else 0.0
    row["output_std"] = float(np.std(np.asarray(want[0], np.float64))) if want and want[0].size else 0.0
    bad = len(got) != len(want) or not all(e < REL_TOL for e in errors)
    return {**row, "verdict": "mismatch" if bad else "pass", "stage": "compare" if bad else "", "detail": ""}


def _peak_rss_gib() -> float:
    import resource
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)   # kB on Linux


def _relative_error(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    if want.size == 0:
        return 0.0
    scale = float(np.max(np.abs(want.astype(np.float64)))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - want))) / scale


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def check_all(models: Path, timeout_s: float, max_rss_gib: float, only: list[str] | None = None) -> list[dict]:
    rows = []
    for meta in sorted(models.glob("*.export.json")):
        name = meta.name[: -len(".export.json")]
        if only and name not in only:
            continue
        exporter = json.loads(meta.read_text())["exporter"]
        if exporter.startswith("failed"):
            rows.append({"model": name, "exporter": exporter, "verdict": "not exported", "stage": "export",
                         "detail": exporter[len("failed: "):]})
            continue
        rows.append({**_check_in_child(models / f"{name}.onnx", timeout_s, max_rss_gib), "exporter": exporter})
        r = rows[-1]
        print(f"{name}: {r['verdict']} {r.get('stage', '')} {r.get('detail', '')} ({r['seconds']} s)", flush=True)
    return rows


def _check_in_child(model: Path, timeout_s: float, max_rss_gib: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "check-one", str(model)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    killed = ""
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if time.perf_counter() - start > timeout_s:
                killed = f"timeout: over {timeout_s:.0f} s"
            elif _rss_gib(proc.pid) > max_rss_gib:
                killed = f"memory: resident memory over {max_rss_gib:g} GiB"
            if killed:
                proc.kill()
                out, err = proc.communicate()
                break
    seconds = round(time.perf_counter() - start, 1)
    if killed:
        stage, detail = killed.split(": ", 1)
        return {"model": model.stem, "verdict": "crash", "stage": stage, "detail": detail, "seconds": seconds}
    last = out.strip().splitlines()[-1:] if proc.returncode == 0 else []
    if last and last[0].startswith("{"):
        return {**json.loads(last[0]), "seconds": seconds}
    tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return {"model": model.stem, "verdict": "crash", "stage": "process", "detail": tail[0][:300], "seconds": seconds}


def _rss_gib(pid: int) -> float:
    """The process's resident memory now (0 once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip() or "unknown"


def write(rows: list[dict], seconds: float, cache: str, merge: bool) -> None:
    """Writes the results; with `merge`, rows of models not checked in this run stay as they
    were, each keeping the date and commit of the run that produced it."""
    run = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": _commit(), "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)",
           "total_s": round(seconds, 1), "plan_cache_at_start": cache, "models_checked": len(rows)}
    rows = [{**r, "date": run["date"], "commit": run["commit"]} for r in rows]
    runs = [run]
    path = RESULTS / "model-sweep.json"
    if merge and path.exists():
        earlier_rows, earlier_runs = _earlier(json.loads(path.read_text()))
        checked = {r["model"] for r in rows}
        rows += [r for r in earlier_rows if r["model"] not in checked]
        runs = _fold(earlier_runs, run)
    rows.sort(key=lambda r: r["model"])
    path.write_text(json.dumps({"rel_tol": REL_TOL, "runs": runs, "models": rows}, indent=2) + "\n")
    (RESULTS / "model-sweep.md").write_text(_markdown(rows, runs))


def _fold(runs: list[dict], run: dict) -> list[dict]:
    """`runs` + `run`, a run at the last run's commit and machine counted into it (a sweep of one
    model at a time is one run)."""
    last = runs[-1] if runs else {}
    if (last.get("commit"), last.get("machine")) != (run["commit"], run["machine"]):
        return [*runs, run]
    merged = {**last, "date": run["date"], "total_s": round(last["total_s"] + run["total_s"], 1),
              "models_checked": last["models_checked"] + run["models_checked"]}
    return [*runs[:-1], merged]


def _earlier(meta: dict) -> tuple[list[dict], list[dict]]:
    """Rows and runs of an earlier results file, including the one-run layout that kept the
    run's date and commit at the top level only."""
    if "runs" in meta:
        return meta["models"], meta["runs"]
    run = {k: v for k, v in meta.items() if k not in ("models", "rel_tol")}
    run["models_checked"] = len(meta["models"])
    return [{"date": run["date"], "commit": run["commit"], **r} for r in meta["models"]], [run]


def _markdown(rows: list[dict], runs: list[dict]) -> str:
    verdicts = ("pass", "refused", "mismatch", "crash", "no reference", "not exported")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in verdicts}
    lines = ["# Exported-model sweep on the CPU session", "",
             ("`benchmarks/model_sweep.py`. torchvision classification models and transformers models (random weights, "
             "exported by torch), `InferenceSession(model)` (default cpu target) against onnxruntime "
             f"(CPU). pass: max |ours - ort| / max |ort| < {REL_TOL:g} per output; output std: of onnxruntime's "
             "first output (a constant output would make the comparison empty). seconds: the whole "
             "check of one model (onnxruntime, build, run) in its own process; peak GiB: that process's "
             "peak resident memory (onnxruntime's session is freed before ours is built). Runs:"), ""]
    lines += [f"- {r['date']}, commit {r['commit']}, {r['machine']}: {r['models_checked']} models, "
              f"{r['total_s']} s, plan cache {r['plan_cache_at_start']} at the start" for r in runs]
    lines += ["", "  ".join(f"{k}: {v}" for k, v in counts.items()), "",
              "| model | exporter | verdict | rel. error | output std | build s | run s | seconds | peak GiB | commit | detail |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        err = f"{r['rel_error']:.1e}" if "rel_error" in r else ""
        detail = (r.get("stage", "") + ": " + r.get("detail", "")).strip(": ").replace("|", "/")
        std = f"{r['output_std']:.2g}" if "output_std" in r else ""
        lines.append(f"| {r['model']} | {r.get('exporter', '')} | {r['verdict']} | {err} | {std} | {r.get('build_s', '')} | "
                     f"{r.get('run_s', '')} | {r.get('seconds', '')} | {r.get('peak_rss_gib', '')} | {r.get('commit', '')} | "
                     f"{detail[:200]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--only", nargs="*")
    e.add_argument("--all", action="store_true", help="every torchvision classification model")
    c = sub.add_parser("check")
    c.add_argument("--models", type=Path, required=True)
    c.add_argument("--timeout-s", type=float, default=600)
    c.add_argument("--max-rss-gib", type=float, default=12.0, help="kill a model's check above this resident memory")
    c.add_argument("--only", nargs="*", help="check these models of --models only")
    c.add_argument("--merge", action="store_true", help="keep the earlier rows of models not checked now")
    one = sub.add_parser("check-one")
    one.add_argument("model", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "export":
        if args.only:
            names = args.only
        elif args.all:
            import torchvision
            names = torchvision.models.list_models(module=torchvision.models) + list(TRANSFORMERS)
        else:
            names = list(TORCHVISION) + list(TRANSFORMERS)
        export_all(args.out, names)
        return 0
    if args.cmd == "check-one":
        print(json.dumps(check_one(args.model)))
        return 0
    from powerfusion import options
    cache = options.current().cache_dir
    cold = not cache.exists() or not any(cache.iterdir())
    start = time.perf_counter()
    rows = check_all(args.models, args.timeout_s, args.max_rss_gib, args.only)
    write(rows, time.perf_counter() - start, "empty" if cold else "holding earlier plans", args.merge)
    print((RESULTS / "model-sweep.md").read_text())
    return 0 if all(r["verdict"] in ("pass", "refused", "no reference") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
