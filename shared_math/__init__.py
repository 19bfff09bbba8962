"""shared_math — the NumPy reference of the OSCAR cache format (v1, and v2's per-channel keys): the spec in code.

Imports only numpy and the standard library (plus safetensors inside the artifact reader/writer);
never a backend. Every backend is judged against these functions bit for bit.
"""

from shared_math.artifact import (
    ArtifactError,
    ModelFingerprint,
    RotationArtifact,
    read_artifact,
    write_artifact,
)
from shared_math.attention import (
    merge_partials,
    mixed_tier_decode_attention,
    softmax_attention,
    split_attention,
)
from shared_math.codec import decode, decode_channels, encode, encode_channels, pack_codes, unpack_codes
from shared_math.hadamard import fwht, hadamard_matrix
from shared_math.rotation import (
    ROTATION_KINDS,
    bit_reversal_permutation,
    bit_reverse_indices,
    oscar_rotation,
    rotation_from_covariance,
)
from shared_math.spec import FORMAT_VERSION, OscarConfig, clip_index
from shared_math.tiers import (
    TierSplit,
    ideal_bits_per_element,
    kv_bytes_per_layer,
    tier_split,
)

__all__ = [
    "ArtifactError", "FORMAT_VERSION", "ModelFingerprint", "OscarConfig", "ROTATION_KINDS",
    "RotationArtifact", "TierSplit", "bit_reversal_permutation", "bit_reverse_indices",
    "clip_index", "decode", "decode_channels", "encode", "encode_channels", "fwht", "hadamard_matrix", "ideal_bits_per_element",
    "kv_bytes_per_layer", "merge_partials", "mixed_tier_decode_attention", "oscar_rotation",
    "pack_codes", "read_artifact", "rotation_from_covariance", "softmax_attention",
    "split_attention", "tier_split", "unpack_codes", "write_artifact",
]
