"""The format constants and the validated configuration."""

import dataclasses

import numpy as np
import pytest

from shared_math.spec import FORMAT_VERSION, OscarConfig, clip_index


def test_defaults_and_clip_indices():
    cfg = OscarConfig(head_dim=128)
    assert FORMAT_VERSION == 2 and cfg.format_version == 1 and cfg.key_layout == "token"
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
        (dict(head_dim=64, key_layout="diag"), "key_layout='diag'"),
        (dict(head_dim=64, key_layout="channel", page_size=8, sink=0, recent=0), "page_size=8 must be >= 16"),
    ],
)
def test_invalid_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OscarConfig(**kwargs)


def test_unsupported_metadata_dtype_and_bad_json():
    with pytest.raises(NotImplementedError, match="float32"):
        OscarConfig(head_dim=64, metadata_dtype="float32")
    with pytest.raises(ValueError, match="format_version=3"):
        OscarConfig.from_dict({"format_version": 3, "head_dim": 64})
    with pytest.raises(ValueError, match="format_version=1 cannot hold key_layout='channel'"):
        OscarConfig.from_dict({"format_version": 1, "head_dim": 64, "key_layout": "channel"})
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


def test_key_layout_channel_is_format_v2_and_a_v1_config_serializes_as_before():
    v1 = OscarConfig(head_dim=64)
    assert v1.to_dict()["format_version"] == 1 and "key_layout" not in v1.to_dict()
    assert OscarConfig.from_dict({"format_version": 1, "head_dim": 64}) == v1
    v2 = OscarConfig(head_dim=64, group_size=64, page_size=64, key_layout="channel", k_clip_ratio=0.9)
    assert v2.format_version == 2 and v2.to_dict()["key_layout"] == "channel"
    assert OscarConfig.from_json(v2.to_json()) == v2
    # per-channel keys clip over the page's 64 tokens: floor(0.9 · 64) = 57; values over d as ever
    assert (v2.k_clip_index, v2.v_clip_index) == (57, clip_index(0.92, 64))
    assert OscarConfig.from_dict({"format_version": 2, "head_dim": 64}).key_layout == "token"


def test_caches_refuse_per_channel_keys_until_they_store_them():
    from shared_math.spec import require_token_keys

    require_token_keys(OscarConfig(head_dim=64), "cache")  # v1: accepted
    with pytest.raises(NotImplementedError, match="cache stores keys per token .* key_layout='channel'"):
        require_token_keys(OscarConfig(head_dim=64, key_layout="channel"), "cache")


def test_per_channel_key_artifacts_fix_the_page_to_their_key_group():
    """A key page is one group per channel, so its size sets the key bits and the group the key clips
    were fitted over: a per-channel artifact's page is its codec's key_group (64 when written before
    the field: 2.5 bits a key element), and another page_size is refused, naming both."""
    from shared_math.spec import DEFAULT_CHANNEL_PAGE_SIZE
    from shared_math.tests.test_artifact import make_artifact

    art = make_artifact()
    art.codec["key_layout"] = "channel"
    config = OscarConfig.from_artifact(art)
    assert config.key_layout == "channel" and config.page_size == DEFAULT_CHANNEL_PAGE_SIZE == 64
    assert art.key_group == 64 and OscarConfig.from_artifact(art, page_size=64).page_size == 64
    with pytest.raises(ValueError, match="page_size=16: the artifact's key clip ratios were fitted over groups of 64"):
        OscarConfig.from_artifact(art, page_size=16, sink=16, recent=32)
    art.codec["key_group"] = 16
    assert OscarConfig.from_artifact(art, sink=16, recent=32).page_size == 16
    del art.codec["key_layout"], art.codec["key_group"]
    assert OscarConfig.from_artifact(art).page_size == 16 and art.key_group is None
