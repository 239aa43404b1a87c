"""KV blocks beyond the device pool: the connector interface (connector.py), shaped like
vLLM's KVConnector so other stores (LMCache, NIXL) can plug in, and the host-memory tier
built on it (host_tier.py: the scheduler's index, host_cache.py: the copies)."""
