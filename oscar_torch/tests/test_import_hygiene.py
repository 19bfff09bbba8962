"""Backends never import each other: oscar_torch (and the shared cases its tests use) load no JAX."""

import subprocess
import sys

OTHER_BACKEND = {"jax", "jaxlib", "flax", "oscar_jax", "calibration"}


def test_oscar_torch_imports_no_jax():
    code = f"""
import sys
import oscar_torch.ops, oscar_torch.cache, oscar_torch.library, parity_tests.cases
bad = sorted(m for m in sys.modules if m.split('.')[0] in {OTHER_BACKEND!r})
print(','.join(bad))
sys.exit(1 if bad else 0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"oscar_torch imported [{result.stdout.strip()}] {result.stderr[-2000:]}"
