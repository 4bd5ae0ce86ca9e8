"""Model I/O: safetensors weights, tokenizers and chat templates, checkpoint converters."""
