"""bench_engine_host's step timing on CPU at toy sizes (its plumbing; the figures are not tested)."""

import pytest

from benchmarks import bench_engine_host

pytestmark = pytest.mark.kernels("xla")


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_steps_time_a_full_decode_batch(overlap):
    import jax

    from oscar_jax.model import ModelConfig, init_params

    model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_q_heads=2,
                        num_kv_heads=1, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, tie_embeddings=False,
                        qk_norm=True)
    params = init_params(model, jax.random.key(0), dtype="bfloat16")
    run = bench_engine_host.engine_steps(overlap, 3, params, model, batch=3, prompt=64)
    assert run["overlap"] is overlap and run["steps"] == 3
    # the host part is the step's wall time less its wait on the device: positive, never above the step
    assert 0 < run["host_ms_p50"] <= run["step_ms_p50"]
