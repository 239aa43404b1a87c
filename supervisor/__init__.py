"""Keeps tritonserver serving: watches the python-backend processes of our models from
outside, reports health and failures, and recovers (see docs/reliability.md)."""
