"""Strata's serving process: repository, backends, Triton binding, engine, router, OpenAI frontend, metrics."""
