"""One process per TPU chip: the variables libtpu and JAX need, derived from how the job was
launched.

libtpu forms the slice from its own environment variables, whatever `jax.distributed` is told:
`torchrun --nproc-per-node=8` on a v5e-8 starts eight processes that each open all eight chips
unless each is given one chip (`TPU_VISIBLE_CHIPS`), the slice's shape in processes
(`TPU_PROCESS_BOUNDS`, `TPU_CHIPS_PER_PROCESS_BOUNDS`), every process's address
(`TPU_PROCESS_ADDRESSES`, one per process: libtpu checks there are as many as the bounds hold),
its own port and task id (`TPU_PROCESS_PORT`, `CLOUD_TPU_TASK_ID`) and leave to load libtpu
alongside the others (`ALLOW_MULTIPLE_LIBTPU_LOAD`).  PyTorch/XLA, JAX's multi-process test
runner and upstream TorchTPU set the same before the runtime starts.

`derive` is a pure function of the launch environment: environment variables (torchrun's
LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE; GKE's TPU_WORKER_ID, TPU_WORKER_HOSTNAMES,
TPU_HOST_BOUNDS, TPU_CHIPS_PER_HOST_BOUNDS; multislice's MEGASCALE_*), the TPU VM's metadata
(`agent-worker-number`, `worker-network-endpoints`, `tpu-env`), read through a function the
caller gives (tests fake it), and the chips this host's PCI bus lists.  `configure` applies it to
`os.environ`; `init_process_group("tpu")` and the runtime's first start call it.  A host
without TPU chips (a CPU machine, a GPU host) derives nothing and reads no metadata.
"""
import dataclasses
import functools
import glob
import math
import os
import re
import urllib.request

