"""The device across processes: the free autoload, forked children, DataLoader workers.

Each case runs in a fresh interpreter (the autoload happens at `import torch`; fork must not
happen in the test process, whose JAX runtime is multithreaded)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(tmp_path, code, env=None):
    """Runs `code` as a script file (spawned processes re-import it) with this checkout first."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    e.update(env or {})
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=e,
                       cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_import_torch_loads_neither_jax_nor_the_kernels(tmp_path):
    out = run_script(tmp_path, """
        import sys
        import torch
        assert torch.device("tpu:1").type == "tpu"  # the name is registered
        torch.manual_seed(0)  # seeds torch.tpu too, without loading it
        assert torch.tpu.is_available() and not torch.tpu._is_in_bad_fork()
        print(sorted(m for m in ("jax", "jaxlib", "torchtpu") if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_first_tensor_op_loads_the_device(tmp_path):
    out = run_script(tmp_path, """
        import sys
        import torch
        x = torch.arange(4.0).to("tpu") * torch.ones(4, device="tpu")
        print(x.cpu().tolist(), x.device, "jax" in sys.modules, type(torch.tpu).__name__)
    """)
    assert out.split() == ["[0.0,", "1.0,", "2.0,", "3.0]", "tpu:0", "True", "_DeviceModule"]


def test_first_torch_tpu_call_loads_the_device(tmp_path):
    out = run_script(tmp_path, """
        import torch
        tpu = torch.tpu  # the stand-in, held across the load
        tpu.enable_cpu_fallback = True
        assert torch.tpu is not tpu and torch.tpu.enable_cpu_fallback is True
        print(tpu.device_count(), tpu.current_device(), tpu.is_initialized())
    """)
    assert out.split() == ["1", "0", "True"]


def test_compile_first_loads_the_device(tmp_path):
    out = run_script(tmp_path, """
        import sys
        import torch
        f = torch.compile(lambda a: a * 2 + 1, backend="tpu")
        print(f(torch.arange(3.0).to("tpu")).cpu().tolist(), "jax" in sys.modules)
    """)
    assert out.split() == ["[1.0,", "3.0,", "5.0]", "True"]


def test_torch_load_to_tpu_first_loads_the_device(tmp_path):
    # Was a segfault: PyTorch's generic restore path copied into a storage before the load.
    torch_file = tmp_path / "t.pt"
    out = run_script(tmp_path, f"""
        import subprocess, sys
        import torch
        subprocess.run([sys.executable, "-c", "import torch; torch.save(torch.arange(3.0), {str(torch_file)!r})"], check=True)
        t = torch.load({str(torch_file)!r}, map_location="tpu")
        print(t.device, t.cpu().tolist())
    """, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert out.split() == ["tpu:0", "[0.0,", "1.0,", "2.0]"]


def test_seed_before_the_load_is_applied(tmp_path):
    out = run_script(tmp_path, """
        import torch
        torch.manual_seed(5)
        a = torch.randn(4, device="tpu")
        torch.manual_seed(5)
        b = torch.randn(4, device="tpu")
        torch.manual_seed(6)
        c = torch.randn(4, device="tpu")
        print(torch.equal(a.cpu(), b.cpu()), torch.equal(a.cpu(), c.cpu()))
    """)
    assert out.split() == ["True", "False"]


def test_a_failed_load_says_why_and_is_retried(tmp_path):
    out = run_script(tmp_path, """
        import sys
        import torch
        sys.modules["jax"] = None  # as if JAX were not installed
        for attempt in range(2):
            try:
                torch.ones(1, device="tpu")
            except RuntimeError as e:
                print("could not be loaded" in str(e), "jax" in str(e))
        try:
            torch.tpu.device_count()
        except RuntimeError as e:
            print("could not be loaded" in str(e))
    """)
    assert out.split() == ["True", "True", "True", "True", "True"]


def test_forked_child_of_a_started_runtime_gets_a_clear_error(tmp_path):
    out = run_script(tmp_path, """
        import os, warnings
        import torch
        x = torch.ones(2, device="tpu") + 1
        warnings.simplefilter("ignore")  # Python's "fork() with threads" warning
        pid = os.fork()
        if pid == 0:
            results = [torch.tpu._is_in_bad_fork()]
            for touch in (lambda: torch.ones(2, device="tpu"), lambda: x + 1,
                          lambda: x.cpu(), lambda: torch.tpu.device_count()):
                try:
                    touch()
                    results.append("no error")
                except RuntimeError as e:
                    results.append("Cannot re-initialize the tpu device in a forked" in str(e)
                                   and "'spawn'" in str(e))
            torch.ones(2).add_(1)  # the CPU still works
            print(*results, flush=True)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        print((x * 2).cpu().tolist(), torch.tpu._is_in_bad_fork())
    """)
    assert out.split() == ["True"] * 5 + ["[4.0,", "4.0]", "False"]


def test_forked_child_before_the_runtime_started_may_use_the_device(tmp_path):
    out = run_script(tmp_path, """
        import os
        import torch
        pid = os.fork()
        if pid == 0:
            print(torch.tpu._is_in_bad_fork(), (torch.ones(2, device="tpu") * 3).cpu().tolist(),
                  flush=True)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    """)
    assert out.split() == ["False", "[3.0,", "3.0]"]


_LOADER = """
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __init__(self, device):
            self.device = device
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.full((3,), float(i), device=self.device)

    def batches(device, context):
        loader = DataLoader(Items(device), batch_size=2, num_workers=2, timeout=120,
                            multiprocessing_context=context)
        return [b.to("tpu") for b in loader]

    if __name__ == "__main__":
        torch.ones(1, device="tpu")  # the runtime has started in the parent
        for context in ("fork", "spawn"):
            got = torch.cat(batches("cpu", context))
            print(context, torch.equal(got.cpu(), torch.arange(8.0).repeat_interleave(3).view(8, 3)))
            try:
                batches("tpu", context)
                print("no error")
            except RuntimeError as e:
                print("cannot use the tpu device" in str(e) or "forked subprocess" in str(e))
"""


def test_dataloader_workers(tmp_path):
    # CPU batches from fork and spawn workers work; a worker that creates a tpu tensor raises a
    # clear RuntimeError in the main process (was: a hang with fork, a segfault with spawn).
    out = run_script(tmp_path, _LOADER)
    assert out.split() == ["fork", "True", "True", "spawn", "True", "True"]
