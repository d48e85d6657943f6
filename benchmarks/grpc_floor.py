"""The floor of Python gRPC here: a bare grpc.aio server that streams prebuilt
GenerateStreamResponse messages (one token each, the size ours sends) with no engine."""

from __future__ import annotations

import argparse
import asyncio

import grpc

from vllm_router.proto import vllm_engine_pb2 as pb
from vllm_router.proto import vllm_engine_pb2_grpc as pb_grpc


class FloorServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, output_len: int) -> None:
        self._messages = [
            pb.GenerateStreamResponse(
                request_id="0123456789abcdef0123456789abcdef",
                token_ids=[100 + i],
                text_delta=f" {100 + i}",
                usage=pb.Usage(prompt_tokens=32, completion_tokens=i + 1),
            )
            for i in range(output_len)
        ]

    async def GetModelInfo(self, request, context):
        # Enough for `vllm-servicer-client bench` to drive this server.
        return pb.GetModelInfoResponse(model_name="grpc-floor", vocab_size=512, max_model_len=512)

    async def GenerateStream(self, request, context):
        for message in self._messages:
            yield message


def _channel_arg(text: str) -> tuple[str, int | str]:
    name, _, value = text.partition("=")
    return (name, int(value)) if value.lstrip("-").isdigit() else (name, value)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gRPC channel argument for the server (integers as such), to measure its effect",
    )
    args = parser.parse_args()
    options = [_channel_arg(text) for text in args.option]
    server = grpc.aio.server(options=options)
    pb_grpc.add_VllmEngineServicer_to_server(FloorServicer(args.output_len), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    print(f"grpc-floor ready on 127.0.0.1:{args.port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main())
