"""Triton-style model repositories: parse config.pbtxt, pick versions, and run the control modes.

How a model is staged and served is the backends' business: the manager is handed a `BackendRegistry`
(server.repository.backend) and imports no backend.
"""
