#!/bin/bash
# The accelerator-path check: run from the repository root on a machine whose JAX has a CUDA or
# TPU backend (torchtpu picks it over the CPU). Prints the training-step and per-op figures
# quoted in docs/performance.md, then runs the training, mode and compile tests there.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
python3 -c "import torch, torchtpu, jax; print(torch.__version__, jax.__version__, jax.devices())" || exit 1
# Strict, fused, the one-executable step and one jax.jit, on the 4-layer GPT and the Llama in one run.
timeout 420 python3 benchmarks/train_step.py --steps 10 --models gpt,llama --mode strict,fused,onestep --no-inductor
timeout 120 python3 benchmarks/overhead.py
timeout 600 python3 -m pytest -q -x -p no:cacheprovider tests/test_training.py tests/test_modes.py tests/test_compile.py
