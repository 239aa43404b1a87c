"""The per-row parameter table's columns: sampling_row.py writes a request's row once,
the sampler gathers rows per step, and the processors read their columns."""

TEMPERATURE, TOP_K, TOP_P, REPETITION, PRESENCE, FREQUENCY = range(6)
# Logits processor k (logits_processors.PROCESSORS) reads column FIRST_PROCESSOR_COLUMN + k.
FIRST_PROCESSOR_COLUMN = 6
