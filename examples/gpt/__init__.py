"""A small character-level GPT built on stacktools."""
