"""The HTTP frontend: OpenAI API, tokenizing, detokenizing, streaming."""
