"""Re-export: the wheel cache is backend-neutral and lives in shared_math.wheel_cache."""

from shared_math.wheel_cache import WheelMember, cache_dir, fetch_wheel_member, log, sha256_of

__all__ = ["WheelMember", "cache_dir", "fetch_wheel_member", "log", "sha256_of"]
