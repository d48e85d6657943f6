"""`python -m vllm_router.vllm_servicer`: the `vllm-servicer` command."""

from ..cli import main

main()
