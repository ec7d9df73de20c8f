"""The PJRT side: which JAX platform backs the `tpu` device, its devices, sync and precision."""
import os
import threading

import jax
import torch
import torchtpu_autoload


def enable_x64():
    """int64 is PyTorch's index type and float64 a real dtype on the CPU; without x64 JAX would
    silently narrow both.  At import: before any array exists (patches.PATCHES)."""
    jax.config.update("jax_enable_x64", True)


enable_x64()


def skip_absent_tpu():
    """With libtpu installed on a machine without a TPU chip (a laptop, CI, a GPU host that
    compiles for TPU targets: tpu_compiler.py), JAX would still load libtpu to look for chips at
    its first use, printing libtpu's complaints about the host to stderr and taking seconds.
    The chips a host has are on its PCI bus (what JAX itself reads to configure Cloud TPU VMs),
    so where there are none JAX's TPU backend fails at once, quietly, as JAX lets a backend
    fail (the platform stays known: lowering rules are registered for it).  Left alone where the user
    chose platforms (JAX_PLATFORMS, TORCHTPU_PLATFORM=tpu, JAX_FORCE_TPU_INIT) or where JAX's
    backends already started.  At import: before any backend starts (patches.PATCHES)."""
    from jax._src import hardware_utils, xla_bridge
    if (jax.config.jax_platforms or os.environ.get("JAX_FORCE_TPU_INIT")
            or os.environ.get("TORCHTPU_PLATFORM", "").strip().lower() == "tpu"
            or "tpu" not in xla_bridge._backend_factories or xla_bridge.backends_are_initialized()):
        return
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        import dataclasses
        xla_bridge._backend_factories["tpu"] = dataclasses.replace(
            xla_bridge._backend_factories["tpu"], factory=_no_tpu_chip, fail_quietly=True)


def _no_tpu_chip(*args, **kwargs):
    raise RuntimeError("no TPU chip on this host's PCI bus (torchtpu did not load libtpu; "
                       "TORCHTPU_PLATFORM=tpu or JAX_PLATFORMS=tpu makes it try)")


skip_absent_tpu()

_PLATFORM_ORDER = ("tpu", "gpu", "cpu")
_state = threading.local()


def _choose_platform():
    wanted = os.environ.get("TORCHTPU_PLATFORM", "").strip().lower()
    if wanted:
        if wanted == "cuda":
            wanted = "gpu"
        if wanted not in _PLATFORM_ORDER:
            raise RuntimeError(
                f"TORCHTPU_PLATFORM={wanted!r} is not one of {', '.join(_PLATFORM_ORDER)}")
        try:
            jax.devices(wanted)
        except RuntimeError as e:
            raise RuntimeError(f"TORCHTPU_PLATFORM={wanted} but JAX has no {wanted} backend: {e}")
        return wanted
    for name in _PLATFORM_ORDER:
        try:
            if jax.devices(name):
                return name
        except RuntimeError:
            continue
    return "cpu"


_platform = None
_devices = None


def platform():
    global _platform
    if _platform is None:
        # On a TPU host with one process per chip (torchrun --nproc-per-node=<chips>), each
        # process must be given its chip before libtpu loads, or all open every chip; torch.tpu
        # queries may come before init_process_group.  Nothing happens without TPU chips.
        from . import tpu_hosts
        tpu_hosts.configure()
        _platform = _choose_platform()
    return _platform


def program_platform():
    """The platform the program being traced is for: a TPU target's while `tpu_compiler`
    traces one for it on this thread (a program compiled for a slice this machine lacks),
    else this process's `platform()`.  Lowerings that choose by platform ask this."""
    from . import tpu_compiler
    return tpu_compiler.building_for() or platform()


def devices():
    """The local JAX devices; `tpu:N` is `devices()[N]`."""
    global _devices
    if _devices is None:
        torchtpu_autoload.check_process()  # a forked child or DataLoader worker: a clear error
        _devices = jax.local_devices(backend=platform())
        if not 0 <= _current[0] < len(_devices):
            bad, _current[0] = _current[0], 0
            jax_device(bad)  # raises: torch.tpu.set_device was given a device that is not there
    return _devices


def _forget_devices():
    global _devices
    _devices = None


def started():
    """Whether the devices were asked for (the runtime started)."""
    return _devices is not None


def forget():
    """Forget the platform and its devices: the runtime was shut down, and the next use
    chooses and starts anew (_distributed/launch.py, before JAX's distributed runtime)."""
    global _devices, _platform
    _devices = _platform = None


# A forked child of a started runtime: torch.tpu.* queries restart it, which raises there.
torchtpu_autoload.on_bad_fork(_forget_devices)


def device_count():
    return len(devices())


def jax_device(index):
    devs = devices()
    if not 0 <= index < len(devs):
        from . import tpu_hosts
        chip = tpu_hosts._applied.get("TPU_VISIBLE_CHIPS")
        hint = "" if chip is None else (
            f" (one process per TPU chip: this process was given chip {chip} of its host, "
            "which it sees as tpu:0; use torch.device('tpu') or torch.tpu.set_device(0), not "
            "the local rank)")
        raise RuntimeError(
            f"Invalid device ordinal tpu:{index}: {len(devs)} tpu device(s) are available{hint}")
    return devs[index]


# The current device is process-wide, not per thread: PyTorch's autograd engine runs
# backward on its own device threads, and they must see the same device as the user.
_current = [0]


def current_device():
    return _current[0]


def set_current_device(index):
    from jax._src import xla_bridge
    if _devices is None and not xla_bridge.backends_are_initialized():
        # Checked when the runtime starts: `torch.tpu.set_device(local_rank)` may come before
        # init_process_group, which must start JAX's multi-process runtime first.
        _current[0] = index
        return
    jax_device(index)
    _current[0] = index


def supports_float64():
    return platform() != "tpu"


def device_index(device):
    """The tpu device index `device` names (None: the current device; an int, str or
    torch.device)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device}")
        return current_device() if device.index is None else device.index
    raise TypeError(f"Invalid device: {device!r}")


def jax_precision():
    """The jax.lax.Precision matching torch.get_float32_matmul_precision()."""
    p = torch.get_float32_matmul_precision()
    return {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH}.get(
        p, jax.lax.Precision.DEFAULT)
