"""Matrix factorizations and solvers (the linalg.* aten primitives XLA supports).

PyTorch conventions kept: LU pivots are 1-based int32 (LAPACK's), `info` outputs are LAPACK's
(XLA reports a failed factorization with NaNs or zero pivots instead of an error code: info is
read off the factors; PyTorch's _linalg_check_errors turns it into LinAlgError), and ops that
return factorizations for their backward (det, slogdet, solve) return PyTorch's LU layout."""
import functools

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import torch
from jax import lax

from .._core import runtime
from .._core.registry import HALF_TYPES, check, lowering
from .meta import dtype_name


def _info(a):
    return jnp.zeros(a.shape[:-2], jnp.int32)


def _first(bad):
    """LAPACK's info: the 1-based position of the first True along the last axis, else 0."""
    n = bad.shape[-1]
    if n == 0:
        return jnp.zeros(bad.shape[:-1], jnp.int32)
    pos = jnp.min(jnp.where(bad, jnp.arange(1, n + 1), n + 1), axis=-1)
    return jnp.where(pos > n, 0, pos).astype(jnp.int32)


def _cholesky_info(a):
    """The first k whose pivot of Gaussian elimination without pivoting (det_k / det_k-1, the
    value LAPACK's potrf takes the root of) is not positive, else 0."""
    n = a.shape[-1]
    rest = jnp.arange(n)
    a = jnp.tril(a) + jnp.conj(_mT(jnp.tril(a, -1)))  # the triangle the factorization reads

    def step(k, carry):
        m, info = carry
        d = jnp.real(m[..., k, k])
        info = jnp.where((info == 0) & ~(d > 0), k + 1, info)
        below = rest > k
        update = m[..., :, k, None] * m[..., None, k, :] / m[..., k, k][..., None, None]
        return m - jnp.where(below[:, None] & below[None, :], update, 0), info

    return lax.fori_loop(0, n, step, (a, _info(a)))[1]


def _lu_info(lu):
    return _first(jnp.diagonal(lu, axis1=-2, axis2=-1) == 0)


def _check_info(info, check_errors, message):
    """The *_ex ops with check_errors=True raise from the kernel itself."""
    if check_errors:
        check(jnp.all(info == 0), message, torch.linalg.LinAlgError)


def _check_eigh(a, *rest):
    if not (a.is_floating_point() or a.is_complex()):
        raise NotImplementedError(f'"linalg_eigh_cpu" not implemented for \'{dtype_name(a.dtype)}\'')


def _mT(a):
    return jnp.swapaxes(a, -1, -2)


def _lu(a):
    lu, piv, perm = lax.linalg.lu(a)
    return lu, (piv + 1).astype(jnp.int32), perm


def _svd(a, full_matrices=False):
    """jnp.linalg.svd's (u, s, vh).  For a TPU program, JAX's TPU algorithm (QDWH polar
    decomposition, then eigh) is traced here with 64-bit types off: lowered as JAX lowers it,
    under the 64-bit mode torchtpu runs in, it multiplies the float32 factor by an int64 sign
    matrix, and libtpu aborts the process compiling that dot (`shape.h: Check failed: buffer
    != nullptr`; libtpu 0.0.42.1, measured with the TPU compiler here).  Its inputs and
    outputs are 32-bit either way; float64 (emulated on TPU) keeps JAX's own path."""
    if (runtime.program_platform() == "tpu" and a.size and a.dtype in (jnp.float32, jnp.complex64)):
        from jax._src.tpu.linalg.svd import svd as tpu_svd  # what JAX's TPU lowering of svd calls
        fn = functools.partial(tpu_svd, full_matrices=full_matrices, compute_uv=True)
        for _ in range(a.ndim - 2):
            fn = jax.vmap(fn)
        with jax.enable_x64(False):
            return fn(a)
    return jnp.linalg.svd(a, full_matrices=full_matrices)