GOOGLE_PCI_VENDOR = "0x1ae0"
CHIP_KINDS = {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e"}
# libtpu's default TPU_PROCESS_PORT; process i of a host listens on BASE_PORT + i (as
# PyTorch/XLA's configure_topology).
BASE_PORT = 8476
# libtpu's default MEGASCALE_PORT: several processes of one host each need their own.
MEGASCALE_BASE_PORT = 8080
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
# Every chip of these kinds' hosts, as a host's chip bounds, where neither the metadata nor the
# environment gives them (4-chip hosts are 2x2; the v5e/v6e 8-chip host is 2x4, which the
# metadata of a v5e-8 has been seen to give differently: what the host says wins).
_DEFAULT_CHIP_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


@dataclasses.dataclass(frozen=True)
class Launch:
    """What this process is on a TPU host, and the variables it needs."""
    accelerator: str            # e.g. "v5litepod-8", else the chips' kind
    chip_kind: str              # v4, v5p, v5e or v6e: from the PCI device id
    chips: int                  # TPU chips on this host
    host_bounds: tuple          # the slice's hosts, as a 3-d grid
    chip_bounds: tuple          # one host's chips, as a 3-d grid
    hosts: tuple                # the slice's host addresses, by worker id
    worker_id: int              # this host's place among the slice's hosts
    slices: int
    slice_id: int
    local_rank: int
    local_world_size: int       # processes on this host: 1 (the host's) or one per chip
    process_id: int             # JAX's, slice-major: slice * hosts * chips + worker * chips + local rank
    process_count: int
    env: dict                   # the variables to set (what the user set left out)
    kept: dict                  # what the user set that differs from the derived value, kept

    @property
    def per_chip(self):
        return self.local_world_size > 1


def _ints(text, name):
    try:
        dims = tuple(int(d) for d in str(text).split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"{name}={text!r}: expected three positive integers such as '2,2,1'")
    return dims


def _bounds_text(dims):
    return ",".join(str(d) for d in dims)


def parse_tpu_env(text):
    """The `tpu-env` metadata value (YAML lines `KEY: 'value'`) as a dict."""
    out = {}
    for line in (text or "").splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_]+)\s*:\s*(.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(2).strip("'\"")
    return out


def _int_env(environ, name, default=None):
    value = environ.get(name)
    if value is None or str(value).strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _no_metadata(key):
    return None


def derive(environ, chips, metadata=_no_metadata):
    """The `Launch` of this process, or None where this host lists no TPU chip (nothing is read
    then).  `chips`: the kinds of this host's TPU chips ("v5e", ...), as `scan_chips` returns;
    `metadata(key)`: the TPU VM metadata attribute `key`, or None.  Raises ValueError for a
    launch libtpu cannot form a slice from, saying what is allowed."""
    if not chips:
        return None
    n = len(chips)
    kind = chips[0]
    # GKE gives the topology in the environment (and its pods may not reach the TPU VM's
    # metadata: TPU_SKIP_MDS_QUERY); a TPU VM in its metadata.  Metadata is read only for what
    # the environment lacks.
    skip_metadata = str(environ.get("TPU_SKIP_MDS_QUERY", "")).lower() in ("1", "true", "yes")
    read = _no_metadata if skip_metadata else functools.lru_cache(None)(metadata)
    tpu_env = {}
    if not skip_metadata and not ("TPU_HOST_BOUNDS" in environ and "TPU_CHIPS_PER_HOST_BOUNDS"
                                  in environ and "TPU_WORKER_ID" in environ):
        tpu_env = parse_tpu_env(read("tpu-env"))

    accelerator = (environ.get("TPU_ACCELERATOR_TYPE") or tpu_env.get("ACCELERATOR_TYPE")
                   or kind)
    chip_text = (environ.get("TPU_CHIPS_PER_HOST_BOUNDS") or tpu_env.get("CHIPS_PER_HOST_BOUNDS")
                 or tpu_env.get("TPU_CHIPS_PER_PROCESS_BOUNDS"))
    if chip_text:
        chip_bounds = _ints(chip_text, "the host's chip bounds (CHIPS_PER_HOST_BOUNDS)")
    elif n in _DEFAULT_CHIP_BOUNDS:
        chip_bounds = _DEFAULT_CHIP_BOUNDS[n]
    else:
        raise ValueError(f"this host has {n} TPU chips and neither TPU_CHIPS_PER_HOST_BOUNDS nor "
                         "the TPU VM's tpu-env metadata says how they are arranged: set "
                         "TPU_CHIPS_PER_HOST_BOUNDS (e.g. '2,2,1')")
    if math.prod(chip_bounds) != n:
        raise ValueError(f"the host's chip bounds {_bounds_text(chip_bounds)} hold "
                         f"{math.prod(chip_bounds)} chips but its PCI bus lists {n} TPU chips: "
                         "fix TPU_CHIPS_PER_HOST_BOUNDS, or check the host's chips with lspci")

    worker_id = _int_env(environ, "TPU_WORKER_ID")
    if worker_id is None:
        worker_id = _int_env({"agent-worker-number": read("agent-worker-number")},
                             "agent-worker-number")
    if worker_id is None:
        worker_id = _int_env(tpu_env, "WORKER_ID", 0)
    if environ.get("TPU_WORKER_HOSTNAMES"):
        hosts = tuple(h.strip() for h in environ["TPU_WORKER_HOSTNAMES"].split(",") if h.strip())
    else:
        endpoints = read("worker-network-endpoints")  # "hostname:uid:ip,..." by worker id
        hosts = tuple(e.split(":")[2] if e.count(":") >= 2 else e
                      for e in (endpoints or "").split(",") if e.strip())
    # One host reaches itself; PyTorch/XLA names it localhost too.
    hosts = hosts if len(hosts) > 1 else ("localhost",)
    host_text = (environ.get("TPU_HOST_BOUNDS") or tpu_env.get("HOST_BOUNDS")
                 or tpu_env.get("TPU_PROCESS_BOUNDS"))
    if host_text:
        host_bounds = _ints(host_text, "the slice's host bounds (HOST_BOUNDS)")
    elif len(hosts) == 1:
        host_bounds = (1, 1, 1)
    else:
        raise ValueError(f"the slice has {len(hosts)} hosts and neither TPU_HOST_BOUNDS nor the "
                         "TPU VM's tpu-env metadata says how they are arranged: set "
                         "TPU_HOST_BOUNDS (e.g. '1,1,2' for a v4-16)")
    if math.prod(host_bounds) != len(hosts):
        raise ValueError(f"the slice's host bounds {_bounds_text(host_bounds)} hold "
                         f"{math.prod(host_bounds)} hosts but {len(hosts)} host addresses were "
                         f"found ({', '.join(hosts)}): TPU_WORKER_HOSTNAMES or the TPU VM's "
                         "worker-network-endpoints metadata must list every host of the slice")
    if not 0 <= worker_id < len(hosts):
        raise ValueError(f"TPU worker id {worker_id} is not one of the slice's {len(hosts)} hosts")

    local_world_size = _int_env(environ, "LOCAL_WORLD_SIZE", 1)
    local_rank = _int_env(environ, "LOCAL_RANK", 0)
    if local_world_size not in (1, n):
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world_size}: this host has {n} TPU chips ({accelerator}), "
            f"and libtpu gives each process either one chip or the whole host. Start one process "
            f"per chip (torchrun --nproc-per-node={n}) or one for the host "
            f"(--nproc-per-node=1, with every chip as one device of that process)")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}")

    slices = _int_env(environ, "MEGASCALE_NUM_SLICES", 1)
    slice_id = _int_env(environ, "MEGASCALE_SLICE_ID", 0)
    per_slice = len(hosts) * local_world_size
    process_id = slice_id * per_slice + worker_id * local_world_size + local_rank
    launch = dict(accelerator=accelerator, chip_kind=kind, chips=n, host_bounds=host_bounds,
                  chip_bounds=chip_bounds, hosts=hosts, worker_id=worker_id, slices=slices,
                  slice_id=slice_id, local_rank=local_rank, local_world_size=local_world_size,
                  process_id=process_id, process_count=slices * per_slice)
    if local_world_size == 1:
        # One process owns its host's chips: libtpu's defaults (and the platform's values)
        # describe that already.
        return Launch(**launch, env={}, kept={})

    _check_megascale(environ, slices, slice_id, per_slice)
    _check_ranks(environ, launch)
    process_bounds = tuple(h * c for h, c in zip(host_bounds, chip_bounds))
    ports = range(BASE_PORT, BASE_PORT + n)
    derived = {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_PROCESS_BOUNDS": _bounds_text(process_bounds),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_ADDRESSES": ",".join(f"{h}:{p}" for h in hosts for p in ports),
        "TPU_PROCESS_PORT": str(BASE_PORT + local_rank),
        "CLOUD_TPU_TASK_ID": str(worker_id * n + local_rank),  # slice-local
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    # libtpu also reads the older names; GKE sets them for one process per host.
    for alias, name in (("TPU_HOST_BOUNDS", "TPU_PROCESS_BOUNDS"),
                        ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")):
        if alias in environ:
            derived[alias] = derived[name]
    if slices > 1:
        # Every process of a host joins the slices' DCN network on a port of its own; the
        # coordinator (slice 0's process 0) listens on the base.
        base = _int_env(environ, "MEGASCALE_PORT", MEGASCALE_BASE_PORT)
        derived["MEGASCALE_PORT"] = str(base + local_rank)
        coordinator = environ["MEGASCALE_COORDINATOR_ADDRESS"]
        if not re.search(r":\d+$", coordinator):
            derived["MEGASCALE_COORDINATOR_ADDRESS"] = f"{coordinator}:{base}"

    # The values the platform set describe one process per host: they are replaced.  Any other
    # value already there is the user's, and wins.
    platform = {
        "TPU_PROCESS_BOUNDS": {_bounds_text(host_bounds)},
        "TPU_HOST_BOUNDS": {_bounds_text(host_bounds)},
        "TPU_CHIPS_PER_PROCESS_BOUNDS": {_bounds_text(chip_bounds)},
        "TPU_CHIPS_PER_HOST_BOUNDS": {_bounds_text(chip_bounds)},
        "TPU_VISIBLE_CHIPS": {",".join(str(i) for i in range(n))},
        "CLOUD_TPU_TASK_ID": {str(worker_id)},
        "MEGASCALE_PORT": {environ.get("MEGASCALE_PORT")},  # the host's: the base, above
        "MEGASCALE_COORDINATOR_ADDRESS": {environ.get("MEGASCALE_COORDINATOR_ADDRESS")},
    }
    env, kept = {}, {}
    for name, value in derived.items():
        given = environ.get(name)
        if given is None or given == value or given in platform.get(name, ()):
            env[name] = value
        else:
            kept[name] = given
    final = {**derived, **kept}
    addresses = [a for a in final["TPU_PROCESS_ADDRESSES"].split(",") if a]
    bounds = _ints(final["TPU_PROCESS_BOUNDS"], "TPU_PROCESS_BOUNDS")
    if len(addresses) != math.prod(bounds):
        raise ValueError(
            f"TPU_PROCESS_BOUNDS={final['TPU_PROCESS_BOUNDS']} holds {math.prod(bounds)} processes "
            f"but TPU_PROCESS_ADDRESSES lists {len(addresses)} (libtpu would stop with 'Expected "
            f"{math.prod(bounds)} worker addresses'): unset the one you set "
            f"({', '.join(sorted(kept)) or 'neither was set by you'}) to let torchtpu derive both")
    return Launch(**launch, env=env, kept=kept)


def _check_megascale(environ, slices, slice_id, processes_per_slice):
    given = sorted(k for k in environ if k.startswith("MEGASCALE_"))
    where = f" (set: {', '.join(f'{k}={environ[k]}' for k in given)})" if given else ""
    if slices < 1 or not 0 <= slice_id < slices:
        raise ValueError(f"MEGASCALE_SLICE_ID={slice_id} is not one of MEGASCALE_NUM_SLICES="
                         f"{slices} slices{where}: stale MEGASCALE_* values from another job? "
                         "unset them for one slice, or set all four for this job")
    if slices > 1 and not environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        raise ValueError(f"MEGASCALE_NUM_SLICES={slices} without MEGASCALE_COORDINATOR_ADDRESS"
                         f"{where}: a multislice job needs slice 0's first host as coordinator "
                         "(or unset MEGASCALE_NUM_SLICES for one slice)")
    world = _int_env(environ, "WORLD_SIZE")
    if world is None or world == slices * processes_per_slice:
        return
    if slices > 1 and world == processes_per_slice:
        raise ValueError(
            f"MEGASCALE_NUM_SLICES={slices} but WORLD_SIZE={world} is one slice's processes"
            f"{where}: stale MEGASCALE_* values from an earlier multislice job? Unset them, or "
            f"launch every slice ({slices * processes_per_slice} processes)")
    slices_in_world = world // processes_per_slice if world % processes_per_slice == 0 else None
    hint = (f"; {slices_in_world} slices need MEGASCALE_NUM_SLICES={slices_in_world}, "
            "MEGASCALE_SLICE_ID and MEGASCALE_COORDINATOR_ADDRESS"
            if slices_in_world and slices_in_world > 1 else "")
    raise ValueError(f"WORLD_SIZE={world}, but {slices} slice(s) of {processes_per_slice} "
                     f"processes make {slices * processes_per_slice}{hint}")


def _check_ranks(environ, launch):
    rank = _int_env(environ, "RANK")
    if rank is None or rank == launch["process_id"]:
        return
    hosts = len(launch["hosts"])
    node = launch["slice_id"] * hosts + launch["worker_id"]
    raise ValueError(
        f"RANK={rank}, but this process drives chip {launch['local_rank']} of TPU worker "
        f"{launch['worker_id']}"
        + (f" of slice {launch['slice_id']}" if launch["slices"] > 1 else "")
        + f", which is process {launch['process_id']} of the slice's topology: torch ranks must "
        "follow the hosts' TPU worker ids. torchrun's c10d rendezvous numbers hosts in the order "
        f"they join; start this host with torchrun --node-rank={node} "
        f"--nnodes={hosts * launch['slices']} --nproc-per-node={launch['chips']} "
        "--master-addr=<worker 0's address> (no --rdzv-backend=c10d)")


# --- reading the host --------------------------------------------------------------------------
def scan_chips(root="/sys/bus/pci/devices"):
    """The kinds of the TPU chips this host's PCI bus lists (vendor 0x1ae0), in bus order."""
    kinds = []
    for vendor_path in sorted(glob.glob(os.path.join(root, "*", "vendor"))):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                kind = CHIP_KINDS.get(f.read().strip())
        except OSError:
            continue
        if kind:
            kinds.append(kind)
    return kinds


# Not through any proxy of the environment: the metadata server is link-local.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_metadata(key, timeout=2.0):
    """The TPU VM metadata attribute `key`, or None (not a TPU VM, or no such attribute)."""
    request = urllib.request.Request(METADATA_URL + key, headers={"Metadata-Flavor": "Google"})
    try:
        with _opener.open(request, timeout=timeout) as response:
            return response.read().decode()
    except (OSError, ValueError):
        return None


@functools.lru_cache(None)
def _metadata_once(key):
    return read_metadata(key)


def this_host(environ=None):
    """`derive` for this process: its environment, this host's PCI bus and metadata server."""
    return derive(os.environ if environ is None else environ, scan_chips(), _metadata_once)


_before = {}   # name: its value before `configure` set it (None: unset)
_applied = {}  # name: the value `configure` set


def configure(environ=None):
    """Derive this process's `Launch` and set its variables in os.environ; returns it, or None
    on a host without TPU chips or with one process for it (nothing changes).  Must run before JAX's TPU backend starts:
    libtpu reads them when it loads.  Called again (the runtime's first start, then
    init_process_group with its rank), it derives from the environment as it was before its
    own changes, so the checks see the group's rank and the values stay the same."""
    environ = dict(os.environ if environ is None else environ)
    if str(environ.get("LOCAL_WORLD_SIZE", "")).strip() in ("", "1") and not _applied:
        # One process for the host sets nothing: no metadata to read (`python train.py` on a
        # TPU VM starts as it did).
        return None
    for name, value in _applied.items():
        if environ.get(name) == value:
            if _before[name] is None:
                environ.pop(name, None)
            else:
                environ[name] = _before[name]
    launch = this_host(environ)
    if launch is not None:
        for name, value in launch.env.items():
            if name not in _applied:
                _before[name] = os.environ.get(name)
            _applied[name] = os.environ[name] = value
    return launch
