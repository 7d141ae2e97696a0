"""kvcore: a formally specified KV-cache offloading core for LLM inference engines.

The public surface is exactly the names below; everything else lives in underscore
modules. The safety rules are defined once, as executable invariants, in ``kvcore.spec``.
"""

from kvcore.spec.errors import ConfigError, InvariantViolation, KVCopyError

__all__ = ["ConfigError", "InvariantViolation", "KVCopyError"]
