"""NVIDIA Dynamo front door for our engine: `python -m backend.dynamo_worker`."""
