"""Runs ops in worker processes (spawned: each imports torchtpu and PyTorch's op_db itself)."""
import concurrent.futures as cf
import multiprocessing
import sys
import time

_worker_ops = None


def _init_worker():
    global _worker_ops
    import warnings
    warnings.filterwarnings("ignore")
    import torchtpu  # noqa: F401
    from . import load_op_db
    _worker_ops = {}
    from . import full_name
    for op in load_op_db():
        _worker_ops.setdefault(full_name(op), op)


def _run_in_worker(name, kwargs):
    from . import run_op
    return run_op(_worker_ops[name], **kwargs)


class Progress:
    def __init__(self, total, enabled=True):
        self.total, self.done, self.start = total, 0, time.time()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_line = -1

    def update(self, name, status):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / max(self.total, 1)
        elapsed = time.time() - self.start
        eta = elapsed / frac - elapsed if frac else 0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = (f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s eta {eta:5.0f}s  "
                f"{name[:34]:34} {status}")
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120))
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _status_word(r):
    if r["skipped"]:
        return "skipped"
    f = r["dtypes"].get("float32")
    return f["status"] if f else "-"


_BATCH = 80


def run_sweep(names, run_kwargs, jobs, progress):
    results = {}
    if jobs == 0:  # in this process (no isolation from crashes)
        _init_worker()
        for name in names:
            results[name] = _run_in_worker(name, run_kwargs)
            progress.update(name, _status_word(results[name]))
        return [results[n] for n in names]
    pending = list(names)
    ctx = multiprocessing.get_context("spawn")
    retry_alone = []
    while pending or retry_alone:
        # A worker dying (a crash inside XLA, out of memory) breaks the pool: the ops that were
        # in flight are retried one at a time, and one that kills its worker alone is reported.
        # Fresh workers every `_BATCH` ops per worker bound the memory of cached executables.
        alone = bool(retry_alone) and not pending
        if alone:
            batch = [retry_alone.pop(0)]
        else:
            batch, pending = pending[:_BATCH * jobs], pending[_BATCH * jobs:]
        with cf.ProcessPoolExecutor(1 if alone else jobs, mp_context=ctx,
                                    initializer=_init_worker) as pool:
            futures = {pool.submit(_run_in_worker, n, run_kwargs): n for n in batch}
            for fut in cf.as_completed(futures):
                name = futures[fut]
                try:
                    results[name] = fut.result()
                except cf.process.BrokenProcessPool:
                    if alone:
                        results[name] = _crashed(name, "the worker process died running this op",
                                                 run_kwargs.get("target"))
                    else:
                        retry_alone.append(name)
                        continue
                except Exception as exc:
                    results[name] = _crashed(name, f"{type(exc).__name__}: {exc}",
                                             run_kwargs.get("target"))
                progress.update(name, _status_word(results[name]))
    return [results[n] for n in names]


def _crashed(name, why, target=None):
    entry = {"status": "error", "samples": 1, "passed": 0, "first_failure": why,
             "counts": {"error": 1}}
    result = {"op": name, "dtypes": {"float32": entry}, "grad": None, "grads": {}, "errors": None,
              "skipped": None, "nondeterministic": False, "fallback": None, "seconds": 0.0}
    if target is not None:  # with a target, most likely the TPU compiler aborted
        result["target"], result["target_name"], result["crashed"] = {}, target, why
    return result


