"""The Gemma 4 forward (the only room that knows the math)."""
