"""probe_rotated_write's kernel on the Triton interpreter (its timing needs a GPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from benchmarks import probe_rotated_write as probe  # noqa: E402


@pytest.mark.parametrize("block_tokens", [16, 32])
def test_rotated_rows_and_their_maxima(block_tokens):
    """IEEE float32 mode: the rotated rows of each head within 1e-5 of the float64 product (a partial
    last block included), and the timed launch stores each row's largest rotated value."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((40, 3, 16), generator=gen)
    rotation = torch.linalg.qr(torch.randn((3, 16, 16), generator=gen))[0].contiguous()
    rotated = probe.rotate_rows(x, rotation, "ieee", block_tokens, store_all=True).numpy()
    want = np.einsum("tkd,kde->tke", x.double().numpy(), rotation.double().numpy())
    np.testing.assert_allclose(rotated, want, rtol=0, atol=1e-5)
    maxima = probe.rotate_rows(x, rotation, "ieee", block_tokens, store_all=False).numpy()
    np.testing.assert_array_equal(maxima, rotated.max(-1))
