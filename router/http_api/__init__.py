"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health,
metrics and the admin view of the workers."""
