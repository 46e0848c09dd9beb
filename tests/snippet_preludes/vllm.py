# What the docs' vLLM fragments take as imported.
from vllm import SamplingParams  # noqa: F401 (the fragment uses it)
