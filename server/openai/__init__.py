"""OpenAI-compatible HTTP frontend: protocol.py (wire models), serving.py (logic), app.py (FastAPI routes)."""
