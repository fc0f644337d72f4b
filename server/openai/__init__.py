"""OpenAI-compatible HTTP frontend: one module per route family (chat, completions, tokenize, models, disagg),
each with its wire models and its serving, mounted by app.py; what two routes share is a module of its own."""
