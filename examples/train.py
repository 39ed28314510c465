"""Train a model from the command line; the same program as `pydtnn-train` (see --help).

    python examples/train.py --model simplecnn --num_epochs 5
    mpirun -np 2 python examples/train.py --model simplecnn
"""

import sys

from pydtnn.cli import main

if __name__ == "__main__":
    sys.exit(main())
