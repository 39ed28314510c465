"""pydtnn: deep neural network training with NumPy (CPU) or CuPy (GPU), on one process or many.

Importing pydtnn imports NumPy and nothing heavier: no CuPy, no MPI.
"""

__version__ = "0.1.0"
