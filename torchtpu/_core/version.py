"""torchtpu's version (pyproject.toml's), here below every layer that keys a cache on it."""
VERSION = "0.1.0"
