"""The `powerfusion` command line.

Subcommands come from one table, name -> module; registering one is one line there.
The module either defines

    HELP = "one line for --help"
    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def main(args: argparse.Namespace) -> int: ...

or `register(subparsers)`, which adds its own parser(s) and sets `func(args) -> int`
through `set_defaults`. Modules listed there but not importable yet
(their owner has not written them) are left out of the parser, so the table may name
planned commands.

User errors (PowerFusionError, missing files) print one paragraph on stderr and exit
with status 2, without a traceback. Progress goes to stderr; results to stdout.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, str] = {
    "inspect": "powerfusion.cli.cmd_inspect",
    "run": "powerfusion.cli.cmd_run",
    "compare": "powerfusion.cli.cmd_compare",
    # planned; each line starts working once its module exists
    "compile": "powerfusion.cli.cmd_compile",
    "convert": "powerfusion.cli.cmd_convert",
    "quantize": "powerfusion.cli.cmd_quantize",
    "quantize-weights": "powerfusion.cli.cmd_quantize_weights",
    "bench": "powerfusion.cli.cmd_bench",
    "viz": "powerfusion.cli.cmd_viz",
    "cache": "powerfusion.cli.cmd_cache",
}

USER_ERROR = 2


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:  # the command's module is not written yet; anything else is a bug
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    from powerfusion import __version__
    parser = argparse.ArgumentParser(
        prog="powerfusion",
        description="Compile and run ONNX models: library calls for compute-bound ops, "
                    "fused kernels for memory-bound subgraphs.")
    parser.add_argument("--version", action="version", version=f"powerfusion {__version__}")
    _add_global_flags(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = _load(module_name)
        if module is None:
            continue
        if hasattr(module, "register"):
            module.register(sub)
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    for p in sub.choices.values():   # the global flags also after the subcommand: `powerfusion run M -v`
        _add_global_flags(p, default=argparse.SUPPRESS)
    return parser


def _add_global_flags(parser: argparse.ArgumentParser, default) -> None:
    """-v / -q / --cache-dir. On subcommands their default is SUPPRESS, so a flag given before
    the subcommand is not reset by the subcommand's parser."""
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more output on stderr (-v: steps with timings, -vv: subgraphs, search, cache)")
    parser.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress output")
    parser.add_argument("--cache-dir", default=default,
                        help="where compiled kernels are cached (default: ~/.cache/powerfusion)")


def main(argv: list[str] | None = None) -> int:
    from powerfusion import options
    from powerfusion.errors import PowerFusionError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return USER_ERROR
    verbose = 0 if args.quiet else max(options.current().verbose, 1 + (args.verbose or 0))
    changes = {"verbose": verbose}
    if args.cache_dir:
        changes["cache_dir"] = args.cache_dir
    try:
        with options.context(**changes):
            return int(args.func(args) or 0)
    except PowerFusionError as e:
        return _user_error(args.command, str(e))
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        return _user_error(args.command, f"{e.strerror}: '{e.filename}'")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `powerfusion bench M | head`: the reader left; not an error of ours
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _user_error(command: str, message: str) -> int:
    print(f"powerfusion {command}: error: {message}", file=sys.stderr)
    return USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