@lowering("aten::_linalg_svd.default")
def linalg_svd(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        return jnp.zeros((0,), a.dtype), jnp.linalg.svd(a, compute_uv=False), jnp.zeros((0,), a.dtype)
    u, s, vh = _svd(a, full_matrices)
    return u, s, vh


@lowering("aten::linalg_qr.default")
def linalg_qr(a, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


@lowering("aten::_linalg_eigh.default", validate=_check_eigh)
def linalg_eigh(a, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), a.dtype))


@lowering("aten::linalg_inv_ex.default")
def linalg_inv_ex(a, check_errors=False):
    lu, piv, _ = _lu(a)
    info = _lu_info(lu)
    _check_info(info, check_errors, "linalg.inv: The input matrix is singular.")
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return jsl.lu_solve((lu, piv - 1), eye), info


@lowering("aten::linalg_cholesky_ex.default")
def linalg_cholesky_ex(a, upper=False, check_errors=False):
    l = jnp.linalg.cholesky(a, symmetrize_input=False)  # the lower triangle alone, as LAPACK
    # XLA's factor of a matrix that is not positive-definite is all NaN; only then is LAPACK's
    # info (the order of the first leading minor that is not positive-definite) worked out.
    failed = ~jnp.all(jnp.real(jnp.diagonal(l, axis1=-2, axis2=-1)) > 0)
    info = lax.cond(failed, _cholesky_info, _info, a) if a.shape[-1] else _info(a)
    _check_info(info, check_errors, "linalg.cholesky: The input is not positive-definite.")
    if upper:
        l = jnp.conj(_mT(l))
    return l, info


@lowering("aten::cholesky.default")
def cholesky(a, upper=False):
    return linalg_cholesky_ex(a, upper)[0]


@lowering("aten::linalg_lu_factor_ex.default")
def linalg_lu_factor_ex(a, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor(pivot=False) has no tpu lowering")
    lu, piv, _ = _lu(a)
    info = _lu_info(lu)
    _check_info(info, check_errors, "linalg.lu_factor: The input matrix is singular.")
    return lu, piv, info


@lowering("aten::_linalg_det.default")
def linalg_det(a):
    lu, piv, perm = _lu(a)
    n = a.shape[-1]
    parity = jnp.sum(piv != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1) % 2
    sign = jnp.where(parity == 1, -1, 1).astype(a.dtype)
    det = sign * jnp.prod(jnp.diagonal(lu, axis1=-2, axis2=-1), axis=-1)
    return det, lu, piv


@lowering("aten::_linalg_slogdet.default")
def linalg_slogdet(a):
    lu, piv, _ = _lu(a)
    n = a.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    parity = jnp.sum(piv != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1) % 2
    if jnp.iscomplexobj(a):
        sign = jnp.prod(diag / jnp.abs(diag), axis=-1) * jnp.where(parity == 1, -1, 1)
    else:
        sign = jnp.prod(jnp.sign(diag), axis=-1) * jnp.where(parity == 1, -1, 1)
    logabs = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign.astype(a.dtype), logabs, lu, piv


@lowering("aten::_linalg_solve_ex.default")
def linalg_solve_ex(a, b, left=True, check_errors=False):
    lu, piv, perm = _lu(a)
    info = _lu_info(lu)
    _check_info(info, check_errors, "torch.linalg.solve: The solver failed because the input matrix is singular.")
    # PyTorch treats b as a batch of vectors when b.ndim == 1 or b is a batch of a's columns.
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    if not left:
        # x a = b  <=>  a^T x^T = b^T
        x = jnp.linalg.solve(_mT(a), _mT(b))
        return _mT(x), lu, piv, info
    if vector:
        x = jnp.linalg.solve(a, b[..., None])[..., 0]
    else:
        x = jnp.linalg.solve(a, b)
    return x, lu, piv, info


@lowering("aten::linalg_solve_triangular.default")
def linalg_solve_triangular(a, b, upper, left=True, unitriangular=False):
    a, b = jnp.broadcast_arrays(a, b) if a.ndim != b.ndim else (a, b)
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper,
                                       unit_diagonal=unitriangular)


