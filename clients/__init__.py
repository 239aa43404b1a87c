"""Clients for the served model: gRPC streaming, benchmarks, server launcher."""
