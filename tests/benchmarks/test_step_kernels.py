"""benchmarks/step_kernels.py files every Triton kernel that streams the weights under the family whose
bytes it is measured against: the FP8 linears', kv_b_proj's per-head products' and the routed experts';
and the simulated rank's stand-in routing under its own family, apart from the real step's kernels."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

# the modules whose kernels are filed by name -> the family each of their kernels belongs to
FILED_KERNELS = {
    "spmoe/layers/quantization/fp8_kernels.py": {
        "_fp8_matmul_kernel": "fp8_linear",
        "_sum_splits_kernel": "fp8_linear",
        "_fp8_head_matmul_kernel": "fp8_head",
    },
    "spmoe/layers/moe/experts/triton_kernels.py": {
        "_gate_up_kernel": "experts",
        "_down_kernel": "experts",
        "_count_kernel": "expert_routing",
        "_blocks_kernel": "expert_routing",
        "_place_kernel": "expert_routing",
        "_align_one_program_kernel": "expert_routing",
        "_quantize_kernel": "other",
    },
    "spmoe/layers/moe/seeded_triton.py": {
        "_seeded_routing_kernel": "simulation",
        "_rotate_to_busiest_kernel": "simulation",
    },
}


def test_each_filed_kernel_in_its_family():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_kernels import family_of
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for module, families in FILED_KERNELS.items():
        # kernels, not the jitted helpers they call
        jitted = re.findall(
            r"@triton\.jit(?:\(.*\))?\s*\ndef (\w+_kernel)\(", (ROOT / module).read_text()
        )
        # a kernel added, renamed or removed there must be filed here (and in FAMILIES) too
        assert sorted(jitted) == sorted(families), (module, jitted)
        for kernel, family in families.items():
            assert family_of(kernel) == family, (kernel, family_of(kernel), family)
