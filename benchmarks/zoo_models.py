"""The model zoo of bench_zoo.py: torchvision and transformers architectures with random weights
(nothing is downloaded), built as torch modules on the GPU and exported to ONNX there.

Weights: seeded random; parameters that default to a constant (zero biases, unit norm scales,
ViT's zero-initialised head) get small noise (models.weights.perturb_uniform_parameters), and
BatchNorm statistics come from a few random batches (models.weights.calibrate_batchnorm), so a
deep random network's output is neither zero nor vanishingly small and a relative error means
something. Transformers: the base models (hidden states, no LM head), SEQ tokens, built from a
config (`use_cache=False`) and wrapped so `forward` returns one plain tensor.

Export: the TorchScript exporter at opset 17 first, the dynamo exporter at opset 18 where it
fails (GPT-2, the LLaMA-style decoder and torchvision's ViT, whose ops it does not know), both
as torch exports them: no folding or clean-up of ours. fp16 is the module in `.half()`,
exported so ("fp16 as exported by torch").
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

IMAGE = (3, 224, 224)
SEQ = 128
TORCHVISION = ("resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit_b_16",
               "swin_t")
TRANSFORMERS = ("bert_base", "gpt2", "llama")
MODELS = TORCHVISION + TRANSFORMERS
# the CPU latency set (bench_cpu_latency.py): the GPU zoo's CNNs and transformers less Swin and
# the LLaMA-style decoder, plus MobileNetV2 and DenseNet-121
CPU_SET = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "densenet121",
           "convnext_tiny", "vit_b_16", "bert_base", "gpt2")


@dataclass
class Built:
    module: object          # torch.nn.Module on the device, eval mode, in the row's dtype
    args: tuple             # torch tensors on the device
    names: list[str]        # ONNX input names


def build(name: str, batch: int, dtype: str, device: str = "cuda") -> Built:
    """The module and its inputs for one row (module in `dtype`; token ids stay int64); any
    torchvision classifier by name, or one of TRANSFORMERS."""
    import torch
    from models.weights import calibrate_batchnorm, perturb_uniform_parameters
    torch.manual_seed(0)
    if name not in TRANSFORMERS:
        module = _torchvision(name)
        perturb_uniform_parameters(module)
        calibrate_batchnorm(module, torch.randn(4, *IMAGE))
        x = torch.randn(batch, *IMAGE, generator=torch.Generator().manual_seed(2))
        args, names = (x,), ["image"]
    else:
        module, vocab = _transformers(name)
        perturb_uniform_parameters(module)
        ids = torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(2))
        args, names = (ids,), ["input_ids"]
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    module = module.eval().to(device, torch_dtype)
    args = tuple(a.to(device, torch_dtype) if a.is_floating_point() else a.to(device) for a in args)
    return Built(module, args, names)


def _torchvision(name: str):
    import torchvision
    return getattr(torchvision.models, name)(weights=None)


def _hidden_states(model):
    """A module whose forward(input_ids) returns the last hidden state as one tensor (exporters
    want plain tensor outputs)."""
    import torch

    class HiddenStates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]
    return HiddenStates()


def _transformers(name: str):
    """(module, vocabulary size): BERT-base and GPT-2 (124M) at their default configs; a
    LLaMA-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) of four
    layers at hidden size 1024."""
    import transformers as tf
    if name == "bert_base":
        config = tf.BertConfig()
        model = tf.BertModel(config, add_pooling_layer=False)
    elif name == "gpt2":
        config = tf.GPT2Config()
        model = tf.GPT2Model(config)
    elif name == "llama":
        config = tf.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                max_position_embeddings=2048)
        model = tf.LlamaModel(config)
    else:
        raise ValueError(f"unknown transformers model {name!r}")
    config.use_cache = False
    return _hidden_states(model.eval()), config.vocab_size


def export(built: Built, path: Path, dtype: str = "fp32") -> str:
    """Writes `path`; returns the exporter that worked (raises with both errors if neither).
    fp16: a TorchScript export whose MatMuls / Gemms compute in fp32 is not an fp16 model (torch
    2.11's TorchScript exporter does that to BERT-base in `.half()`: 92 of 96 MatMuls, see
    benchmarks/diag/onnx_dtypes.py); the dynamo exporter (torch's default since 2.9) is used then."""
    import torch
    if path.exists():
        return "cached"
    tmp = path.with_suffix(".part")
    try:
        with torch.no_grad():
            torch.onnx.export(built.module, built.args, str(tmp), dynamo=False, opset_version=17,
                              input_names=built.names)
        if dtype == "fp16" and (islands := fp32_matmuls(tmp)):
            raise RuntimeError(f"{islands} MatMul / Gemm nodes compute in fp32 in the fp16 export")
        os.replace(tmp, path)
        return "torchscript opset 17"
    except Exception as first:
        try:
            with torch.no_grad():
                program = torch.onnx.export(built.module, built.args, dynamo=True, opset_version=18,
                                            input_names=built.names, external_data=False)
            program.save(str(tmp))
            os.replace(tmp, path)
            return f"dynamo opset 18 (torchscript: {one_line(first)[:120]})"
        except Exception as second:
            raise RuntimeError(f"torchscript exporter: {one_line(first)}; dynamo exporter: {one_line(second)}") from None


def fp32_matmuls(path) -> int:
    """How many MatMul / Gemm nodes of an ONNX file have an fp32 first input (shape inference)."""
    import onnx
    from onnx import shape_inference
    m = shape_inference.infer_shapes(onnx.load(str(path)))
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input)}
    types.update({i.name: i.data_type for i in m.graph.initializer})
    return sum(1 for n in m.graph.node if n.op_type in ("MatMul", "Gemm") and n.input
               and types.get(n.input[0]) == onnx.TensorProto.FLOAT)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    if not text:
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        text = type(e).__name__ + (f" at {Path(where.filename).name}:{where.lineno}" if where else "")
    return f"{type(e).__name__}: {text}"[:limit]


def main(argv=None) -> int:
    """Exports models on the CPU (fp32) into a folder, for runtimes that read ONNX only:
    `python benchmarks/zoo_models.py OUT_DIR [--batch 1] [name ...]` (default: CPU_SET), with a
    python that has torch, torchvision and transformers. Prints one line per model."""
    import argparse
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names or CPU_SET:
        path = args.out / export_name(name, args.batch, "fp32")
        try:
            how = "cached" if path.exists() else export(build(name, args.batch, "fp32", device="cpu"), path)
            print(f"{name}: {how} -> {path}", flush=True)
        except Exception as e:
            failed += 1
            print(f"{name}: FAILED {one_line(e)}", flush=True)
    return 1 if failed else 0


def export_name(name: str, batch: int, dtype: str) -> str:
    return f"{name}_b{batch}_{dtype}.onnx"


if __name__ == "__main__":
    raise SystemExit(main())
