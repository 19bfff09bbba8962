"""`--tensor-parallel-size N` writes the one-device artifact, byte for byte.

The run happens in a subprocess (tp_calibration_worker.py) with 8 fake CPU devices: the device
count must reach XLA before JAX initialises, and this pytest process already has.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from shared_math.artifact import ModelFingerprint, read_artifact

WORKER = Path(__file__).with_name("tp_calibration_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_tensor_parallel_calibration_writes_the_one_device_artifact(tmp_path):
    """SmolLM2's heads (3 KV heads) at tp 3: each device holds one KV head's weights."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(PYTHONPATH=str(ROOT), OSCAR_JAX_KERNELS="xla")
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), "1", "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    one, three = (tmp_path / f"tp{n}.safetensors" for n in (1, 3))
    assert one.read_bytes() == three.read_bytes()
    # and an artifact worth comparing: fitted rotations, not identities
    art = read_artifact(one, expected_model=ModelFingerprint(2, 9, 3, 64))
    assert np.abs(art.k_rotation - np.eye(64, dtype=np.float32)).max() > 0.1
    assert "tensor_parallel_size" not in art.provenance["options"]
