"""One process per TPU chip, without a TPU: the launch environments users start jobs in (torchrun
on a TPU VM, several hosts, GKE, multislice), faked (environment variables, the TPU VM's
metadata, the chips on the PCI bus), and the variables torchtpu/_core/tpu_hosts.py
derives for libtpu and JAX.  The expected values are written from the rules (issue 46):

  process bounds = host bounds x the host's chip bounds; chips per process 1,1,1;
  TPU_VISIBLE_CHIPS = LOCAL_RANK; TPU_PROCESS_PORT = 8476 + LOCAL_RANK;
  TPU_PROCESS_ADDRESSES = every host x ports 8476..8476+chips-1, grouped by host;
  CLOUD_TPU_TASK_ID = worker * chips + LOCAL_RANK (within the slice);
  JAX process id = slice * hosts * chips + worker * chips + LOCAL_RANK.
"""
import os
import subprocess
import sys
import time

import pytest

from torchtpu._core import tpu_hosts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tpu_vm(accelerator, host_bounds, chip_bounds, worker=0, ips=()):
    """A TPU VM's metadata server: `tpu-env` as the VM lists it, its worker number and the
    slice's hosts as `hostname:uid:ip` entries."""
    values = {
        "tpu-env": (f"ACCELERATOR_TYPE: '{accelerator}'\nCHIPS_PER_HOST_BOUNDS: '{chip_bounds}'\n"
                    f"HOST_BOUNDS: '{host_bounds}'\nTYPE: 'V5LITE_POD'\nWORKER_ID: '{worker}'\n"
                    "ZONE: 'us-west4-a'\n"),
        "agent-worker-number": str(worker),
    }
    if ips:
        values["worker-network-endpoints"] = ",".join(
            f"t1v-n-{i}-w-{i}:{1000 + i}:{ip}" for i, ip in enumerate(ips))
    return values.get


def no_metadata(key):
    raise AssertionError(f"read the metadata's {key!r} where it must not")


def torchrun(local_rank, local_world_size, rank, world_size, **extra):
    return dict(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size),
                RANK=str(rank), WORLD_SIZE=str(world_size), **extra)


ONE_HOST_4 = "localhost:8476,localhost:8477,localhost:8478,localhost:8479"


@pytest.mark.parametrize("accelerator,kind", [
    ("v5litepod-4", "v5e"), ("v6e-4", "v6e"), ("v4-8", "v4"), ("v5p-8", "v5p")])
