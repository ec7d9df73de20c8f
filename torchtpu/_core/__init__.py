"""The core every other package builds on: the PJRT runtime, device storages, dtypes, the
lowering registry (the contract every execution path reads) and metrics.  Imports nothing
else of torchtpu."""
