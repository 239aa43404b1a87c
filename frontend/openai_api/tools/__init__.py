"""Tool calling for the OpenAI API: parsers per model family, streaming deltas, tool_choice."""
