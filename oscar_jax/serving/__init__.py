"""Serving over OscarRuntime: engine.py (scheduler), sampling.py, async_engine.py (the engine on
its own thread), server.py (OpenAI-compatible FastAPI app), metrics.py (Prometheus), chat.py (the
model's chat template). The command is `python -m oscar_jax.serve`."""
