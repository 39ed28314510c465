"""`pydtnn-perfmodel`: the performance model from the command line, one subcommand per question.

  collective  seconds of one collective operation (allreduce, allgather, ...) by algorithm

Each subcommand is an add_<name>(subparsers) that declares its flags and a run_<name>(args) that
returns the exit code. Exit codes: 0 success, 2 user error (one line `pydtnn-perfmodel: error: ...`).
"""

import argparse
import json
import math
import sys

from pydtnn.errors import PydtnnError

PROG = "pydtnn-perfmodel"


def byte_count(text):
    """argparse type: a number of bytes, as an integer or in exponent form (8000000, 8e6)."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        value = int(value) if math.isfinite(value) and value.is_integer() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes >= 0 (8000000 or 8e6), got {text!r}")
    return value


def machine_from(args):
    """The Machine named by --machine, or the built-in default."""
    from pydtnn.perfmodel import machine

    return machine.DEFAULT if args.machine is None else machine.load(args.machine)


def add_collective(subparsers):
    from pydtnn.cli import positive_int
    from pydtnn.perfmodel.collectives import ALGORITHMS, OPS
    from pydtnn.perfmodel.machine import LEVELS

    p = subparsers.add_parser("collective", allow_abbrev=False, help="seconds of one collective operation",
                              description="Seconds of one collective operation under the alpha-beta-gamma model.")
    p.add_argument("--op", required=True, choices=OPS, help="the operation")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS, help="the algorithm that runs it")
    p.add_argument("--bytes", required=True, type=byte_count, dest="nbytes",
                   help="bytes of the whole vector (allgather: the gathered result)")
    p.add_argument("--np", required=True, type=positive_int, help="number of processes")
    p.add_argument("--machine", help="machine description, YAML or JSON (default: built-in 2-core VM values)")
    p.add_argument("--level", choices=LEVELS,
                   help="link of a flat algorithm (default: intra if --np fits on one node, else inter)")
    p.add_argument("--inner", default="ring", help="inter-node algorithm of --algorithm hierarchical (default ring)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    p.set_defaults(run=run_collective)


def run_collective(args):
    from pydtnn.perfmodel.collectives import HIERARCHICAL, default_level, seconds

    machine = machine_from(args)
    cost = seconds(args.op, args.algorithm, args.nbytes, args.np, machine, level=args.level, inner=args.inner)
    if args.json:
        print(json.dumps({"seconds": cost, "op": args.op, "algorithm": args.algorithm, "bytes": args.nbytes,
                          "np": args.np}))
    else:
        if args.algorithm == HIERARCHICAL:
            how = f"inner {args.inner}, {machine.processes_per_node} per node"
        else:
            how = f"{args.level or default_level(args.np, machine)} link"
        print(f"{args.op} {args.algorithm}: {args.nbytes:,} bytes over {args.np} processes ({how}) on "
              f"{machine.name}: {cost * 1e3:.6g} ms")
    return 0


def build_parser():
    from pydtnn.cli import Parser

    parser = Parser(prog=PROG, allow_abbrev=False,
                    description="The pydtnn performance model: predicted costs of collectives and training steps.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_collective(subparsers)
    return parser


def main(argv=None):
    """`pydtnn-perfmodel`: the subcommand's exit code; 2 and one line on a user error."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except PydtnnError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
