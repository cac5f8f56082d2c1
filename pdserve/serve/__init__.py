"""OpenAI-compatible HTTP serving: `pdserve serve MODEL_DIR` (api_server), the async engine that runs the engine loop
apart from the event loop (async_engine, engine_core), request parsing (protocol), responses (serving), Prometheus
metrics (metrics) and OpenAI-shaped errors (errors)."""
