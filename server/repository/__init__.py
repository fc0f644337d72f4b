"""Triton-style model repositories: parse config.pbtxt, pick versions, stage models for Triton, control loading."""
