"""The store of the persistent compilation cache: verified entries in a private directory.

TORCHTPU_CACHE_DIR picks the directory (default: ~/.cache/torchtpu/xla, or under
$XDG_CACHE_HOME); TORCHTPU_CACHE_DIR="" turns it off.  `_execution/persistent_cache.py` installs it as
JAX's cache; `_execution/executables.py` keeps TorchTPU's own executables in it.

Its entries are compiled code that later runs load, so the cache is private and checked:
- directories are created 0700 and files 0600 whatever the umask; a directory owned by another
  user, or writable by group or others, is refused with a warning (the cache is then off);
- each entry carries a header (magic, format version, the torchtpu/jax/jaxlib versions, its
  key, the SHA-256 of its payload) checked before the payload is handed over: a corrupt,
  truncated, foreign or other-version entry is a miss, so it is recompiled and rewritten;
- entries are written to a temporary file and renamed into place, so processes sharing the
  directory never read half an entry; a reader that loses a race with an eviction misses;
- the total size is bounded (TORCHTPU_CACHE_MAX_BYTES, default 2 GiB: a GPT training step's
  segments take a few MB, so the cap holds hundreds of models' programs): the entries read or
  written least recently (file mtime, set on every hit) are removed first.
`python -m torchtpu cache info` shows it, `python -m torchtpu cache clear` empties it.
"""
import hashlib
import json
import os
import stat
import tempfile
import time
import warnings

import jax

from .._core import metrics
from . import version

# JAX's own entries: only slow compiles (ours are all kept: a load skips the trace as well).
MIN_COMPILE_SECONDS = 0.2
DEFAULT_MAX_BYTES = 2 << 30
_MAGIC = b"TORCHTPU-XLA-CACHE\n"
_FORMAT = 1
_SUFFIX = ".entry"


def default_directory():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchtpu", "xla")


def directory():
    """The cache directory configured, or None when disabled."""
    configured = os.environ.get("TORCHTPU_CACHE_DIR")
    if configured is None:
        return default_directory()
    return configured or None


def max_bytes():
    value = os.environ.get("TORCHTPU_CACHE_MAX_BYTES", "")
    return int(value) if value else DEFAULT_MAX_BYTES


def versions():
    """What an entry was built by: an entry of other versions is never loaded."""
    import jaxlib
    return f"torchtpu {version.VERSION}; jax {jax.__version__}; jaxlib {jaxlib.__version__}"


def private_directory(path):
    """Create `path` (and missing parents) 0700; None if it is usable as a private cache, else
    why not."""
    try:
        missing = []
        p = os.path.abspath(path)
        while not os.path.exists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for p in reversed(missing):
            os.mkdir(p, 0o700)
            os.chmod(p, 0o700)  # umask can only take bits away; make it exact anyway
        st = os.stat(path)
    except OSError as e:
        return f"it cannot be created: {e}"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


class PrivateCache:
    """Verified cache entries in a private directory (key -> bytes), usable as JAX's
    compilation cache backend (its CacheInterface: get, put and a `_path`)."""

    def __init__(self, path, max_size=None):
        self.path = self._path = path
        self.max_size = max_bytes() if max_size is None else max_size
        self.version = versions()
        # Bytes written by this process since the directory was last measured (None: never
        # measured); the directory is scanned only when the bound may have been passed.
        self._total = None

    def _file(self, key):
        # JAX's keys are "<module name>-<sha256>"; hashing again keeps any key a safe file name.
        return os.path.join(self.path, hashlib.sha256(key.encode()).hexdigest() + _SUFFIX)

    def get(self, key):
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except OSError:
            return None
        payload = self._verified(data, key, st)
        if payload is None:
            metrics.counters["persistent_cache_rejected"] += 1
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return payload

    def _verified(self, data, key, st):
        if st.st_uid != os.getuid() or st.st_mode & 0o022 or not data.startswith(_MAGIC):
            return None
        end = data.find(b"\n", len(_MAGIC))
        try:
            header = json.loads(data[len(_MAGIC):end])
        except ValueError:
            return None
        payload = data[end + 1:]
        ok = (end > 0 and isinstance(header, dict) and header.get("format") == _FORMAT
              and header.get("version") == self.version and header.get("key") == key
              and header.get("size") == len(payload)
              and header.get("sha256") == hashlib.sha256(payload).hexdigest())
        return payload if ok else None

    def put(self, key, value):
        value = bytes(value)
        if len(value) > self.max_size:
            return
        header = json.dumps({"format": _FORMAT, "version": self.version, "key": key,
                             "size": len(value), "sha256": hashlib.sha256(value).hexdigest()})
        # mkstemp creates the file 0600 whatever the umask; the rename makes it appear whole.
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + header.encode() + b"\n" + value)
            os.replace(tmp, self._file(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        if self._total is None or self._total + len(value) > self.max_size:
            self._total = self.evict(self.max_size)
        else:
            self._total += len(value) + len(header) + 64

    def entries(self):
        """(mtime, size, path) of each entry, least recently used first."""
        found = []
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if e.name.endswith(_SUFFIX):
                        try:
                            st = e.stat()
                        except OSError:
                            continue  # removed meanwhile by another process
                        found.append((st.st_mtime_ns, st.st_size, e.path))
        except OSError:
            pass
        return sorted(found)

    def evict(self, limit):
        """Remove least recently used entries until they total at most `limit` bytes."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= limit:
                break
            try:
                os.unlink(path)
            except OSError:
                pass  # another process evicted it first
            total -= size
        return total

    def clear(self):
        self.evict(0)


def open_cache(path=None, warn=True):
    """A PrivateCache on the configured directory, or None (disabled, or refused with a
    warning)."""
    path = directory() if path is None else path
    if path is None:
        return None
    problem = private_directory(path)
    if problem is not None:
        if warn:
            warnings.warn(f"torchtpu: the compilation cache {path} is not used because {problem}; "
                          f"compiled programs are not kept across runs (set TORCHTPU_CACHE_DIR to "
                          f"a private directory, or to '' to silence this)")
        return None
    return PrivateCache(path)