def test_a_4_chip_host(accelerator, kind):
    launch = tpu_hosts.derive(torchrun(2, 4, 2, 4), [kind] * 4,
                              tpu_vm(accelerator, "1,1,1", "2,2,1", ips=["10.130.0.7"]))
    assert launch.env == {
        "TPU_VISIBLE_CHIPS": "2",
        "TPU_PROCESS_BOUNDS": "2,2,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_ADDRESSES": ONE_HOST_4,
        "TPU_PROCESS_PORT": "8478",
        "CLOUD_TPU_TASK_ID": "2",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    assert (launch.accelerator, launch.chip_kind, launch.chips) == (accelerator, kind, 4)
    assert (launch.process_id, launch.process_count, launch.kept) == (2, 4, {})


def test_a_v6e_8():
    launch = tpu_hosts.derive(torchrun(7, 8, 7, 8), ["v6e"] * 8, tpu_vm("v6e-8", "1,1,1", "2,4,1"))
    assert launch.env["TPU_PROCESS_BOUNDS"] == "2,4,1"
    assert launch.env["TPU_VISIBLE_CHIPS"] == "7"
    assert launch.env["TPU_PROCESS_PORT"] == "8483"
    assert launch.env["CLOUD_TPU_TASK_ID"] == "7"
    assert launch.env["TPU_PROCESS_ADDRESSES"] == ",".join(f"localhost:{p}" for p in range(8476, 8484))
    assert (launch.process_id, launch.process_count) == (7, 8)


@pytest.mark.parametrize("chip_bounds", ["2,4,1", "4,2,1", "2,2,2"])
def test_a_v5e_8_takes_its_bounds_from_its_tpu_env(chip_bounds):
    # Sources disagree on a v5e-8's shape: what the host's own metadata says is used.
    launch = tpu_hosts.derive(torchrun(0, 8, 0, 8), ["v5e"] * 8,
                              tpu_vm("v5litepod-8", "1,1,1", chip_bounds))
    assert launch.env["TPU_PROCESS_BOUNDS"] == chip_bounds
    assert launch.chip_bounds == tuple(int(d) for d in chip_bounds.split(","))


def test_an_8_chip_host_without_bounds_anywhere_is_2x4():
    launch = tpu_hosts.derive(torchrun(3, 8, 3, 8), ["v5e"] * 8)
    assert launch.env["TPU_PROCESS_BOUNDS"] == "2,4,1"
    assert launch.accelerator == "v5e"


def test_a_v4_16_of_two_hosts():
    ips = ["10.164.0.2", "10.164.0.3"]
    launch = tpu_hosts.derive(torchrun(3, 4, 7, 8), ["v4"] * 4,
                              tpu_vm("v4-16", "1,1,2", "2,2,1", worker=1, ips=ips))
    assert launch.env["TPU_PROCESS_BOUNDS"] == "2,2,2"
    assert launch.env["TPU_PROCESS_ADDRESSES"] == (
        "10.164.0.2:8476,10.164.0.2:8477,10.164.0.2:8478,10.164.0.2:8479,"
        "10.164.0.3:8476,10.164.0.3:8477,10.164.0.3:8478,10.164.0.3:8479")
    assert launch.env["TPU_PROCESS_PORT"] == "8479"
    assert launch.env["CLOUD_TPU_TASK_ID"] == "7"  # worker 1 * 4 chips + local rank 3
    assert launch.env["TPU_VISIBLE_CHIPS"] == "3"
    assert (launch.worker_id, launch.hosts) == (1, tuple(ips))
    assert (launch.process_id, launch.process_count) == (7, 8)


@pytest.mark.parametrize("accelerator,kind", [("v5litepod-16", "v5e"), ("v6e-16", "v6e")])
def test_a_16_chip_slice_of_four_hosts(accelerator, kind):
    ips = ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"]
    launch = tpu_hosts.derive(torchrun(1, 4, 9, 16), [kind] * 4,
                              tpu_vm(accelerator, "2,2,1", "2,2,1", worker=2, ips=ips))
    assert launch.env["TPU_PROCESS_BOUNDS"] == "4,4,1"
    assert launch.env["TPU_PROCESS_ADDRESSES"].split(",") == [
        "10.0.0.10:8476", "10.0.0.10:8477", "10.0.0.10:8478", "10.0.0.10:8479",
        "10.0.0.11:8476", "10.0.0.11:8477", "10.0.0.11:8478", "10.0.0.11:8479",
        "10.0.0.12:8476", "10.0.0.12:8477", "10.0.0.12:8478", "10.0.0.12:8479",
        "10.0.0.13:8476", "10.0.0.13:8477", "10.0.0.13:8478", "10.0.0.13:8479"]
    assert launch.env["CLOUD_TPU_TASK_ID"] == "9"  # worker 2 * 4 + 1
    assert launch.env["TPU_PROCESS_PORT"] == "8477"
    assert (launch.process_id, launch.process_count) == (9, 16)


GKE_V5E_2X4 = dict(  # a JobSet pod on one of the two ct5lp-hightpu-4t nodes of a 2x4 v5e slice
    TPU_SKIP_MDS_QUERY="true", TPU_ACCELERATOR_TYPE="v5litepod-8", TPU_WORKER_ID="1",
    TPU_WORKER_HOSTNAMES="train-slice-job-0-0.train,train-slice-job-0-1.train",
    TPU_HOST_BOUNDS="1,2,1", TPU_CHIPS_PER_HOST_BOUNDS="2,2,1",
    # what the platform presets for one process per host
    TPU_PROCESS_BOUNDS="1,2,1", TPU_CHIPS_PER_PROCESS_BOUNDS="2,2,1", TPU_VISIBLE_CHIPS="0,1,2,3")


def test_a_gke_jobset_has_its_one_process_per_host_values_overwritten():
    launch = tpu_hosts.derive(torchrun(2, 4, 6, 8, **GKE_V5E_2X4), ["v5e"] * 4, no_metadata)
    assert launch.env == {
        "TPU_VISIBLE_CHIPS": "2",
        "TPU_PROCESS_BOUNDS": "2,4,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_HOST_BOUNDS": "2,4,1",            # the older names libtpu also reads
        "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
        "TPU_PROCESS_ADDRESSES": (
            "train-slice-job-0-0.train:8476,train-slice-job-0-0.train:8477,"
            "train-slice-job-0-0.train:8478,train-slice-job-0-0.train:8479,"
            "train-slice-job-0-1.train:8476,train-slice-job-0-1.train:8477,"
            "train-slice-job-0-1.train:8478,train-slice-job-0-1.train:8479"),
        "TPU_PROCESS_PORT": "8478",
        "CLOUD_TPU_TASK_ID": "6",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    assert launch.kept == {}
    assert (launch.accelerator, launch.process_id, launch.process_count) == ("v5litepod-8", 6, 8)


def test_one_process_per_host_sets_nothing():
    ips = ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"]
    launch = tpu_hosts.derive(torchrun(0, 1, 2, 4), ["v5e"] * 4,
                              tpu_vm("v5litepod-16", "2,2,1", "2,2,1", worker=2, ips=ips))
    assert launch.env == {} and not launch.per_chip
    assert (launch.process_id, launch.process_count, launch.hosts) == (2, 4, tuple(ips))
    launch = tpu_hosts.derive({}, ["v6e"] * 8, tpu_vm("v6e-8", "1,1,1", "2,4,1"))
    assert launch.env == {} and (launch.process_id, launch.process_count) == (0, 1)


def multislice(slice_id, worker, local_rank, **extra):
    """A process of two v6e-16 slices (4 hosts of 4 chips each) launched as xpk does."""
    env = torchrun(local_rank, 4, slice_id * 16 + worker * 4 + local_rank, 32,
                   MEGASCALE_NUM_SLICES="2", MEGASCALE_SLICE_ID=str(slice_id),
                   MEGASCALE_COORDINATOR_ADDRESS="run-slice-0-0.run", TPU_SKIP_MDS_QUERY="true",
                   TPU_WORKER_ID=str(worker), TPU_HOST_BOUNDS="2,2,1",
                   TPU_CHIPS_PER_HOST_BOUNDS="2,2,1", TPU_ACCELERATOR_TYPE="v6e-16",
                   TPU_WORKER_HOSTNAMES=",".join(f"run-slice-{slice_id}-{w}.run" for w in range(4)))
    return tpu_hosts.derive(dict(env, **extra), ["v6e"] * 4, no_metadata)


def test_two_slices_of_v6e_16():
    launch = multislice(slice_id=1, worker=3, local_rank=2)
    assert launch.env["CLOUD_TPU_TASK_ID"] == "14"  # within its slice: worker 3 * 4 + 2
    assert launch.process_id == 30                  # slice 1 * 16 + 14
    assert launch.process_count == 32
    assert launch.env["TPU_PROCESS_BOUNDS"] == "4,4,1"
    assert launch.env["TPU_PROCESS_ADDRESSES"].split(",")[0] == "run-slice-1-0.run:8476"
    assert launch.env["MEGASCALE_PORT"] == "8082"   # 8080 + local rank
    # the coordinator (slice 0's first process) listens on the base port
    assert launch.env["MEGASCALE_COORDINATOR_ADDRESS"] == "run-slice-0-0.run:8080"
    ports = {multislice(1, 3, r).env["MEGASCALE_PORT"] for r in range(4)}
    assert ports == {"8080", "8081", "8082", "8083"}
    # a base the launcher gave is the host's: each process still gets its own port
    assert multislice(0, 0, 3, MEGASCALE_PORT="9000").env["MEGASCALE_PORT"] == "9003"
    assert multislice(0, 0, 0).process_id == 0


def test_a_process_count_other_than_one_or_one_per_chip_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=3: this host has 8 TPU chips "
                       r"\(v5litepod-8\).*--nproc-per-node=8\).*--nproc-per-node=1"):
        tpu_hosts.derive(torchrun(0, 3, 0, 3), ["v5e"] * 8, tpu_vm("v5litepod-8", "1,1,1", "2,4,1"))


def test_what_the_user_set_wins():
    user = dict(TPU_PROCESS_ADDRESSES="h:9000,h:9001,h:9002,h:9003", TPU_PROCESS_PORT="9001",
                ALLOW_MULTIPLE_LIBTPU_LOAD="true")
    launch = tpu_hosts.derive(torchrun(1, 4, 1, 4, **user), ["v6e"] * 4,
                              tpu_vm("v6e-4", "1,1,1", "2,2,1"))
    assert launch.kept == user
    assert launch.env == {"TPU_VISIBLE_CHIPS": "1", "TPU_PROCESS_BOUNDS": "2,2,1",
                          "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1", "CLOUD_TPU_TASK_ID": "1"}
    # a preset that libtpu would refuse is refused before it loads, naming what was set
    with pytest.raises(ValueError, match=r"holds 4 processes but TPU_PROCESS_ADDRESSES lists 1 "
                       r".*Expected 4 worker addresses.*TPU_PROCESS_ADDRESSES"):
        tpu_hosts.derive(torchrun(1, 4, 1, 4, TPU_PROCESS_ADDRESSES="h:9000"), ["v6e"] * 4,
                         tpu_vm("v6e-4", "1,1,1", "2,2,1"))


def test_a_rank_that_is_not_the_hosts_process_id_says_to_pass_node_rank():
    ips = ["10.164.0.2", "10.164.0.3"]
    # c10d rendezvous made the second host node 0: its ranks are 0..3, its chips are 4..7
    with pytest.raises(ValueError, match=r"RANK=1, but this process drives chip 1 of TPU worker "
                       r"1, which is process 5 .*torchrun --node-rank=1 --nnodes=2 "
                       r"--nproc-per-node=4"):
        tpu_hosts.derive(torchrun(1, 4, 1, 8), ["v4"] * 4,
                         tpu_vm("v4-16", "1,1,2", "2,2,1", worker=1, ips=ips))
    with pytest.raises(ValueError, match=r"of slice 1.*--node-rank=7 --nnodes=8"):
        multislice(1, 3, 2, RANK="2")


def test_stale_megascale_values_say_so():
    # left from an earlier two-slice job, this job being one slice of 16 processes
    with pytest.raises(ValueError, match=r"MEGASCALE_NUM_SLICES=2 but WORLD_SIZE=16 is one "
                       r"slice's processes.*stale MEGASCALE_\* values"):
        multislice(1, 3, 2, WORLD_SIZE="16", RANK="14")
    with pytest.raises(ValueError, match=r"MEGASCALE_SLICE_ID=1 is not one of "
                       r"MEGASCALE_NUM_SLICES=1 slices.*stale MEGASCALE_\* values"):
        tpu_hosts.derive(torchrun(0, 4, 0, 4, MEGASCALE_SLICE_ID="1"), ["v6e"] * 4,
                         tpu_vm("v6e-4", "1,1,1", "2,2,1"))
    with pytest.raises(ValueError, match=r"MEGASCALE_NUM_SLICES=2 without "
                       r"MEGASCALE_COORDINATOR_ADDRESS"):
        multislice(0, 0, 0, MEGASCALE_COORDINATOR_ADDRESS="")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=32, but 1 slice\(s\) of 16 processes "
                       r"make 16; 2 slices need MEGASCALE_NUM_SLICES=2"):
        tpu_hosts.derive(torchrun(0, 4, 0, 32), ["v6e"] * 4,
                         tpu_vm("v6e-16", "2,2,1", "2,2,1", ips=["a", "b", "c", "d"]))


