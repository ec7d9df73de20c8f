"""The private persistent compilation cache (issue 17 item 5): permissions, verification,
atomic shared writes, its size bound, versions and the `python -m torchtpu cache` command."""
import os
import stat
import subprocess
import sys
import warnings

import pytest

from torchtpu._execution import persistent_cache as cache


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_000_still_makes_a_private_directory_and_files(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "a" / "b"
        c = cache.open_cache(str(path))
        c.put("key-1", b"payload")
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "a") == 0o700 and mode_of(path) == 0o700
    (entry,) = [p for p in path.iterdir()]
    assert mode_of(entry) == 0o600
    assert c.get("key-1") == b"payload"


@pytest.mark.parametrize("problem", ["group_writable", "other_writable", "foreign_owner"])
def test_an_unsafe_directory_is_refused_with_a_warning(tmp_path, monkeypatch, problem):
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    if problem == "group_writable":
        os.chmod(path, 0o770)
    elif problem == "other_writable":
        os.chmod(path, 0o703)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(path).st_uid + 1)
    with pytest.warns(UserWarning, match="is not used because it is"):
        assert cache.open_cache(str(path)) is None


def test_an_unwritable_directory_turns_the_cache_off_without_crashing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot be created"):
        assert cache.open_cache(str(blocker / "cache")) is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped_payload", "foreign_key",
                                    "other_version", "group_writable_file"])
def test_a_bad_entry_is_a_miss_and_is_rewritten(tmp_path, damage):
    c = cache.open_cache(str(tmp_path / "c"))
    c.put("key-1", b"x" * 1000)
    entry = c._file("key-1")
    data = open(entry, "rb").read()
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "flipped_payload":
        data = data[:-1] + b"y"
    elif damage == "foreign_key":  # another key's valid entry under this key's name
        c.put("key-2", b"z" * 1000)
        data = open(c._file("key-2"), "rb").read()
    elif damage == "other_version":
        other = cache.PrivateCache(c.path)
        other.version = "torchtpu 9.9; jax 0.0; jaxlib 0.0"
        other.put("key-1", b"x" * 1000)
        data = open(entry, "rb").read()
    if damage == "group_writable_file":
        os.chmod(entry, 0o620)
    else:
        with open(entry, "wb") as f:
            f.write(data)
    assert c.get("key-1") is None
    c.put("key-1", b"x" * 1000)  # what JAX does after the miss: compile and store again
    assert c.get("key-1") == b"x" * 1000


def test_size_is_bounded_least_recently_used_first(tmp_path):
    c = cache.PrivateCache(cache.open_cache(str(tmp_path / "c")).path, max_size=4000)
    for i in range(3):
        c.put(f"k{i}", bytes(1000))
        os.utime(c._file(f"k{i}"), ns=(i * 10**9, i * 10**9))
    assert c.get("k0") is not None  # k0 becomes the most recently used
    c.put("k3", bytes(1000))  # over the cap: the least recently used (k1) goes
    assert sum(size for _, size, _ in c.entries()) <= 4000
    assert [c.get(k) is not None for k in ("k0", "k1", "k2", "k3")] == [True, False, True, True]


SCRIPT = """
import sys, jax, numpy as np, torch, torchtpu
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
x = torch.linspace(-3, 3, 4096, dtype=torch.float32, device='tpu').reshape(64, 64)
y = ((x @ x.T).tanh() * 1.7 + x.exp()).softmax(-1)
np.save(sys.argv[1], y.cpu().numpy())
m = torchtpu.metrics()
print(m.get('persistent_cache_hits', 0) + m.get('executables_loaded', 0),
      m.get('persistent_cache_rejected', 0) + m.get('executable_cache_rejected', 0))
"""


def _run(env, out):
    return subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_processes_share_the_cache_and_a_hit_is_bit_identical(tmp_path):
    import numpy as np
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path / "c")}
    # Two processes at once on an empty cache: both compile and write the same entries.
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / f"cold{i}.npy")],
                              env=env, stdout=subprocess.PIPE, text=True) for i in range(2)]
    assert all(p.wait() == 0 for p in procs)
    hits, rejected = _run(env, tmp_path / "warm.npy")
    assert int(hits) >= 1 and int(rejected) == 0
    cold = np.load(tmp_path / "cold0.npy")
    assert np.array_equal(cold, np.load(tmp_path / "cold1.npy"))
    assert cold.tobytes() == np.load(tmp_path / "warm.npy").tobytes()
    # Every entry garbled: nothing is loaded, the results are still the same bits.
    for p in (tmp_path / "c").iterdir():
        p.write_bytes(os.urandom(p.stat().st_size))
    hits, rejected = _run(env, tmp_path / "garbled.npy")
    assert int(hits) == 0 and int(rejected) >= 1
    assert cold.tobytes() == np.load(tmp_path / "garbled.npy").tobytes()
    # `python -m torchtpu cache info` / `clear`.
    info = subprocess.run([sys.executable, "-m", "torchtpu", "cache", "info"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert str(tmp_path / "c") in info and "entries" in info and " 0\n" not in info
    cleared = subprocess.run([sys.executable, "-m", "torchtpu", "cache", "clear"], env=env,
                             capture_output=True, text=True, check=True).stdout
    assert cleared.startswith("removed ")
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".entry")]
