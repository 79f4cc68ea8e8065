"""Parsers of a chat model's generated text: its reasoning span and its tool calls, incremental over
the detokenized stream (any chunk split gives the same result as the whole text)."""
