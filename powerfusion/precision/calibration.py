"""Calibration data for static INT8 quantisation: one .npz array per model input, samples
stacked on a new leading axis (a model input [1, 3, 224, 224] takes an array [S, 1, 3, 224, 224]).
Where the model's input has a symbolic first (batch) dimension, an array of the input's own rank
is also accepted: each of its S rows is then one sample with batch 1.

Every way the data can be wrong gets a `CalibrationDataError` naming the file, the input and
both sides: not an .npz, unknown or missing input names, wrong rank / shape / dtype, no samples,
different sample counts, non-finite values.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import numpy as np
import onnx

from powerfusion.errors import PowerFusionError


class CalibrationDataError(PowerFusionError):
    """The calibration data does not fit the model."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    dims: tuple[int | None, ...]     # None: symbolic
    dtype: np.dtype


@dataclass(frozen=True)
class CalibrationData:
    """Validated samples: `samples[name][i]` is sample i of input `name`, shaped as the model wants."""
    arrays: dict[str, np.ndarray]
    count: int

    def sample(self, i: int) -> dict[str, np.ndarray]:
        return {name: a[i] for name, a in self.arrays.items()}


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))))
    return specs


def load_calibration(path: str, model: onnx.ModelProto) -> CalibrationData:
    """Read and check `path` against `model`'s inputs."""
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise CalibrationDataError(f"calibration data '{path}' is not an .npz file (np.savez writes one)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CalibrationDataError(f"calibration data '{path}' does not exist") from None
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise CalibrationDataError(f"calibration data '{path}' is not a readable .npz file ({e})") from None
    return check_calibration(arrays, model, where=f"calibration data '{path}'")


def check_calibration(arrays: dict[str, np.ndarray], model: onnx.ModelProto,
                      where: str = "calibration data") -> CalibrationData:
    specs = model_inputs(model)
    expected = {s.name for s in specs}
    unknown, missing = sorted(set(arrays) - expected), sorted(expected - set(arrays))
    if unknown or missing:
        raise CalibrationDataError(f"{where}: array names do not match the model's inputs: unknown {unknown}, "
                                   f"missing {missing}; the model's inputs are {sorted(expected)}")
    samples = {s.name: _samples(np.asarray(arrays[s.name]), s, where) for s in specs}
    counts = {name: len(a) for name, a in samples.items()}
    if len(set(counts.values())) > 1:
        raise CalibrationDataError(f"{where}: inputs have different sample counts {counts}")
    return CalibrationData(samples, next(iter(counts.values()), 0))


def _samples(a: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    rank = len(spec.dims)
    if a.dtype != spec.dtype:
        raise CalibrationDataError(f"{where}: input '{spec.name}' has dtype {a.dtype.name}; the model takes "
                                   f"{spec.dtype.name} (convert with .astype(np.{spec.dtype.name}))")
    if a.ndim == rank and rank and spec.dims[0] is None:
        a = a[:, None]                                 # rows of a batched array, each with batch 1
    if a.ndim != rank + 1:
        raise CalibrationDataError(f"{where}: input '{spec.name}' has shape {a.shape}; expected "
                                   f"[samples, {', '.join('?' if d is None else str(d) for d in spec.dims)}]")
    bad = [i for i, (got, want) in enumerate(zip(a.shape[1:], spec.dims)) if want is not None and got != want]
    if bad:
        raise CalibrationDataError(f"{where}: input '{spec.name}' samples have shape {a.shape[1:]}; the model "
                                   f"takes {_dims(spec.dims)} (axis {bad[0]} differs)")
    if len(a) == 0:
        raise CalibrationDataError(f"{where}: input '{spec.name}' holds no samples (its leading axis is 0)")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise CalibrationDataError(f"{where}: input '{spec.name}' contains NaN or infinite values")
    return a


def _dims(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"
