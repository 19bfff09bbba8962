"""The format constants and the validated configuration."""

import dataclasses

import numpy as np
import pytest

from shared_math.spec import FORMAT_VERSION, OscarConfig, clip_index


def test_defaults_and_clip_indices():
    cfg = OscarConfig(head_dim=128)
    assert FORMAT_VERSION == 1
    assert (cfg.group_size, cfg.sink, cfg.recent, cfg.page_size) == (128, 64, 256, 16)
    # d = 128: the 5 largest |k| and the 10 largest |v| are clipped
    assert (cfg.k_clip_index, cfg.v_clip_index) == (122, 117)
    assert OscarConfig(head_dim=64).group_size == 64
    assert OscarConfig(head_dim=256).group_size == 128
    assert clip_index(1.0, 64) == 63 and clip_index(0.5, 64) == 32


def test_json_round_trip_and_frozen():
    cfg = OscarConfig(head_dim=64, group_size=32, k_clip_ratio=0.9, levels="moments", sink=32, recent=128)
    assert OscarConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sink = 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(head_dim=96), "head_dim=96"),
        (dict(head_dim=64, group_size=8), "group_size=8"),
        (dict(head_dim=64, k_clip_ratio=0), "clip_ratio=0"),
        (dict(head_dim=64, v_clip_ratio=1.01), "clip_ratio=1.01"),
        (dict(head_dim=64, levels="nf2"), "levels='nf2'"),
        (dict(head_dim=64, sink=10), "sink=10"),
        (dict(head_dim=64, recent=-16), "recent=-16"),
        (dict(head_dim=64, page_size=12), "page_size=12"),
    ],
)
def test_invalid_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OscarConfig(**kwargs)


def test_unsupported_metadata_dtype_and_bad_json():
    with pytest.raises(NotImplementedError, match="float32"):
        OscarConfig(head_dim=64, metadata_dtype="float32")
    with pytest.raises(ValueError, match="format_version=2"):
        OscarConfig.from_dict({"format_version": 2, "head_dim": 64})
    with pytest.raises(ValueError, match="unknown OscarConfig fields"):
        OscarConfig.from_dict({"head_dim": 64, "bits": 2})


def test_from_artifact_takes_the_codec_and_clip_from_the_artifact_and_tiers_from_the_arguments():
    """The one place both runtimes (oscar_jax.runtime, oscar_torch.hf) build their config."""
    from shared_math.tests.test_artifact import make_artifact

    art = make_artifact()  # head_dim 16, G 16, clip 0.96 / 0.92 per layer
    art.k_clip_ratio[:] = [0.5, 0.75]  # per layer: the config takes layer 0's
    art.codec["levels"] = "moments"
    config = OscarConfig.from_artifact(art)
    defaults = OscarConfig(head_dim=16)
    assert (config.head_dim, config.group_size, config.levels) == (16, 16, "moments")
    assert (config.k_clip_ratio, config.v_clip_ratio) == (0.5, float(np.float32(0.92)))
    assert (config.sink, config.recent, config.page_size) == (defaults.sink, defaults.recent, defaults.page_size)
    chosen = OscarConfig.from_artifact(art, group_size=16, sink=0, recent=32, page_size=8)
    assert (chosen.sink, chosen.recent, chosen.page_size) == (0, 32, 8)
    with pytest.raises(ValueError, match="recent=20 must be a non-negative multiple of page_size=16"):
        OscarConfig.from_artifact(art, recent=20)
    with pytest.raises(ValueError, match="group_size"):
        OscarConfig.from_artifact(art, group_size=32)  # wider than head_dim 16
