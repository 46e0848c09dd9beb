# What the docs' vLLM fragments take as imported.
from vllm import SamplingParams