def test_bounds_that_disagree_with_the_host_say_which():
    with pytest.raises(ValueError, match=r"chip bounds 2,4,1 hold 8 chips but its PCI bus "
                       r"lists 4"):
        tpu_hosts.derive(torchrun(0, 4, 0, 4), ["v5e"] * 4, tpu_vm("v5litepod-8", "1,1,1", "2,4,1"))
    with pytest.raises(ValueError, match=r"host bounds 2,2,1 hold 4 hosts but 2 host addresses"):
        tpu_hosts.derive(torchrun(0, 4, 0, 16), ["v5e"] * 4,
                         tpu_vm("v5litepod-16", "2,2,1", "2,2,1", ips=["a", "b"]))


def test_no_tpu_chip_derives_nothing_and_reads_no_metadata():
    assert tpu_hosts.derive(torchrun(0, 8, 0, 8, TPU_WORKER_ID="0"), [], no_metadata) is None


def test_chips_are_read_from_the_pci_bus(tmp_path):
    for slot, vendor, device in [("0000:00:04.0", "0x1ae0", "0x0063"),
                                 ("0000:00:05.0", "0x1ae0", "0x0063"),
                                 ("0000:00:06.0", "0x1ae0", "0x0001"),   # another Google device
                                 ("0000:00:07.0", "0x8086", "0x0063")]:  # not Google's
        (tmp_path / slot).mkdir()
        (tmp_path / slot / "vendor").write_text(vendor + "\n")
        (tmp_path / slot / "device").write_text(device + "\n")
    assert tpu_hosts.scan_chips(str(tmp_path)) == ["v5e", "v5e"]
    assert tpu_hosts.CHIP_KINDS == {"0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e",
                                    "0x006f": "v6e"}


