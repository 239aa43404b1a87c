"""KV cache events in vLLM's schema (BlockStored, BlockRemoved, AllBlocksCleared),
published over ZMQ as vLLM publishes them, for KV-aware routers (NVIDIA Dynamo's among
them): collector.py gathers them on the engine thread, publisher.py sends them from a
thread of its own, schema.py is the wire format."""
