"""Engine integrations: Hugging Face transformers (and, in a later step, a vLLM model-loader plugin)."""
