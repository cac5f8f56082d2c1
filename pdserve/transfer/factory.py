"""Connectors by name, registered by module path and imported only when first made (vLLM's kv_connector/factory.py):
nothing here imports a transport, so the registry is no import circle, and a node without P/D imports none of them
(the transports need server packages, e.g. cryptography, that a GPU benchmark machine may lack)."""
from __future__ import annotations

import importlib
from typing import Callable, Optional

from pdserve.transfer.base import ConnectorContext, KVConnector

_REGISTRY: dict[str, tuple[str, str]] = {}  # name -> (module path, class name)


def register_connector(name: str, module_path: str, class_name: str) -> None:
    if name in _REGISTRY and _REGISTRY[name] != (module_path, class_name):
        raise ValueError(f"KV connector {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = (module_path, class_name)


def connector_class(name: str) -> type[KVConnector]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV connector {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    module_path, class_name = _REGISTRY[name]
    return getattr(importlib.import_module(module_path), class_name)


def make_connector(config, context: Callable[[], ConnectorContext]) -> Optional[KVConnector]:
    """The connector `config` names, or None; `context` is called only when one is made."""
    # the arrival driver works through LLMEngine.add_prefilled_request: nothing to connect
    if config is None or config.kv_connector == "DecodeBenchConnector":
        return None
    return connector_class(config.kv_connector)(config, context())


register_connector("TcpConnector", "pdserve.transfer.tcp.connector", "TcpConnector")
register_connector("NixlConnector", "pdserve.transfer.nixl.connector", "NixlConnector")  # imports nixl when made
register_connector("MultiConnector", "pdserve.transfer.multi", "MultiConnector")
