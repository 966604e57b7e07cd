"""File formats: GGUF and HF safetensors -> canonical tensors + ModelConfig (the only room that knows formats)."""
