"""Importing this package fills the lowering table (one module per op family)."""
from . import registry  # noqa: F401
from . import factories, foreach, indexing, linalg, nn, pointwise, reductions, shape  # noqa: F401
