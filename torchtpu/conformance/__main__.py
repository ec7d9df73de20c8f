"""python -m torchtpu.conformance: the OpInfo sweep (see torchtpu/conformance/__init__.py)."""
import argparse
import json
import sys
import time

from . import DTYPES, summarize
from .pool import Progress, run_sweep
from .report import format_table, format_target, format_totals, write_doc

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m torchtpu.conformance",
                                description="Run PyTorch's OpInfo samples on tpu and on the CPU and compare.")
    p.add_argument("--ops", default="", help="comma list of op names (exact name or name.variant, "
                   "else substring filters); default: all of op_db")
    p.add_argument("--dtypes", default="float32",
                   help=f"comma list among {','.join(DTYPES)} or 'all' (default float32)")
    p.add_argument("--max-samples", type=int, default=None, help="at most N samples per (op, dtype)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (each imports torchtpu); 0 = run in this process")
    p.add_argument("--fail-fast", action="store_true", help="stop an (op, dtype) at its first failing sample")
    p.add_argument("--no-grad", action="store_true", help="skip the gradient checks")
    p.add_argument("--grad-dtypes", default="float32",
                   help="comma list of the --dtypes whose gradients are compared (default float32; "
                   "complex64 and bfloat16 also supported)")
    p.add_argument("--no-errors", action="store_true", help="skip error_inputs")
    p.add_argument("--fallback", action="store_true",
                   help="also re-run not-implemented samples with the CPU fallback and count them")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per sample (default 120), or per test with --pytorch-tests (default 300)")
    p.add_argument("--target", default=None, metavar="TOPOLOGY",
                   help="also compile every program the passing samples build for this TPU "
                   "topology (e.g. v5e:1x1; needs libtpu, no TPU) and report the TPU "
                   "compiler's errors by cause")
    p.add_argument("--json", default=None, help="write the full results as JSON here")
    p.add_argument("--write-doc", default=None, help="write a markdown coverage page here")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-op table")
    t = p.add_argument_group("PyTorch's device-generic test suites (docs/op_coverage.md)")
    t.add_argument("--pytorch-tests", metavar="PATH", default=None,
                   help="run PyTorch's own test suites from this source checkout instead of OpInfos")
    t.add_argument("--suites", default="", help="comma list of suites (default: all)")
    t.add_argument("--tests", default=None, help="only tests whose Class.name matches this regex")
    t.add_argument("--opinfo-tests", action="store_true",
                   help="also the OpInfo-parametrized tests (@ops), in float32")
    t.add_argument("--all-dtypes", action="store_true",
                   help="every test in every dtype: no float32 slice, OpInfo-parametrized tests included")
    args = p.parse_args(argv)
    if args.pytorch_tests:
        return _pytorch_tests(p, args, argv)
    args.timeout = 120 if args.timeout is None else args.timeout

    dtypes = list(DTYPES) if args.dtypes == "all" else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose among {', '.join(DTYPES)}")
    try:
        from . import full_name, select_ops
        ops = select_ops([f.strip() for f in args.ops.split(",") if f.strip()])
    except ModuleNotFoundError as exc:
        sys.exit(f"torch's OpInfo database needs {exc.name!r}: pip install {exc.name}")
    names = list(dict.fromkeys(full_name(op) for op in ops))
    if not names:
        sys.exit(f"no OpInfo matches {args.ops!r}")
    run_kwargs = dict(dtypes=tuple(dtypes), max_samples=args.max_samples, grad=not args.no_grad,
                      errors=not args.no_errors, fail_fast=args.fail_fast, timeout=args.timeout,
                      fallback=args.fallback, target=args.target,
                      grad_dtypes=tuple(d.strip() for d in args.grad_dtypes.split(",") if d.strip()))
    start = time.time()
    progress = Progress(len(names), enabled=not args.quiet)
    results = run_sweep(names, run_kwargs, max(args.jobs, 0), progress)
    seconds = time.time() - start
    totals = summarize(results)
    totals["seconds"] = round(seconds, 1)
    command = "python -m torchtpu.conformance " + " ".join(argv if argv is not None else sys.argv[1:])
    if not args.quiet:
        print(format_table(results, dtypes))
    print(format_totals(totals, command))
    if args.target:
        print(format_target(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "dtypes": dtypes, "totals": totals, "results": results},
                      f, indent=1)
    if args.write_doc:
        write_doc(args.write_doc, results, totals, dtypes, command)
    return 0


def _pytorch_tests(p, args, argv):
    from .pytorch_suites import run_suites, select_suites, test_dir
    from .report import format_suite_failures, format_suites, write_suites_doc
    try:
        test_dir(args.pytorch_tests)
        suites = select_suites([s.strip() for s in args.suites.split(",") if s.strip()])
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    start = time.time()
    command = "python -m torchtpu.conformance " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for suite in suites:  # one at a time, each in processes of its own
        results += run_suites(args.pytorch_tests, [suite], timeout=args.timeout or 300,
                              pattern=args.tests, all_dtypes=args.all_dtypes,
                              opinfo_tests=args.opinfo_tests, progress=not args.quiet)
        print(format_suites(results[-1:], header=len(results) == 1), flush=True)
        if args.json:  # after each suite: a long sweep's finished suites are kept
            with open(args.json, "w") as f:
                json.dump({"command": command, "seconds": round(time.time() - start, 1),
                           "suites": results}, f, indent=1)
    seconds = time.time() - start
    if not args.quiet:
        print(format_suite_failures(results))
    print(format_suites(results, total=True))
    print(f"{seconds:.0f}s")
    if args.write_doc:
        write_suites_doc(args.write_doc, results, command, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
