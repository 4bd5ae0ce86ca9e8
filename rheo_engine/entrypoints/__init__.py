"""What users run: the CLI, the HTTP server (and its OpenAI schema), the demo and info."""