@lowering("aten::triangular_solve.default")
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper,
                                    transpose_a=transpose, unit_diagonal=unitriangular)
    return x, a


@lowering("aten::linalg_matrix_exp.default")
def linalg_matrix_exp(a):
    if a.dtype in HALF_TYPES:
        # The CPU's half-precision series rounds at every step; float32 would not match it.
        raise NotImplementedError(f"linalg_matrix_exp of {a.dtype} tensors on tpu")
    return jsl.expm(a)


@lowering("aten::lu_unpack.default")
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    if unpack_data:
        l = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
        u = jnp.triu(lu[..., :k, :])
    else:
        l = u = jnp.zeros((0,), lu.dtype)
    if unpack_pivots:
        perm = lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
        # perm[i] is the row of A at row i of L U, so A = P L U with P[perm[i], i] = 1.
        p = _mT(jnp.eye(m, dtype=lu.dtype)[perm])
    else:
        p = jnp.zeros((0,), lu.dtype)
    return p, l, u


@lowering("aten::linalg_lu_solve.default")
def linalg_lu_solve(lu, pivots, b, left=True, adjoint=False):
    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    piv = pivots.astype(jnp.int32) - 1
    if left:
        return jsl.lu_solve((lu, piv), b, trans=2 if adjoint else 0)
    # x A = b  <=>  A^T x^T = b^T ;  x A^H = b  <=>  A x^H = b^H
    if adjoint:
        return jnp.conj(_mT(jsl.lu_solve((lu, piv), jnp.conj(_mT(b)), trans=0)))
    return _mT(jsl.lu_solve((lu, piv), _mT(b), trans=1))


