"""`powerfusion run MODEL`: run a model (seeded random inputs unless given) and summarise its outputs."""
from __future__ import annotations

import os

import numpy as np

from powerfusion.cli.common import (Timer, add_fp32_matmul_argument, add_model_arguments, load_or_make_inputs,
                                    make_session, progress, summarize)

HELP = "run a model on given or seeded random inputs and print output summaries"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--inputs", help=".npz file with one array per model input (default: seeded random)")
    p.add_argument("--output", help="write the outputs to this .npz file")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--fallback", choices=("onnxruntime",),
                   help="run nodes PowerFusion does not support through onnxruntime on the CPU (cpu target; "
                        "a warning names them)")
    add_fp32_matmul_argument(p)


def main(args) -> int:
    sess = make_session(args)
    feeds = load_or_make_inputs(sess, args.inputs, args.seed)
    if not args.inputs:
        progress(f"random inputs, seed {args.seed}")
    with Timer() as t:
        outputs = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    print(f"{args.model} on {sess.target}: {len(names)} output(s) in {t.seconds * 1e3:.1f} ms")
    for name, value in zip(names, outputs):
        print("  " + summarize(name, value))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        np.savez(args.output, **dict(zip(names, outputs)))
        progress(f"outputs written to {args.output}")
    return 0
