"""`powerfusion bench MODEL`: latency percentiles, throughput and a per-step profile, in
trtexec's manner (warm-up, then at least --iterations runs and --duration seconds)."""
from __future__ import annotations

from powerfusion.cli.common import add_fp32_matmul_argument, add_model_arguments, load_or_make_inputs, make_session, progress

HELP = "benchmark a model: latency percentiles, device time, throughput, per-step profile"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--inputs", help=".npz file with one array per model input (default: seeded random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--warmup", type=float, default=200, metavar="MS", help="warm-up time in ms (default 200)")
    p.add_argument("--iterations", type=int, default=10, metavar="N", help="at least N timed runs (default 10)")
    p.add_argument("--duration", type=float, default=3, metavar="S", help="at least S seconds of timed runs (default 3)")
    p.add_argument("--profile", action="store_true", help="per-step table: time, share, bytes, fraction of copy bandwidth")
    p.add_argument("--export-json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--export-trace", metavar="FILE", help="write a Chrome trace (opens in Perfetto / chrome://tracing)")
    add_fp32_matmul_argument(p)


def main(args) -> int:
    from powerfusion.bench import BenchSettings, format_report, run_bench, write_json, write_trace
    from powerfusion.errors import PowerFusionError
    if args.iterations < 1 or args.duration < 0 or args.warmup < 0:
        raise PowerFusionError("bench: --iterations must be >= 1, --duration and --warmup >= 0")
    sess = make_session(args, session_options={"cuda_graph": True})
    feeds = load_or_make_inputs(sess, args.inputs, args.seed)
    settings = BenchSettings(args.warmup / 1e3, args.iterations, args.duration, args.profile)
    progress(f"warm-up {args.warmup:g} ms, then >= {args.iterations} runs and >= {args.duration:g} s")
    result = run_bench(sess, feeds, settings, model=args.model)
    print(format_report(result))
    if args.export_json:
        write_json(result, args.export_json)
        progress(f"results written to {args.export_json}")
    if args.export_trace:
        write_trace(result, args.export_trace)
        progress(f"trace written to {args.export_trace}")
    return 0