@lowering("aten::linalg_lu.default")
def linalg_lu(a, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg.lu(pivot=False) has no tpu lowering (PyTorch only "
                                  "implements it on CUDA)")
    lu, piv, _ = _lu(a)
    return lu_unpack(lu, piv)


@lowering("aten::geqrf.default")
def geqrf(a):
    from jax._src.lax.linalg import geqrf as lapack_geqrf  # LAPACK's geqrf; not public in jax.lax
    return lapack_geqrf(a)


@lowering("aten::cholesky_inverse.default")
def cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return jsl.cho_solve((factor, not upper), eye)


@lowering("aten::_cholesky_solve_helper.default")
def cholesky_solve_helper(b, factor, upper):
    batch = jnp.broadcast_shapes(b.shape[:-2], factor.shape[:-2])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    factor = jnp.broadcast_to(factor, batch + factor.shape[-2:])
    return jsl.cho_solve((factor, not upper), b)


def _eig_on_host(a):
    """LAPACK's geev on the host, in a host callback.  XLA:TPU has no nonsymmetric
    eigendecomposition (JAX: "MLIR translation rule for primitive 'eig' not found for platform
    tpu"); PyTorch on CUDA also computes it on the host (MAGMA's geev), and a TPU program can
    call the host as that does.  scipy's geev, in the input's precision as PyTorch's CPU kernel
    (numpy's would compute in double: another real eigenvector's sign, as valid)."""
    import scipy.linalg  # a dependency of jax
    out = jnp.complex64 if a.dtype in (jnp.float32, jnp.complex64) else jnp.complex128

    def geev(x):
        x = np.asarray(x)
        flat = x.reshape((-1,) + x.shape[-2:])
        w = np.empty(flat.shape[:-1], out)
        v = np.empty(flat.shape, out)
        for i, m in enumerate(flat):
            w[i], v[i] = scipy.linalg.eig(m, check_finite=False)
        return w.reshape(x.shape[:-1]), v.reshape(x.shape)

    shapes = (jax.ShapeDtypeStruct(a.shape[:-1], out), jax.ShapeDtypeStruct(a.shape, out))
    return jax.pure_callback(geev, shapes, a, vmap_method="broadcast_all")


@lowering("aten::linalg_eig.default")
def linalg_eig(a):
    # LAPACK's geev, like PyTorch's CPU kernel (XLA implements it on CPU and GPU, not on TPU).
    if runtime.program_platform() == "tpu":
        return _eig_on_host(a)
    return jnp.linalg.eig(a)


@lowering("aten::_linalg_eigvals.default")
def linalg_eigvals(a):
    # linalg_eigvals runs this only when no gradient is needed (else linalg_eig).
    if runtime.program_platform() == "tpu":
        return _eig_on_host(a)[0]
    return jnp.linalg.eigvals(a)


@lowering("aten::linalg_householder_product.default")
def linalg_householder_product(a, tau):
    from jax._src.lax.linalg import householder_product  # LAPACK's orgqr; not public in jax.lax
    return householder_product(a, tau)


@lowering("aten::ormqr.default")
def ormqr(a, tau, other, left=True, transpose=False):
    """other multiplied by the Q of geqrf's reflectors: the full Q is the Householder product
    of the reflectors padded to a square matrix (a zero tau is an identity reflector)."""
    from jax._src.lax.linalg import householder_product
    m = a.shape[-2]
    batch = jnp.broadcast_shapes(a.shape[:-2], tau.shape[:-1], other.shape[:-2])
    square = jnp.zeros(batch + (m, m), a.dtype).at[..., :, :a.shape[-1]].set(
        jnp.broadcast_to(a, batch + a.shape[-2:])[..., :, :m])
    taus = jnp.zeros(batch + (m,), a.dtype).at[..., :tau.shape[-1]].set(
        jnp.broadcast_to(tau, batch + tau.shape[-1:]))
    q = householder_product(square, taus)
    if transpose:
        q = jnp.conj(jnp.swapaxes(q, -1, -2))
    return q @ other if left else other @ q


@lowering("aten::linalg_lstsq.default", eager=True)
def linalg_lstsq(a, b, rcond=None, driver=None):
    """Least squares through the SVD (the minimum-norm solution, as gelsy/gelsd/gelss give).
    Which extra outputs are filled follows PyTorch's CPU drivers; residuals exist only for
    tall full-rank problems, so the op synchronises (like the CPU, it has to look at the rank)."""
    if a.ndim < 2:
        raise RuntimeError("torch.linalg.lstsq: input must have at least 2 dimensions.")
    driver = driver or "gelsy"
    if driver not in ("gels", "gelsy", "gelsd", "gelss"):
        raise RuntimeError(f"torch.linalg.lstsq: parameter `driver` should be one of "
                           f"(gels, gelsy, gelsd, gelss), but got {driver}")
    vector = b.ndim == a.ndim - 1
    if vector:
        b = b[..., None]
    m, n = a.shape[-2:]
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + (m, n))
    b = jnp.broadcast_to(b, batch + (m, b.shape[-1]))
    u, s, vh = _svd(a)
    if rcond is None or rcond < 0:
        rcond = jnp.finfo(a.dtype).eps * max(m, n)
    keep = s > rcond * s[..., :1]
    inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0)
    x = _mH(vh) @ (inv[..., None] * (_mH(u) @ b))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    real = jnp.finfo(a.dtype).dtype
    if m > n and driver != "gelsy" and (driver == "gels" or bool(jnp.all(rank == n))):
        residuals = jnp.sum(jnp.abs(a @ x - b) ** 2, axis=-2).astype(real)
    else:
        residuals = jnp.zeros((0,), real)
    ranks = rank if driver != "gels" else jnp.zeros((0,), jnp.int64)
    singular = s.astype(real) if driver in ("gelsd", "gelss") else jnp.zeros((0,), real)
    return (x[..., 0] if vector else x), residuals, ranks, singular


def _mH(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))
