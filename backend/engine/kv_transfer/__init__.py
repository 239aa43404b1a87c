"""KV blocks between engines: prefill/decode disaggregation over NIXL."""
