"""The OpenAI-compatible HTTP server (``leanserve serve``): app factory in :mod:`.api_server`."""
