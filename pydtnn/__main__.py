"""`python -m pydtnn`: the same program as `pydtnn-train`."""

import sys

from pydtnn.cli import main

sys.exit(main())
