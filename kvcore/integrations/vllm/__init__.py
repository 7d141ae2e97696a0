"""kvcore as a vLLM KV connector (tested with vLLM 0.33.0).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvcoreConnector",
        "kv_connector_module_path": "kvcore.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 8589934592, "eviction_policy": "lru"}}'

Importing this package without vLLM raises ImportError telling how to install it
(``pip install kvcore[vllm]``); nothing else in kvcore imports it. See docs/vllm.md.
"""

from __future__ import annotations

from kvcore.integrations.vllm._compat import INSTALL_HINT, TESTED_VLLM
from kvcore.integrations.vllm.config import ConnectorOptions, translate
from kvcore.integrations.vllm.connector import KvcoreConnector
from kvcore.integrations.vllm.metadata import KvcoreConnectorMetadata, KvcoreWorkerMetadata

__all__ = ["INSTALL_HINT", "TESTED_VLLM", "ConnectorOptions", "KvcoreConnector",
           "KvcoreConnectorMetadata", "KvcoreWorkerMetadata", "translate"]
