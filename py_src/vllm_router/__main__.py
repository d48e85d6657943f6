"""`python -m vllm_router`: the `vllm-servicer` command."""

from .cli import main

main()
