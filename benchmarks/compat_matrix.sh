#!/bin/bash
# The torch compatibility matrix of docs/compatibility.md: runs the core test subset with each
# given Python (one virtual environment per torch release, with this checkout installed or on
# the path) from the repository root and prints one line per release.
#   benchmarks/compat_matrix.sh /work/venvs/t2.1{1,2,3,4,5}/bin/python
cd "$(dirname "$0")/.." || exit 1
SUBSET=(tests/test_device.py tests/test_training.py tests/test_models.py tests/test_compile.py
        tests/test_tensors.py
        tests/test_processes.py::test_import_torch_loads_neither_jax_nor_the_kernels
        tests/test_processes.py::test_first_tensor_op_loads_the_device
        tests/test_distributed.py::test_one_rank_group_collectives_are_identities
        tests/test_distributed.py::test_torch_tpu_queries_before_init_process_group)
for py in "$@"; do
    version=$("$py" -c "import torch; print(torch.__version__)" 2>&1 | tail -1)
    start=$SECONDS
    out=$(PYTHONPATH=$PWD timeout 1800 "$py" -m pytest -q -rf -p no:cacheprovider "${SUBSET[@]}" 2>&1)
    summary="$(echo "$out" | grep "^FAILED" | cut -c1-120) $(echo "$out" | tail -1)"
    echo "torch $version | $summary | $((SECONDS - start)) s"
done
