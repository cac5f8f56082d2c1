"""Errors the engine raises to the layers above it, importable without torch (the API server catches them)."""


class EngineDeadError(RuntimeError):
    """The engine can serve nothing more (vLLM's name): its device is unusable (device_errors.py) or MAX_FAILED_STEPS
    steps failed in a row. Raised out of `step()`; the engine loop fails every request and reports itself dead
    (/health 503, new requests 503), so a router or a supervisor replaces the node."""