def test_the_tpu_env_metadata_parses():
    text = ("ACCELERATOR_TYPE: 'v4-256'\nCHIPS_PER_HOST_BOUNDS: '2,2,1'\nHOST_BOUNDS: '2,2,8'\n"
            "INJECT_SLICE_BUILDER_FAULT: ''\nWORKER_ID: '0'\n")
    assert tpu_hosts.parse_tpu_env(text) == {
        "ACCELERATOR_TYPE": "v4-256", "CHIPS_PER_HOST_BOUNDS": "2,2,1", "HOST_BOUNDS": "2,2,8",
        "INJECT_SLICE_BUILDER_FAULT": "", "WORKER_ID": "0"}


@pytest.mark.skipif(bool(tpu_hosts.scan_chips()), reason="this host has TPU chips")
def test_a_host_without_tpu_chips_changes_nothing_at_once(monkeypatch):
    monkeypatch.setattr(tpu_hosts, "read_metadata", no_metadata)
    before = dict(os.environ)
    start = time.perf_counter()
    assert tpu_hosts.configure(torchrun(1, 8, 1, 8)) is None
    assert time.perf_counter() - start < 0.5
    assert dict(os.environ) == before


def test_configure_sets_the_variables_once_and_derives_again_from_the_original(monkeypatch):
    monkeypatch.setattr(tpu_hosts, "scan_chips", lambda: ["v6e"] * 4)
    monkeypatch.setattr(tpu_hosts, "_metadata_once", no_metadata)
    monkeypatch.setattr(tpu_hosts, "_before", {})
    monkeypatch.setattr(tpu_hosts, "_applied", {})
    names = ("TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
             "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID",
             "ALLOW_MULTIPLE_LIBTPU_LOAD", "MEGASCALE_PORT", "MEGASCALE_COORDINATOR_ADDRESS",
             "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "TPU_SKIP_MDS_QUERY", "TPU_WORKER_ID",
             "TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_WORKER_HOSTNAMES", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")
    for name in names:
        monkeypatch.delenv(name, raising=False)  # (restored after the test)
    env = torchrun(1, 4, 21, 32, MEGASCALE_NUM_SLICES="2", MEGASCALE_SLICE_ID="1",
                   MEGASCALE_COORDINATOR_ADDRESS="c:7000", TPU_SKIP_MDS_QUERY="1",
                   TPU_WORKER_ID="1", TPU_HOST_BOUNDS="2,2,1", TPU_CHIPS_PER_HOST_BOUNDS="2,2,1",
                   TPU_WORKER_HOSTNAMES="a,b,c,d")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # one process for the host: nothing to set, nothing read
    assert tpu_hosts.configure(dict(os.environ, LOCAL_WORLD_SIZE="1")) is None
    assert tpu_hosts.configure(dict(os.environ, LOCAL_WORLD_SIZE="")) is None
    first = tpu_hosts.configure()
    assert os.environ["TPU_VISIBLE_CHIPS"] == "1" and os.environ["MEGASCALE_PORT"] == "8081"
    assert os.environ["TPU_HOST_BOUNDS"] == "4,4,1"
    assert "MEGASCALE_COORDINATOR_ADDRESS" not in first.env  # it had a port: left as given
    # init_process_group derives again with its rank: the same values, not 8081 + 1
    again = tpu_hosts.configure(dict(os.environ, RANK="21"))
    assert again == first and os.environ["MEGASCALE_PORT"] == "8081"
    with pytest.raises(ValueError, match=r"RANK=5, but .*--node-rank=5"):
        tpu_hosts.configure(dict(os.environ, RANK="5"))


def test_launch_checks_the_groups_rank_before_connecting(monkeypatch):
    from torchtpu._distributed import launch
    monkeypatch.setattr(launch, "_tpu_launch", None)  # (restored after the test)
    monkeypatch.setattr(tpu_hosts, "configure", lambda environ: tpu_hosts.derive(
        environ, ["v5e"] * 8, tpu_vm("v5litepod-8", "1,1,1", "2,4,1")))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="RANK=5, but this process drives chip 3"):
        launch.configure_tpu_hosts(5, 8)
    launch.configure_tpu_hosts(3, 8)
    assert launch._tpu_launch.per_chip and launch._tpu_launch.process_id == 3


