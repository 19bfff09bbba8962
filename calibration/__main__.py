"""CLI: python -m calibration --model-path … --calib-data … --calib-tokens 8192 --output-dir …"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from calibration.calibrate import KEY_TARGETS, VALUE_TARGETS, CalibrationOptions, calibrate, main_command
from calibration.methods import DEFAULT_KEY_GROUP
from shared_math.rotation import ROTATION_KINDS
from shared_math.spec import LEVELS


def parse_args(argv=None) -> CalibrationOptions:
    p = argparse.ArgumentParser(prog="python -m calibration", description=__doc__)
    p.add_argument("--model-path", default="smollm2-135m", help="smollm2-135m, a .gguf file, or an HF directory")
    p.add_argument("--calib-data", default="wiki", help="'wiki' (calibration split) or a UTF-8 .txt file")
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence")
    p.add_argument("--heldout-tokens", type=int, default=1024, help="held-out tokens for clip fitting and the report")
    p.add_argument("--group-size", type=int, default=None, help="default min(head_dim, 128)")
    p.add_argument("--levels", choices=LEVELS, default="minmax")
    p.add_argument("--k-clip-ratio", type=float, default=0.96)
    p.add_argument("--v-clip-ratio", type=float, default=0.92)
    p.add_argument("--fit-clip", action="store_true", help="per layer, choose clip ratios minimising held-out error")
    p.add_argument("--rotation-kind", choices=ROTATION_KINDS, default="oscar")
    p.add_argument("--key-target", choices=KEY_TARGETS, default="query", help="query = C_Q (paper); key = KᵀK")
    p.add_argument("--value-target", choices=VALUE_TARGETS, default="attention_output",
                   help="attention_output = C_S (paper); surrogate = authors' weighted VᵀV; value = VᵀV")
    p.add_argument("--per-layer", action="store_true", help="one rotation per layer instead of per (layer, KV head)")
    p.add_argument("--seed", type=int, default=0, help="0 = documents in title order; else a seeded shuffle")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices the weights are split over; each layer runs whole on the first, so the "
                        "artifact is the one-device artifact, byte for byte")
    p.add_argument("--key-layout", choices=("token", "channel"), default="token",
                   help="token = format v1 (keys per token); channel = format v2: keys per channel over a "
                        "group of tokens, the artifact records key_layout 'channel' and its key clip "
                        "ratios are over a channel's values in a group (FORMAT.md § Format v2)")
    p.add_argument("--key-group", type=int, default=None,
                   help=f"with --key-layout channel: tokens per key group for the key clip fit and the "
                        f"report, recorded as the codec's key_group: the page of a cache built from the "
                        f"artifact (default {DEFAULT_KEY_GROUP})")
    a = p.parse_args(argv)
    if a.key_group is not None and a.key_layout != "channel":
        p.error("--key-group applies only with --key-layout channel")
    try:
        return CalibrationOptions(
            model_path=a.model_path, calib_data=a.calib_data, calib_tokens=a.calib_tokens,
            output_dir=a.output_dir, seq_len=a.seq_len, heldout_tokens=a.heldout_tokens,
            group_size=a.group_size, levels=a.levels, k_clip_ratio=a.k_clip_ratio,
            v_clip_ratio=a.v_clip_ratio, fit_clip=a.fit_clip, rotation_kind=a.rotation_kind,
            key_target=a.key_target, value_target=a.value_target, per_layer=a.per_layer,
            seed=a.seed, progress=not a.no_progress, tensor_parallel_size=a.tensor_parallel_size,
            key_layout=a.key_layout, key_group=a.key_group or DEFAULT_KEY_GROUP,
        )
    except ValueError as e:
        p.error(str(e))


def main(argv=None) -> int:
    opts = parse_args(argv)
    try:
        artifact, report = calibrate(opts, command=main_command(argv))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    errs = report["heldout_errors"]
    print(f"\nwrote {report['artifact']} in {report['seconds']} s")
    print(f"  rotations {list(artifact.k_rotation.shape)} (K and V), codec {artifact.codec}")
    print(f"  clip ratios K {sorted(set(report['k_clip_ratio']))}  V {sorted(set(report['v_clip_ratio']))}")
    if opts.key_layout == "channel":
        print(f"  keys per channel over groups of {opts.key_group} tokens (format v2); K clip per layer "
              f"{[round(c, 2) for c in report['k_clip_ratio']]}")
    for kind, e in errs.items():
        print(f"  held-out {kind:>14}: key logit error {np.mean(e['key_logit']):.4f}, "
              f"value output error {np.mean(e['value_output']):.4f}")
    print(f"  report: {opts.output_dir}/report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
