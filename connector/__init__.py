"""himamba.connector: the vLLM glue, config, and the index that drives the tiers.

``HiMambaConnector`` is resolved lazily so that importing this package (as
vLLM's plugin loader and the config process do) never pulls in torch or vLLM
internals before they are needed.
"""

from typing import Any

__all__ = ["HiMambaConnector"]


def __getattr__(name: str) -> Any:
    if name == "HiMambaConnector":
        from himamba.connector.vllm_connector import HiMambaConnector

        return HiMambaConnector
    raise AttributeError(name)