def test_info_says_no_tpu_host_on_a_host_without_chips():
    if tpu_hosts.scan_chips():
        pytest.skip("this host has TPU chips")
    out = subprocess.run([sys.executable, "-m", "torchtpu", "info"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr
    assert "TPU hosts  no TPU host detected (no TPU chip on this host's PCI bus)" in out.stdout


def test_info_on_a_tpu_host_shows_what_one_process_per_chip_sets():
    from torchtpu.__main__ import tpu_hosts_info
    ips = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    # not under torchrun: what torchrun's first process on this host would set
    lines = tpu_hosts_info({}, ["v5e"] * 4, tpu_vm("v5litepod-16", "2,2,1", "2,2,1", 1, ips))
    assert lines[:6] == [
        "accelerator  v5litepod-16 (v5e chips)",
        "chips on this host  4 (bounds 2,2,1)",
        "hosts  4 (bounds 2,2,1): 10.0.0.1, 10.0.0.2, 10.0.0.3, 10.0.0.4; this is worker 1",
        "slices  1; this is slice 0",
        "processes on this host  1 (one for the host's chips)",
        "under torchrun --nproc-per-node=4, local rank 0 would be JAX process 4 of 16 and set:"]
    assert "  TPU_PROCESS_BOUNDS=4,4,1" in lines and "  CLOUD_TPU_TASK_ID=4" in lines
    lines = tpu_hosts_info(torchrun(2, 8, 2, 8, TPU_PROCESS_PORT="9000"), ["v6e"] * 8,
                           tpu_vm("v6e-8", "1,1,1", "2,4,1"))
    assert "JAX process 2 of 8; sets:" in lines and "  TPU_VISIBLE_CHIPS=2" in lines
    assert "  TPU_PROCESS_PORT=9000 (yours, kept)" in lines
    lines = tpu_hosts_info(torchrun(0, 3, 0, 3), ["v6e"] * 8, tpu_vm("v6e-8", "1,1,1", "2,4,1"))
    assert lines[0].startswith("TPU hosts  8 v6e chips on this host; this launch cannot form a "
                               "slice: LOCAL_WORLD_SIZE=3")


def test_a_local_rank_as_device_on_a_per_chip_host_says_its_chip_is_tpu_0(monkeypatch):
    from torchtpu._core import runtime
    count = len(runtime.devices())
    with pytest.raises(RuntimeError, match=rf"Invalid device ordinal tpu:{count}: {count} tpu "
                       r"device\(s\) are available$"):
        runtime.jax_device(count)
    monkeypatch.setattr(tpu_hosts, "_applied", {"TPU_VISIBLE_CHIPS": "3"})
    with pytest.raises(RuntimeError, match=r"this process was given chip 3 of its host, which it "
                       r"sees as tpu:0; use torch.device\('tpu'\) or torch.tpu.set_device\(0\)"):
        runtime.jax_device(count)


def test_ranks_that_never_reach_the_runtime_are_named_with_their_hosts(monkeypatch):
    import datetime

    import torch.distributed as dist

    from torchtpu._distributed import launch
    ips = ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"]
    monkeypatch.setattr(launch, "_tpu_launch", tpu_hosts.derive(
        torchrun(0, 4, 0, 16), ["v5e"] * 4, tpu_vm("v5litepod-16", "2,2,1", "2,2,1", 0, ips)))
    store = dist.HashStore()
    for r in set(range(16)) - {5, 6, 13}:
        store.set(f"torchtpu/jax_joining/{r}", "1")
    with pytest.raises(dist.DistBackendError, match=r"rank\(s\) \[5, 6, 13\] of 16 did not reach "
                       r"JAX's multi-process runtime within the group's timeout \(0:00:00.200000\); "
                       r"their host\(s\): TPU worker 1 \(10.0.0.11\), TPU worker 3 \(10.0.0.13\)\."):
        launch._wait_for_every_rank(store, 0, 16, datetime.timedelta(seconds=0.2))
    # another slice's host: by its worker id and slice (this process knows its own slice's hosts)
    monkeypatch.setattr(launch, "_tpu_launch", multislice(0, 0, 0))
    store = dist.HashStore()
    for r in set(range(32)) - {21}:  # slice 1 * 16 + worker 1 * 4 + local rank 1
        store.set(f"torchtpu/jax_joining/{r}", "1")
    with pytest.raises(dist.DistBackendError, match=r"rank\(s\) \[21\] of 32 .*; their host\(s\): "
                       r"TPU worker 1 of slice 1\."):
        launch._wait_for_every_rank(store, 0, 32, datetime.timedelta(seconds=0.2))
