"""Importing this package fills the lowering table (one module per op family)."""
from .._core import registry  # noqa: F401  (the table the modules below fill)
from . import factories, foreach, indexing, linalg, pointwise, reductions, shape  # noqa: F401
from . import activations, ctc_loss, distances, embedding, losses, normalization, resampling  # noqa: F401
from . import amp, batch_norm, fused_optim, conv, factorizations, fft, pooling, special, view_scatter  # noqa: F401
from . import attention, flex_attention, gradients, grouped_mm, meta, polynomials, rnn  # noqa: F401
# Last: PyTorch decompositions fill in ops that have no hand-written lowering above.
from . import decomposed  # noqa: E402
decomposed.register_all()
from . import refusals  # noqa: E402,F401  (after every lowering exists)
