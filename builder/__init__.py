"""Turns a local Hugging Face checkpoint into a Triton model-repository entry."""
